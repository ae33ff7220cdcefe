"""Which tests are ``e2e``, ``browser`` or ``slow``: rules applied at collection (tests/conftest.py).

- ``e2e``: the test starts real processes: the platform (ASGI server, Celery worker and beat), worker
  daemons, torch peers (multiprocessing), a fresh interpreter, ``lint-imports``, a private Redis or
  PostgreSQL. Decided by directory (``tests/e2e/``), by a fixture the test uses (``PROCESS_FIXTURES``)
  or by name (``PROCESS_TESTS``: tests that start processes in their own body). The spawn guard
  in tests/conftest.py fails any test that starts a process without the marker, naming the fixture
  or test to list here, so the rules cannot drift. Tools a test or the standard library runs in
  passing (``git``, ``make``, ``ldconfig`` …, ``INCIDENTAL_PROGRAMS``) do not count.
- ``browser``: the test drives Chromium (``tests/browser/``, ``BROWSER_FIXTURES``); the guard
  knows Playwright's driver.
- ``slow``: by name (``SLOW``: above ~3 s, or slow by design), through an expensive fixture
  (``SLOW_FIXTURES``), or measured: ``tests/durations.json`` holds each test's seconds (setup + call
  + teardown) from a whole-suite run on the reference machine (2 shared cores, the suite's own two
  xdist workers), and a test measured at ``SLOW_S`` or more is slow. ``make test-durations``
  re-measures (``pytest --record-durations``). The run's summary names tests that took more than
  ``SLOW_REPORT_S`` without the marker.

``make test-fast`` deselects all three. Entries are ``path::function`` (every parametrisation),
``path::function[id]`` (one) or ``path`` (a whole module); fixtures are ``<where defined>::<name>``,
where is the conftest's folder or the test module.
"""

from __future__ import annotations

import functools
import json
import multiprocessing.process
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

E2E_DIRS = ("tests/e2e/",)
BROWSER_DIRS = ("tests/browser/",)

PROCESS_FIXTURES = frozenset(
    {
        "tests/e2e::platform",
        "tests/e2e/test_chaos.py::chaos_platform",
        "tests/e2e/test_chaos_h264.py::h264_platform",
        "tests/e2e::demo_platform",
        "tests/browser::asgi_server",
        "tests/browser::media_server",
        "tests/sessions/test_webrtc_consumer.py::a_media_process",
        "tests/gpu/test_local_orphans.py::started_pids",
        "tests/gpu/test_provisioner_local.py::make_local",
        "tests/scheduling/test_jobs_move_live.py::two_workers",
        "tests/scheduling/test_region_moves_workers.py::two_regions",
        "tests/scheduling/test_stages_failover_e2e.py::encoders",
        "tests/workers/test_dc_job_abandon_live.py::encoders",
        "tests/workers/test_jobs_beside_streams.py::worker",
        "tests/workers/test_jobs_daemon.py::workers",
        "tests/workers/test_stage_live_gaps.py::encoders",
        "tests/workers/test_stage_roles.py::encoder_worker",
        "tests/workers/test_stage_split_jobs.py::encoders",
        "tests/workers/test_wan_jobs_daemon.py::workers",
        "tests/workers_runtime/test_migration.py::workers",
        "tests/workers_runtime/test_weights_transfer.py::spawn",
    }
)

