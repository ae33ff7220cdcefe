"""The marker rules (tests/markers.py) name what exists, and every test they cover carries the marker;
the spawn guard tells which marker a started process needs. Reads this run's collection."""

from __future__ import annotations

import pytest

from tests import isolation, markers


def collected(request) -> list[pytest.Item]:
    """Every test this run collected, those that -m or -k deselected included."""
    return request.config.stash.get(markers.COLLECTED, None) or list(request.session.items)


def collected_modules(items: list[pytest.Item]) -> set[str]:
    return {item.nodeid.split("::", 1)[0] for item in items}


def test_every_test_using_a_process_or_browser_fixture_or_in_their_folders_carries_the_marker(request):
    for item in collected(request):
        fixtures = markers.fixture_keys(item)
        if fixtures & markers.PROCESS_FIXTURES or item.nodeid.startswith(markers.E2E_DIRS):
            assert item.get_closest_marker("e2e"), item.nodeid
        if fixtures & markers.BROWSER_FIXTURES or item.nodeid.startswith(markers.BROWSER_DIRS):
            assert item.get_closest_marker("browser"), item.nodeid
        if fixtures & markers.SLOW_FIXTURES or markers.listed(item.nodeid, markers.SLOW):
            assert item.get_closest_marker("slow"), item.nodeid
        if markers.listed(item.nodeid, markers.PROCESS_TESTS):
            assert item.get_closest_marker("e2e"), item.nodeid


def test_every_listed_test_and_fixture_exists(request):
    # A renamed test or fixture would silently lose its marker; only modules this run collected are
    # checked, so running a subset does not fail here.
    items = collected(request)
    modules = collected_modules(items)
    names = {item.nodeid.split("[", 1)[0] for item in items} | {item.nodeid for item in items} | modules
    for entry in sorted(markers.PROCESS_TESTS | markers.SLOW):
        if entry.split("::", 1)[0] in modules:
            assert entry in names, f"{entry} is listed in tests/markers.py but no such test was collected"
    used = set().union(*(markers.fixture_keys(item) for item in items)) if items else set()
    for key in sorted(markers.PROCESS_FIXTURES | markers.BROWSER_FIXTURES | markers.SLOW_FIXTURES):
        where = key.split("::", 1)[0]
        if any(module == where or module.startswith(where + "/") for module in modules):
            assert key in used, f"{key} is listed in tests/markers.py but no collected test uses it"


def test_every_test_measured_at_the_slow_bound_carries_the_marker(request):
    items = collected(request)
    assert markers.measured(), "tests/durations.json is missing or empty: run make test-durations"
    for item in items:
        if markers.measured().get(item.nodeid, 0.0) >= markers.SLOW_S:
            assert item.get_closest_marker("slow"), item.nodeid


def test_the_durations_document_keeps_what_the_rule_needs():
    seconds = {"tests/a.py::test_quick": 0.01, "tests/a.py::test_slow[1]": 2.345}
    document = markers.durations_document(seconds, command="pytest", machine="box")
    assert document["seconds"] == {"tests/a.py::test_slow[1]": 2.35}
    assert document["tests_run"] == 2 and document["machine"] == "box"
    assert markers.SLOW_S >= markers.RECORD_FLOOR_S  # every test the rule marks is in the file


def test_the_marker_a_started_program_needs():
    assert markers.needed_marker("python", ["/venv/bin/python", "-m", "uvicorn", "app"]) == "e2e"
    assert markers.needed_marker("lint-imports", ["lint-imports", "--no-cache"]) == "e2e"
    driver = ["/venv/lib/site-packages/playwright/driver/node", "/venv/.../playwright/driver/package/cli.js"]
    assert markers.needed_marker("node", driver) == "browser"
    assert markers.needed_marker("git", ["git", "log", "-1"]) is None
    assert markers.needed_marker("uname", "uname -p") is None
    assert markers.program_of(["/usr/bin/redis-server", "--port", "1"]) == "redis-server"
    assert markers.program_of("make -n -p") == "make"


def test_the_guard_names_the_fixture_that_started_a_process_and_the_marker_it_needs(request):
    # given a guard watching this test (which carries no marker) while a fixture starts a server
    guard = markers.SpawnGuard()
    guard.item = request.node
    guard.fixtures.append("tests/e2e::platform")
    guard.note("e2e", "python -m uvicorn controlplane.asgi:application")
    guard.fixtures.pop()
    guard.note("browser", "node cli.js run-driver")
    guard.note(None, "git log -1")
    # then the verdict names both, what started them and where to list them; a tool is ignored
    problem = guard.problem(request.node)
    assert problem is not None
    assert (
        "python -m uvicorn" in problem and "fixture tests/e2e::platform" in problem and "needs e2e" in problem
    )
    assert "node cli.js run-driver" in problem and "needs browser" in problem
    assert "git log" not in problem and "PROCESS_FIXTURES" in problem


class Marked:
    """Stands for a collected test carrying ``names``."""

    nodeid = "tests/e2e/test_page.py::test_live"

    def __init__(self, *names: str) -> None:
        self.names = names

    def get_closest_marker(self, name: str):
        return pytest.mark.__getattr__(name) if name in self.names else None


def test_the_guard_accepts_a_test_with_the_markers_its_processes_need():
    guard = markers.SpawnGuard()
    guard.item = Marked("e2e", "browser")
    guard.note("e2e", "python -m celery")
    guard.note("browser", "node cli.js run-driver")
    assert guard.problem(Marked("e2e", "browser")) is None
    problem = guard.problem(Marked("e2e"))
    assert problem is not None and "needs browser" in problem and "needs e2e" not in problem


def test_each_xdist_worker_gets_redis_databases_no_other_worker_or_benchmark_uses():
    assert isolation.redis_db("redis://127.0.0.1:6379/8") == 8
    assert isolation.redis_db("redis://127.0.0.1:6379") == 0
    assert isolation.redis_db("unix:///run/redis.sock?db=3") == 3
    for base, workers in ((0, 1), (0, 4), (8, 2)):
        assert isolation.layout_problem(base, workers) is None
        dbs = [isolation.own_db(base, s) for s in range(workers)]
        dbs += [isolation.e2e_broker_db(s) for s in range(workers)]
        dbs += [isolation.browser_server_db(s) for s in range(workers)]
        assert len(set(dbs)) == len(dbs) and not set(dbs) & isolation.BENCH_DATABASES
    assert "fewer workers" in isolation.layout_problem(8, 3)
    assert isolation.worker_redis_url("redis://:pw@10.0.0.1:6380/8", 1) == "redis://:pw@10.0.0.1:6380/9"
