"""What each pytest-xdist worker keeps to itself, so ``pytest -n N`` runs N suites side by side.

PostgreSQL: pytest-django suffixes the test database per worker (``<TEST_DATABASE_NAME>_gw0`` …).
Redis: the settings read ``REDIS_URL`` when they are imported, before any conftest runs, so the
controller writes each worker's URL into that worker's environment before it starts
(``pytest_xdist_setupnodes`` in tests/conftest.py); the processes a test spawns inherit it. The
layout of Redis's 16 databases, ``b`` being the database of the run's ``REDIS_URL`` (0 by default)
and ``s`` a worker's slot (0 without xdist):

- ``b + s``: the worker's own (channel layer, cache, command streams, scheduler lock);
- ``13 - 2s``: the Celery broker of the platform the e2e tests start, so a developer's platform on
  this machine never takes its tasks (13 without xdist, as before);
- ``12 - 2s``: the browser tests' ASGI server (its scheduler tasks are nobody's to take);
- 14 and 15: the live benchmarks' fixed databases (``workers.benchmarks.live``): the tests that run
  those commands live in one module, tests/bench/test_commands.py, and ``--dist loadfile`` runs a
  module on one worker, so one at a time uses them.

Two suites sharing one Redis server (two checkouts on one machine) share these databases too: give
each a server of its own (``REDIS_URL=redis://127.0.0.1:6390/0``; ``scripts/ensure_services.sh``
starts a local one on the port REDIS_URL names when none answers there).
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from workers.benchmarks.live import redis_url_with_db

SLOT_ENV = "STREAMSERVE_TEST_SLOT"  # set by the controller in each worker's environment
REDIS_DATABASES = 16  # Redis's default `databases`
BENCH_DATABASES = frozenset({14, 15})


def slot() -> int:
    """This process's worker slot: 0 without xdist, else 0 … N-1 in the order the workers started."""
    return int(os.environ.get(SLOT_ENV, "0"))


def redis_db(url: str) -> int:
    """The logical database a Redis URL names (``/n`` or ``?db=n``; 0 when it names none)."""
    parsed = urlparse(url)
    for part in parsed.query.split("&"):
        if part.startswith("db="):
            return int(part[3:])
    path = parsed.path.strip("/") if parsed.scheme != "unix" else ""
    return int(path) if path else 0


def own_db(base: int, slot_: int) -> int:
    return base + slot_


def e2e_broker_db(slot_: int) -> int:
    return 13 - 2 * slot_


def browser_server_db(slot_: int) -> int:
    return 12 - 2 * slot_


def layout_problem(base: int, workers: int) -> str | None:
    """Why ``workers`` slots cannot share Redis's databases from base ``base``, or None when they can."""
    used: list[int] = [*BENCH_DATABASES]
    for s in range(workers):
        used += [own_db(base, s), e2e_broker_db(s), browser_server_db(s)]
    if min(used) < 0 or max(used) >= REDIS_DATABASES or len(set(used)) != len(used):
        return (
            f"{workers} test workers with REDIS_URL on database {base} need Redis databases "
            f"{base}…{own_db(base, workers - 1)} of their own, {browser_server_db(workers - 1)}…13 for the "
            "platforms they start and 14–15 for the benchmarks, and those overlap: "
            "run fewer workers (-n) or point REDIS_URL at a lower database"
        )
    return None


def worker_redis_url(base_url: str, slot_: int) -> str:
    return redis_url_with_db(base_url, own_db(redis_db(base_url), slot_))


def e2e_broker_url(redis_url: str) -> str:
    """The e2e platform's Celery broker: this worker's Redis server, the slot's broker database."""
    return redis_url_with_db(redis_url, e2e_broker_db(slot()))


def browser_server_url(redis_url: str) -> str:
    """The browser tests' ASGI server's Redis: this worker's server, the slot's database."""
    return redis_url_with_db(redis_url, browser_server_db(slot()))


def suffix() -> str:
    """A name suffix for files several workers would otherwise share (``""`` without xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"-{worker}" if worker else ""