PROCESS_TESTS = frozenset(
    {
        "tests/bench/test_commands.py::test_bench_activation_measures_the_control_plane_share",
        "tests/bench/test_commands.py::test_bench_delivery_delivers_every_chunk_to_every_stream",
        "tests/bench/test_commands.py::test_bench_delivery_at_the_models_size_delivers_photo_fragments_sent_beside_their_messages",
        "tests/bench/test_commands.py::test_bench_glass_reports_glass_to_glass_for_each_transport_in_chromium",
        "tests/bench/test_commands.py::test_bench_delivery_with_webrtc_viewers_reports_the_web_loop_lag_beside_the_socket_delay",
        "tests/bench/test_commands.py::test_soak_reports_what_its_clients_saw_and_every_process_memory",
        "tests/controlplane/test_layers.py::test_every_contract_holds",
        "tests/controlplane/test_layers.py::test_a_forbidden_import_breaks_its_contract",
        "tests/controlplane/test_layers.py::test_an_import_circle_in_workers_breaks_its_contract",
        "tests/controlplane/test_process_death.py",
        "tests/controlplane/test_web_imports.py",
        "tests/workers/test_worker_imports.py",
        "tests/controlplane/test_settings.py::test_malformed_variable_fails_at_start_naming_it",
        "tests/controlplane/test_settings.py::test_secret_key_is_required_when_debug_is_off",
        "tests/controlplane/test_settings.py::test_debug_is_off_unless_asked_for",
        "tests/controlplane/test_settings.py::test_defaults_work_on_this_machine",
        "tests/controlplane/test_settings.py::test_every_variable_is_read_into_settings_once",
        "tests/controlplane/test_settings.py::test_webrtc_ice_servers_are_read_as_rtc_ice_servers",
        "tests/scheduling/test_beat_lock.py",
        "tests/sessions/test_ingest.py::test_records_of_a_killed_worker_are_ingested_once_even_when_the_ingester_runs_twice",
        "tests/workers/test_catalog.py::test_the_catalogue_does_not_import_torch",
        "tests/workers/test_generate_command.py::test_a_deployment_serves_demo_by_default_and_new_sessions_get_it",
        "tests/workers/test_orphan_worker.py",
        "tests/workers/test_stage_commands.py::test_bench_stage_handoff_measures_each_payload_between_two_processes",
        "tests/workers_runtime/test_engine.py::test_process_pool_encoder_produces_the_same_jpeg",
        "tests/workers_runtime/test_layersplit_bench.py::test_layersplit_command_reports_equal_split_chunks",
        "tests/workers_runtime/test_migration.py::test_eight_concurrent_migrations_into_one_worker_each_land_byte_exact",
        "tests/workers_runtime/test_migration.py::test_source_killed_half_way_gives_target_a_clear_error_and_installs_nothing",
        "tests/workers_runtime/test_migration.py::test_target_killed_half_way_gives_source_a_clear_error_and_keeps_state",
        "tests/workers_runtime/test_migration_engine.py",
        "tests/workers_runtime/test_stage_serving.py::test_bench_stage_decode_reports_the_round_trip_and_equal_frames",
        "tests/workers_runtime/test_stage_serving.py::test_bench_stage_roles_reports_both_roles_and_the_round_trip",
        "tests/workers_runtime/test_stages.py::test_one_encoder_process_serves_two_diffusion_workers",
        "tests/workers_runtime/test_stages.py::test_worker_processes_stream_frames_bit_identical_to_one_process",
        "tests/workers_runtime/test_stages_jobs.py::test_a_shared_encoder_routes_each_job_to_the_diffusion_worker_its_job_names",
        "tests/workers_runtime/test_stages_jobs.py::test_one_shot_jobs_through_three_worker_processes_are_bit_identical",
        "tests/workers_runtime/test_stages_wan.py::test_wan_worker_processes_stream_frames_bit_identical_to_generate",
        "tests/workers_runtime/test_wan_causal.py::test_model_paths_registers_a_catalogue_preset_at_startup",
        "tests/workers_runtime/test_wan_contract.py::test_migrated_wan_session_continues_bit_identically_on_the_target",
        "tests/workers_runtime/test_weights_bench.py::test_report_has_every_source_and_ready_workers_step_exactly",
    }
)

BROWSER_FIXTURES = frozenset({"tests/browser::browser"})

