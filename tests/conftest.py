from __future__ import annotations

import os

import pytest
import redis
from django.conf import settings
from rest_framework.test import APIClient

from tests import isolation, markers
from tests.factories import StaffFactory, UserFactory


@pytest.fixture
def user(db):
    return UserFactory()


@pytest.fixture
def other_user(db):
    return UserFactory()


@pytest.fixture
def staff(db):
    return StaffFactory()


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def user_api(user):
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def staff_api(staff):
    client = APIClient()
    client.force_authenticate(staff)
    return client


@pytest.fixture(scope="session", autouse=True)
def one_round_password_hashes():
    """Users made by the suite get one-round PBKDF2 hashes (tests/hashers.py): ~0.23 s of CPU each
    at the default rounds, hundreds of users. The production hashers still verify every hash."""
    from django.test import override_settings

    with override_settings(
        PASSWORD_HASHERS=["tests.hashers.OneRoundPBKDF2PasswordHasher", *settings.PASSWORD_HASHERS]
    ):
        yield


@pytest.fixture(scope="module", autouse=True)
def own_redis_database_emptied():
    """Under xdist, each test module starts from an empty Redis database of its own worker.

    A module that kills a process holding a lease (a chaos test's SIGKILL of the scheduler inside
    its decision run) leaves that lease to expire on its own (60 s for the scheduler lock); the next
    module on the same worker must not wait on it. Without xdist the database may be a developer's
    (tests/isolation.py), so nothing is deleted there.
    """
    if isolation.SLOT_ENV in os.environ:
        redis.Redis.from_url(settings.REDIS_URL).flushdb()
    yield


# --- markers, xdist workers, the spawn guard (tests/markers.py says which test is which) ---------


def pytest_collection_modifyitems(config, items):
    markers.apply(items)
    items[:] = markers.longest_files_first(items)
    # The whole collection, before -m or -k deselect any (tests/test_markers.py reads it).
    config.stash[markers.COLLECTED] = list(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config, specs):
    """Give each worker its own Redis database before it starts (tests/isolation.py): the settings
    read REDIS_URL when pytest-django imports them, before this conftest runs in the worker."""
    base_url = settings.REDIS_URL
    problem = isolation.layout_problem(isolation.redis_db(base_url), len(specs))
    if problem:
        raise pytest.UsageError(problem)
    for slot, spec in enumerate(specs):
        spec.env[isolation.SLOT_ENV] = str(slot)
        spec.env["REDIS_URL"] = isolation.worker_redis_url(base_url, slot)


spawn_guard = markers.SpawnGuard()


def pytest_configure(config):
    spawn_guard.install()
    config.add_cleanup(spawn_guard.uninstall)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    spawn_guard.item, spawn_guard.started = item, []
    try:
        return (yield)
    finally:
        spawn_guard.item = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    spawn_guard.fixtures.append(f"{fixturedef.baseid}::{fixturedef.argname}")
    try:
        return (yield)
    finally:
        spawn_guard.fixtures.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "teardown" and spawn_guard.item is item:
        problem = spawn_guard.problem(item)
        if problem:
            report.outcome = "failed"
            report.longrepr = problem
    return report


_durations: dict[str, float] = {}
_unmarked: set[str] = set()


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if "slow" not in report.keywords:
        _unmarked.add(report.nodeid)


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        help="write each test's seconds (setup + call + teardown) to PATH (tests/durations.json: "
        "the measured rule for the slow marker, tests/markers.py)",
    )


def pytest_sessionfinish(session):
    path = session.config.getoption("record_durations", None)
    if not path or isolation.SLOT_ENV in os.environ:  # the xdist controller writes, not its workers
        return
    import json
    import sys

    document = markers.durations_document(
        _durations, command=" ".join(["pytest", *sys.argv[1:]]), machine=markers.machine()
    )
    with open(path, "w") as out:
        json.dump(document, out, indent=1)
        out.write("\n")


def pytest_terminal_summary(terminalreporter):
    slow = sorted(
        (seconds, nodeid)
        for nodeid, seconds in _durations.items()
        if nodeid in _unmarked and seconds > markers.SLOW_REPORT_S
    )
    if slow:
        terminalreporter.section("tests over the slow threshold without the slow marker")
        for seconds, nodeid in reversed(slow):
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")
        terminalreporter.write_line(
            "list them in SLOW in tests/markers.py (make test-fast leaves slow tests out)"
        )
