"""The platform's command lines, written once (``scheduling.supervision``) for supervisord, the
benchmarks' platform and the end-to-end tests' platform."""

from __future__ import annotations

from pathlib import Path

from scheduling.supervision import beat_argv, platform_programs, scheduler_argv, supervisord_config, web_argv


def test_the_supervised_programs_are_the_shared_command_lines():
    programs = {p.name: p for p in platform_programs(host="0.0.0.0", port=8100, python="py")}
    assert programs["web"].argv == web_argv(host="0.0.0.0", port=8100, python="py")
    assert programs["web"].argv[-7:] == (
        "--host",
        "0.0.0.0",
        "--port",
        "8100",
        "--ws",
        "websockets",
        "--no-access-log",
    )
    assert programs["scheduler"].argv == scheduler_argv(python="py")
    assert programs["scheduler"].stopwaitsecs == 70  # a Celery worker finishes its tasks
    assert programs["beat"].argv == beat_argv(python="py")


def test_a_node_name_and_a_beat_schedule_file_are_options():
    assert scheduler_argv(node_name="bench-1@%h", python="py")[-3:] == ("bench-1@%h", "--loglevel", "INFO")
    assert beat_argv(schedule=Path("/tmp/beat"), python="py")[-2:] == ("-s", "/tmp/beat")


def test_the_generated_config_escapes_celerys_percent(tmp_path):
    config = supervisord_config(platform_programs(host="127.0.0.1", port=8100, python="py"), run_dir=tmp_path)
    assert "-n scheduler@%%h" in config
    assert "[program:web]" in config and "[program:beat]" in config


def test_a_host_cache_is_supervised_only_when_models_are_named():
    assert "hostcache" not in {p.name for p in platform_programs(host="127.0.0.1", port=8100, python="py")}
    programs = {
        p.name: p
        for p in platform_programs(
            host="127.0.0.1", port=8100, python="py", hostcache_models=["demo", "tiny"]
        )
    }
    assert programs["hostcache"].argv == (
        "py",
        "manage.py",
        "hostcache",
        "--model",
        "demo",
        "--model",
        "tiny",
    )