# Measured serially (2026-11-28, `pytest --durations=0` under the heavy lock), setup + call + teardown.
SLOW = frozenset(
    {
        "tests/gpu/test_hostcache.py::test_a_load_longer_than_the_heartbeat_timeout_keeps_the_cache_alive_and_its_copy",
        "tests/browser/test_console_pages.py::test_audit_page_totals_and_csv_exports_match_the_api",
        "tests/browser/test_console_pages.py::test_console_shows_workers_updates_live_and_records_actions",
        "tests/browser/test_generate_page.py::test_a_session_plays_as_h264_through_media_source_extensions",
        "tests/browser/test_generate_page.py::test_an_h264_stream_the_browser_refuses_falls_back_to_jpeg",
        "tests/browser/test_generate_page.py::test_log_in_start_watch_steer_pause_resume_and_reconnect",
        "tests/browser/test_generate_page.py::test_the_user_can_choose_jpeg_and_back",
        "tests/browser/test_generate_page.py::test_without_media_source_extensions_the_page_plays_jpeg",
        "tests/browser/test_webrtc_page.py::test_a_session_plays_over_webrtc",
        "tests/browser/test_webrtc_page.py::test_a_refused_offer_falls_back_to_the_socket",
        "tests/browser/test_webrtc_no_media_process.py::test_without_a_media_process_the_page_falls_back_to_the_socket",
        "tests/browser/test_jobs_page.py::test_submit_a_video_job_see_it_queued_follow_it_and_cancel_it",
        "tests/browser/test_player_modules.py::test_mse_player_plays_fragments_and_jumps_over_a_skipped_chunk",
        "tests/controlplane/test_settings.py::test_debug_is_off_unless_asked_for",
        "tests/controlplane/test_settings.py::test_every_variable_is_read_into_settings_once",
        "tests/controlplane/test_settings.py::test_webrtc_ice_servers_are_read_as_rtc_ice_servers",
        "tests/controlplane/test_settings.py::test_secret_key_is_required_when_debug_is_off",
        "tests/e2e/test_multi_host.py",
        "tests/e2e/test_supervision.py",
        "tests/e2e/test_viewers.py",
        "tests/gpu/test_parameter_pool.py::test_property_host_copies_never_exceed_the_bound",
        "tests/gpu/test_weights_loading.py::test_auto_falls_back_to_disk_when_the_plan_source_is_gone",
        "tests/scheduling/test_beat_lock.py::test_a_second_beat_on_the_same_broker_exits_non_zero_naming_the_first",
        "tests/scheduling/test_job_scaling.py::test_a_job_backlog_due_soon_scales_the_pool_out[True]",
        "tests/scheduling/test_pipeline_live_sim.py::test_a_trace_gets_the_same_decisions_live_and_in_the_simulator",
        "tests/scheduling/test_stages_failover_e2e.py",
        "tests/workers/test_daemon.py::test_a_worker_that_lost_its_control_plane_checkpoints_its_sessions_and_stops",
        "tests/workers/test_dc_job_abandon_live.py",
        "tests/workers/test_jobs_beside_streams.py",
        "tests/workers/test_jobs_daemon.py::test_a_paused_job_moves_to_another_worker_and_finishes_with_the_uninterrupted_mp4",
        "tests/workers/test_jobs_daemon.py::test_a_session_start_abandons_the_job_step_in_flight_and_the_job_still_ends_with_the_uninterrupted_mp4",
        "tests/workers/test_orphan_worker.py",
        "tests/workers/test_restart_audit.py",
        "tests/workers/test_stage_live_gaps.py",
        "tests/workers/test_stage_roles.py::test_a_dc_daemon_fed_by_an_encoder_process_streams_the_monolithic_frames",
        "tests/workers/test_stage_split_jobs.py",
        "tests/workers/test_stage_weights.py::test_bench_stage_reload_reports_the_freed_bytes_and_both_sources",
        "tests/workers/test_wan_jobs_daemon.py::test_a_paused_wan_video_moves_to_another_worker_and_finishes_with_the_uninterrupted_mp4",
        "tests/workers_runtime/test_layersplit_bench.py::test_layersplit_command_reports_equal_split_chunks",
        "tests/workers_runtime/test_stage_serving.py::test_bench_stage_decode_reports_the_round_trip_and_equal_frames",
        "tests/workers_runtime/test_stage_serving.py::test_bench_stage_roles_reports_both_roles_and_the_round_trip",
        "tests/workers_runtime/test_stages_wan.py::test_wan_worker_processes_stream_frames_bit_identical_to_generate",
        "tests/workers_runtime/test_wan_causal.py::test_model_paths_registers_a_catalogue_preset_at_startup",
        "tests/workers_runtime/test_wan_contract.py::test_migrated_wan_session_continues_bit_identically_on_the_target",
        "tests/workers_runtime/test_weights_bench.py::test_report_has_every_source_and_ready_workers_step_exactly",
        "tests/workers_runtime/test_weights_transfer.py::test_stalled_source_times_out_and_disk_completes",
    }
)

