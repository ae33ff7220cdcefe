"""The pool's session rows as the decision run reads them, kept per process and read incrementally.

A run used to load every session row of its pool as a model instance (70 % of its time at 1,024
GPUs, issue 30). It now reads, per pool, only the columns the snapshot, the layout and the fair share
need (``SessionRow``), and only the rows changed since the process's last read:

- a trigger stamps a session row (on insert, and on any change to those columns) and a worker
  command (on insert) with the next value of its table's sequence (``snapshot_seq``) and the writing
  transaction's id (``snapshot_xid``; migrations ``streams`` 0010 and ``scheduling`` 0015);
- a refresh reads the rows stamped after the highest number it has seen, **or** by a transaction
  that was still running when it last read (id ≥ that read's snapshot ``xmin``, other than its own):
  such a writer may have drawn its number before the read and committed after it, so the number
  alone would miss it. Both predicates are served by indexes;
- rows that vanish (a deleted session, a model renamed) are never returned by a delta: the refresh
  compares the pool's live row count with its own and reloads the pool whole when they differ;
- the cache is trusted only in the transaction that read it or once that transaction committed
  (``pg_xact_status``); after a rollback (the run failed, or a benchmark rolled its rows back) the
  pool is reloaded whole, since the rows it read may never have existed.

The same cache keeps each session's ``SessionView`` (``scheduling.live.run._session_view``), recomputed
only for the rows that changed, or all of them when the pool's workers changed, since a view names
its worker's GPU. Nothing here locks a session row: the run locks the rows its decision touches,
when it applies it (``SessionInstances``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from django.db import connection
from django.db.models import Q

from scheduling.core.types import GpuTypeSpec, GpuView, SessionView, Snapshot
from scheduling.models import WorkerCommand
from sessions.models import GenerationSession

Status = GenerationSession.Status
# The commands whose newest one says when an executing session was last placed (its ``since``).
PLACING_KINDS = ("start", "resume", "activate")


class SessionRow(NamedTuple):
    """The columns of a session row the decision run reads, named like the model's attributes so the
    layout, the fair share and the view builder read either."""

    pk: str  # the id as text, the snapshot's key (formatting 100,000 UUIDs a run is not free)
    status: str
    activity: str
    load: float
    worker_id: int | None
    host_worker_id: int | None
    region_id: int | None
    tenant_id: int | None
    origin: str
    last_active_at: datetime | None
    created_at: datetime


_COLUMNS = ("id", *SessionRow._fields[1:])


@dataclass
class _PoolCache:
    rows: dict[str, SessionRow] = field(default_factory=dict)
    placed_at: dict[str, datetime] = field(default_factory=dict)  # by session id as text
    seq: int = 0  # the session sequence's value at the last read
    command_seq: int = 0  # the command sequence's value at the last read
    xmin: int = 0  # the last read's snapshot xmin
    xid: int = 0  # the transaction that last read
    views: dict[str, SessionView] = field(default_factory=dict)
    views_key: Any = None  # what every cached view was computed against (the pool's workers)
    recompute: set[str] = field(default_factory=set)  # views valid for one run only
    dirty: set[str] = field(default_factory=set)  # sessions whose view changed since ``base``
    base: Snapshot | None = None  # the last snapshot built, before the pipeline's fields
    base_key: Any = None  # the GPUs and views it was built from


# Per thread, like Django's connections: a cache belongs to the connection (and transaction) that read it.
_local = threading.local()


def _caches() -> dict[tuple[str, str], _PoolCache]:
    if not hasattr(_local, "caches"):
        _local.caches = {}
    return _local.caches


def pool_cache_clear(preset: str | None = None) -> None:
    """Forget the cached rows (all pools, or one): the next read loads them whole."""
    caches = _caches()
    for key in [k for k in caches if preset is None or k[1] == preset]:
        del caches[key]


@dataclass
class PoolRows:
    """One read of a pool: its non-terminated sessions by id, the newest placing command of each
    session, and how the read went (``full``: loaded whole; ``changed``: rows read by the delta)."""

    rows: dict[str, SessionRow]
    placed_at: dict[str, datetime]
    full: bool
    changed: int
    _cache: _PoolCache

    def views(
        self, key: Any, build: Callable[[SessionRow], tuple[SessionView, bool]]
    ) -> dict[str, SessionView]:
        """Each session's view, ``build(row) -> (view, reusable)`` called only for the rows changed
        since the views were last built against the same ``key`` (else for every row); a view built
        as not reusable (it depends on the clock) is built again next time."""
        cache = self._cache
        if cache.views_key != key:
            cache.views, cache.views_key, cache.recompute = {}, key, set()
            stale: Iterable[str] = self.rows
        else:
            stale = [sid for sid in cache.recompute if sid in self.rows]
            cache.recompute = set()
        views = cache.views
        for sid in stale:
            views[sid], reusable = build(self.rows[sid])
            cache.dirty.add(sid)
            if not reusable:
                cache.recompute.add(sid)
        return views

    def snapshot(
        self,
        key: Any,
        views: Mapping[str, SessionView],
        *,
        time: float,
        gpus: list[GpuView],
        gpu_types: Mapping[str, GpuTypeSpec],
        min_gpus: int,
        max_gpus: int,
    ) -> Snapshot:
        """``Snapshot.build`` of ``views`` and ``gpus``, patched from the last one built against the
        same ``key`` (the GPUs, and what the views were built against) with the views changed since
        (``Snapshot.patched``: the same snapshot, tests/scheduling_core/test_snapshot_patch.py)."""
        cache = self._cache
        if cache.base is not None and cache.base_key == key:
            changed = {sid: views.get(sid) for sid in cache.dirty}
            base = cache.base.patched(time=time, changed=changed, min_gpus=min_gpus, max_gpus=max_gpus)
        else:
            base = Snapshot.build(
                time=time,
                sessions=views.values(),
                gpus=gpus,
                gpu_types=gpu_types,
                min_gpus=min_gpus,
                max_gpus=max_gpus,
            )
        cache.base, cache.base_key, cache.dirty = base, key, set()
        return base


def pool_rows(preset: str) -> PoolRows:
    """The pool's rows now (see the module docstring); one query for the transaction's position, two
    for the deltas and one for the count, or three to load the pool whole."""
    key = (connection.alias, preset)
    cache = _caches().get(key)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_current_xact_id()::text::bigint,"
            " pg_snapshot_xmin(pg_current_snapshot())::text::bigint,"
            " CASE WHEN %s::bigint > 0 THEN pg_xact_status(%s::text::xid8) END,"
            " (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM streams_session_snapshot_seq),"
            " (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM scheduling_command_snapshot_seq)",
            [cache.xid if cache else 0, cache.xid if cache else 0],
        )
        own, xmin, previous, seq, command_seq = cursor.fetchone()
    trusted = cache is not None and (cache.xid == own or previous == "committed")
    if not trusted:
        cache = _PoolCache()
        _load_whole(cache, preset)
        full, changed = True, len(cache.rows)
    else:
        changed = _read_delta(cache, preset, own)
        full = False
        live = GenerationSession.objects.filter(model_name=preset).exclude(status=Status.TERMINATED).count()
        if live != len(cache.rows):  # a row left without a stamp (deleted, renamed): read it all again
            cache = _PoolCache()
            _load_whole(cache, preset)
            full, changed = True, len(cache.rows)
    # Every row numbered up to these was visible to the reads above, or written by a transaction
    # still running at the first query (its id ≥ ``xmin``): the next delta starts from both.
    cache.seq, cache.command_seq, cache.xmin, cache.xid = seq, command_seq, xmin, own
    _caches()[key] = cache
    return PoolRows(rows=cache.rows, placed_at=cache.placed_at, full=full, changed=changed, _cache=cache)


def _load_whole(cache: _PoolCache, preset: str) -> None:
    sessions = GenerationSession.objects.filter(model_name=preset).exclude(status=Status.TERMINATED)
    for values in sessions.values_list(*_COLUMNS):
        row = SessionRow(str(values[0]), *values[1:])
        cache.rows[row.pk] = row
    for session_id, created_at in WorkerCommand.objects.filter(
        session__model_name=preset, kind__in=PLACING_KINDS
    ).values_list("session_id", "created_at"):
        _place(cache, str(session_id), created_at)


def _read_delta(cache: _PoolCache, preset: str, own: int) -> int:
    """Apply the rows stamped since the last read; returns how many were read."""
    changed = 0
    for values in (
        GenerationSession.objects.filter(_stamped_since(cache.seq, cache.xmin, own), model_name=preset)
        .order_by()
        .values_list(*_COLUMNS)
    ):
        row = SessionRow(str(values[0]), *values[1:])
        sid = row.pk
        if row.status == Status.TERMINATED:
            cache.rows.pop(sid, None)
            cache.placed_at.pop(sid, None)
        else:
            cache.rows[sid] = row
        cache.views.pop(sid, None)
        cache.recompute.add(sid)
        cache.dirty.add(sid)
        changed += 1
    for session_id, created_at in (
        WorkerCommand.objects.filter(
            _stamped_since(cache.command_seq, cache.xmin, own), kind__in=PLACING_KINDS, session__isnull=False
        )
        .order_by()
        .values_list("session_id", "created_at")
    ):
        # Only the pool's sessions (read just above, if new): a session never changes its model.
        if str(session_id) in cache.rows and _place(cache, str(session_id), created_at):
            cache.recompute.add(str(session_id))
        changed += 1
    return changed


def _stamped_since(seq: int, xmin: int, own: int) -> Q:
    # Numbered after the last read, or written by a transaction still running at it (see the module
    # docstring); our own transaction's earlier rows were read then, its later ones have later numbers.
    return Q(snapshot_seq__gt=seq) | (Q(snapshot_xid__gte=xmin) & ~Q(snapshot_xid=own))


def _place(cache: _PoolCache, session_id: str, created_at: datetime) -> bool:
    if session_id in cache.placed_at and cache.placed_at[session_id] >= created_at:
        return False
    cache.placed_at[session_id] = created_at
    return True


class SessionInstances(Mapping[str, GenerationSession]):
    """The pool's sessions by id, as model instances for the apply: the ids are the read's rows (and
    any session a caller adds); an instance is read, locked ``FOR NO KEY UPDATE``, when first asked
    for — ``lock`` reads many at once, in primary-key order like every other multi-row locker."""

    def __init__(self, rows: Mapping[str, SessionRow]):
        self.rows = rows
        self.loaded: dict[str, GenerationSession] = {}

    def lock(self, ids: Iterable[str]) -> None:
        wanted = sorted({sid for sid in ids if sid in self.rows and sid not in self.loaded})
        if not wanted:
            return
        for session in (
            GenerationSession.objects.select_for_update(no_key=True)
            .filter(pk__in=wanted)
            .order_by("pk")
            .prefetch_related("worker", "host_worker")
        ):
            self.loaded[str(session.pk)] = session

    def __getitem__(self, sid: str) -> GenerationSession:
        if sid not in self.loaded:
            if sid not in self.rows:
                raise KeyError(sid)
            self.lock([sid])
            if sid not in self.loaded:
                raise KeyError(sid)
        return self.loaded[sid]

    def __contains__(self, sid: object) -> bool:
        return sid in self.rows

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)