# Module-scoped fixtures that take seconds to build: whichever test runs first pays for them.
SLOW_FIXTURES = frozenset({"tests/scheduling_core/test_reproduce.py::quick_report"})

SLOW_REPORT_S = 5.0  # above ~3 s with room for a loaded machine

# The edit loop's bound: a test measured at a second or more (tests/durations.json) is left to
# `make test`. Most of the suite's unit tests take well under 0.3 s; the ones above a second drive
# the live loop, a solver or a model through many steps.
SLOW_S = 1.0
DURATIONS_FILE = Path(__file__).with_name("durations.json")
RECORD_FLOOR_S = 0.5  # durations below this are not kept in the file


@functools.cache
def measured() -> dict[str, float]:
    """Seconds per test node id from ``tests/durations.json`` (empty when the file is absent)."""
    try:
        data = json.loads(DURATIONS_FILE.read_text())
    except FileNotFoundError:
        return {}
    return {str(nodeid): float(seconds) for nodeid, seconds in data["seconds"].items()}


def longest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with whole test files ordered by their measured seconds, longest first (each file's
    own order kept). Under ``--dist loadfile --no-loadscope-reorder`` the xdist workers take files in
    this order: the longest-processing-time-first rule, so no long file starts last and runs alone
    (xdist's own reorder counts tests, and put the 95-second one-test chaos file near the end).
    A test the file does not know yet counts ``SLOW_S`` when it starts processes, else nothing."""
    seconds = measured()
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def expected(item: pytest.Item) -> float:
        if item.nodeid in seconds:
            return seconds[item.nodeid]
        return SLOW_S if item.get_closest_marker("e2e") else 0.0

    order = sorted(by_file, key=lambda path: -sum(expected(item) for item in by_file[path]))
    return [item for path in order for item in by_file[path]]


def measured_slow(nodeid: str) -> bool:
    return measured().get(nodeid, 0.0) >= SLOW_S


def machine() -> str:
    """``x86_64, Intel(R) Xeon(R) … @ 2.50GHz, 2 CPUs``: where durations were measured."""
    import platform

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return ", ".join(part for part in (platform.machine(), model, f"{os.cpu_count()} CPUs") if part)


def durations_document(seconds: dict[str, float], *, command: str, machine: str) -> dict:
    """What ``--record-durations`` writes: the tests at or above ``RECORD_FLOOR_S``, sorted."""
    kept = {nodeid: round(s, 2) for nodeid, s in sorted(seconds.items()) if s >= RECORD_FLOOR_S}
    return {
        "about": "seconds per test (setup + call + teardown); tests/markers.py marks those at or above "
        f"SLOW_S = {SLOW_S} s as slow. Regenerate with `make test-durations`.",
        "command": command,
        "machine": machine,
        "tests_run": len(seconds),
        "seconds": kept,
    }


# Programs that a test, a library or the standard library runs in passing (version stamps, the
# Makefile's variables, ctypes' library search, platform's uname, matplotlib's first font-cache
# build): not the processes ``e2e`` means.
INCIDENTAL_PROGRAMS = frozenset({"git", "make", "ldconfig", "gcc", "cc", "ld", "objdump", "uname", "fc-list"})


COLLECTED = pytest.StashKey[list[pytest.Item]]()  # every collected test, deselected ones included


def _names(nodeid: str) -> tuple[str, str]:
    """``(module path, path::function)`` of a node id (parameters dropped)."""
    path, _, rest = nodeid.partition("::")
    return path, f"{path}::{rest.split('[', 1)[0]}" if rest else path


def listed(nodeid: str, entries: Iterable[str]) -> bool:
    entries = entries if isinstance(entries, (set, frozenset)) else set(entries)
    path, function = _names(nodeid)
    return nodeid in entries or function in entries or path in entries


def fixture_keys(item: pytest.Item) -> set[str]:
    """``<where defined>::<name>`` of every fixture the test uses (directly or through others)."""
    keys = set()
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        if name in item.fixturenames and definitions:
            keys.add(f"{definitions[-1].baseid}::{name}")
    return keys


def markers_for(item: pytest.Item) -> set[str]:
    """The markers the rules give ``item`` (on top of those its module or function declares)."""
    nodeid, fixtures = item.nodeid, fixture_keys(item)
    markers = set()
    if nodeid.startswith(E2E_DIRS) or fixtures & PROCESS_FIXTURES or listed(nodeid, PROCESS_TESTS):
        markers.add("e2e")
    if nodeid.startswith(BROWSER_DIRS) or fixtures & BROWSER_FIXTURES:
        markers.add("browser")
    if listed(nodeid, SLOW) or fixtures & SLOW_FIXTURES or measured_slow(nodeid):
        markers.add("slow")
    return markers


def apply(items: list[pytest.Item]) -> None:
    for item in items:
        present = {mark.name for mark in item.iter_markers()}
        for name in sorted(markers_for(item) - present):
            item.add_marker(name)


# --- the spawn guard ------------------------------------------------------------------


def program_of(argv: object) -> str:
    """The program's file name from Popen's ``args`` (a sequence, or a string for the shell)."""
    first = str(argv[0]) if isinstance(argv, (list, tuple)) and argv else str(argv).split(" ", 1)[0]
    return os.path.basename(first)


def needed_marker(program: str, argv: object) -> str | None:
    """The marker a test that starts ``program`` needs: ``browser`` for Playwright's driver (it
    starts Chromium), ``e2e`` for any other process, None for an incidental tool."""
    if program in INCIDENTAL_PROGRAMS:
        return None
    if isinstance(argv, (list, tuple)) and any(
        "playwright" in str(arg) and "driver" in str(arg) for arg in argv
    ):
        return "browser"
    return "e2e"


class SpawnGuard:
    """Notes each process a test starts (``subprocess.Popen``, ``multiprocessing``, ``os.fork``) with
    the fixture being set up at the time, so a test that starts one without the marker the rules
    should have given it fails, naming what to list in tests/markers.py."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.fixtures: list[str] = []
        self.started: list[tuple[str, str, str | None]] = []  # (marker needed, what, fixture)
        self._restore: list[tuple[object, str, object]] = []

    def install(self) -> None:
        guard = self
        execute_child = subprocess.Popen._execute_child
        process_start = multiprocessing.process.BaseProcess.start
        fork = os.fork

        def _execute_child(popen, args, *rest, **kwargs):
            program = program_of(args)
            what = " ".join(map(str, args[:4])) if isinstance(args, (list, tuple)) else str(args)
            guard.note(needed_marker(program, args), what)
            return execute_child(popen, args, *rest, **kwargs)

        def start(process):
            guard.note("e2e", f"multiprocessing {getattr(process, '_target', None)!r}")
            return process_start(process)

        def _fork():
            guard.note("e2e", "os.fork()")
            return fork()

        for owner, name, replacement in (
            (subprocess.Popen, "_execute_child", _execute_child),
            (multiprocessing.process.BaseProcess, "start", start),
            (os, "fork", _fork),
        ):
            self._restore.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def note(self, marker: str | None, what: str) -> None:
        if marker and self.item is not None:
            self.started.append((marker, what[:160], self.fixtures[-1] if self.fixtures else None))

    def problem(self, item: pytest.Item) -> str | None:
        missing = [(m, what, fixture) for m, what, fixture in self.started if not item.get_closest_marker(m)]
        if not missing:
            return None
        lines = [f"{item.nodeid} started processes without the marker they need:"]
        for marker, what, fixture in dict.fromkeys(missing):
            where = f"fixture {fixture}" if fixture else "the test itself"
            lines.append(f"  {what!r}, started by {where}, needs {marker}")
        lines.append(
            "Give it the marker in tests/markers.py: the fixture in PROCESS_FIXTURES (BROWSER_FIXTURES for "
            "Chromium), or the test in PROCESS_TESTS."
        )
        return "\n".join(lines)
