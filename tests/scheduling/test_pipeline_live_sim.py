"""The simulator measures the composition that runs live (issue 24).

One trace is replayed through the simulator and, decision by decision, through the live loop on the
test database: before each of the simulator's decisions its state is written into the rows the live
loop reads (workers, sessions, their last placement), ``scheduler_run`` runs with the clock at the
simulator's time — its own policy state persisted in ``SchedulerState`` between runs, its commands
left in the outbox, never sent — and the live run's snapshot and decision must equal the simulator's.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import pytest
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.core.policy import make_policy
from scheduling.core.types import Decision, Event, Snapshot
from scheduling.live import run as live_run
from scheduling.live.worker_profiles import gpu_profiles
from scheduling.models import SchedulerConfig, WorkerCommand
from scheduling.sim.simulator import SimConfig, Simulator
from scheduling.sim.traces import TraceEvent
from sessions.models import GenerationSession
from tests.factories import SessionFactory, UserFactory

pytestmark = pytest.mark.django_db

Status = GenerationSession.Status
Activity = GenerationSession.Activity
# The live clock runs from the Unix epoch, so live times are the simulator's times to the bit; the
# trace's times are multiples of 1/8 s (exact in binary and in microseconds), and so is every delay.
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
PRESET = "tiny"
PROFILE = {
    "name": "cpu",  # the simulator keys types by name, the live loop by gpu_type: the same here
    "gpu_type": "cpu",
    "capacity": 2.0,
    "memory_limit_sessions": 6,
    "price_per_hour": 1.0,
    "provisioning_delay_s": 8.0,
    "latency_ms": [[1, 100.0], [2, 160.0], [3, 260.0]],
}
COOLDOWN_S = 16.0


def at(t: float) -> datetime:
    return EPOCH + timedelta(microseconds=round(t * 1_000_000))


def session_uuid(sid: str) -> str:
    # Ids in the simulator's order (s000, s001, …) keep it as UUIDs: both sides sort by id.
    return str(uuid.UUID(int=int(sid[1:])))


def sim_id(live_id: str) -> str:
    return f"s{uuid.UUID(live_id).int:03d}"


def trace(seed: int = 0, sessions: int = 28) -> list[TraceEvent]:
    """Sessions arriving over 100 s, one to three active periods each, most leaving at the end."""
    rng = random.Random(seed)

    def q(t: float) -> float:
        return round(t * 8) / 8

    arrivals = sorted(q(rng.uniform(0.0, 100.0)) for _ in range(sessions))
    events: list[tuple[float, int, TraceEvent]] = []
    for n, t in enumerate(arrivals):
        sid = f"s{n:03d}"
        load = rng.choice([1.0, 1.0, 0.5, 1.5])
        timeline = [(t, "arrive")]
        for _ in range(rng.randint(1, 3)):
            t = q(t + rng.uniform(0.5, 6.0))
            timeline.append((t, "active"))
            t = q(t + rng.uniform(5.0, 45.0))
            timeline.append((t, "idle"))
        if rng.random() < 0.8:
            timeline.append((q(t + rng.uniform(0.5, 10.0)), "depart"))
        for k, (when, kind) in enumerate(timeline):
            events.append((when, n * 10 + k, TraceEvent(when, sid, kind, load)))
    return [e for _, _, e in sorted(events)]


class LiveMirror:
    """The live side: the simulator's state as rows, then one ``scheduler_run`` at its time."""

    def __init__(self, sim: Simulator):
        self.sim = sim
        self.owner = UserFactory()
        self.workers: dict[str, GpuWorker] = {}
        self.sessions: dict[str, GenerationSession] = {}
        self.activated: dict[str, float] = {}  # session -> its last activation (the user came back)
        self.parts: list[Any] = []

    def _sync_workers(self) -> None:
        sim = self.sim
        rows = []
        for g in sim.gpus.values():
            row = self.workers.get(g.id)
            if row is None:
                row = GpuWorker.objects.create(
                    name=g.id,
                    gpu_type="cpu",
                    model_preset=PRESET,
                    capacity=2,
                    status=GpuWorker.Status.PROVISIONING,
                    requested_at=at(g.requested_at),
                )
                self.workers[g.id] = row
            row.status = g.status
            row.requested_at = at(g.requested_at)
            booted = g.status in ("ready", "draining")
            row.ready_at = at(g.ready_at) if booted else None
            row.expected_ready_at = None if booted else at(g.ready_at)
            row.released_at = None
            rows.append(row)
        for name, row in self.workers.items():
            if name not in sim.gpus and row.status != GpuWorker.Status.RELEASED:
                row.status, row.released_at = GpuWorker.Status.RELEASED, at(sim.now)
                rows.append(row)
        GpuWorker.objects.bulk_update(
            rows, ["status", "requested_at", "ready_at", "expected_ready_at", "released_at"]
        )

    def _sync_sessions(self) -> None:
        sim = self.sim
        rows = []
        placed = []
        for s in sim.sessions.values():
            row = self.sessions.get(s.id)
            if row is None:
                row = SessionFactory(id=session_uuid(s.id), owner=self.owner, model_name=PRESET, load=s.load)
                self.sessions[s.id] = row
            row.activity = Activity.ACTIVE if s.alpha else Activity.IDLE
            row.status = {
                "executing": Status.EXECUTING,
                "suspended": Status.SUSPENDED,
                "queued": Status.QUEUED,
            }[s.state]
            row.worker = self.workers[s.gpu] if s.state == "executing" else None
            row.state_location = (
                GenerationSession.StateLocation.WORKER
                if s.state == "executing"
                else GenerationSession.StateLocation.NONE
            )
            row.host_worker = None
            row.queue_position = None
            # The live loop reads ``since`` from the last placement command (executing) or from the
            # last activation (waiting: the queue's order).
            waiting_since = self.activated.get(s.id, s.since)
            row.last_active_at = row.created_at = at(s.since if s.state == "executing" else waiting_since)
            if s.state == "executing":
                placed.append(
                    WorkerCommand(
                        id=uuid.uuid4(),
                        worker=row.worker,
                        session=row,
                        kind=WorkerCommand.Kind.START,
                        payload={},
                        created_at=at(s.since),
                    )
                )
            rows.append(row)
        for sid, row in self.sessions.items():
            if sid not in sim.sessions and row.status != Status.TERMINATED:
                row.status, row.terminated_at = Status.TERMINATED, at(sim.now)
                row.worker = row.host_worker = None
                row.state_location = GenerationSession.StateLocation.NONE
                rows.append(row)
        GenerationSession.objects.bulk_update(
            rows,
            [
                "activity",
                "status",
                "worker",
                "host_worker",
                "state_location",
                "queue_position",
                "last_active_at",
                "created_at",
                "terminated_at",
            ],
        )
        WorkerCommand.objects.filter(kind__in=["start", "resume", "activate"]).delete()
        WorkerCommand.objects.bulk_create(placed)

    def decide(self, event: Event) -> tuple[Snapshot, Decision]:
        """The live run on the mirrored rows: its one region's snapshot and decision, in the
        simulator's session ids."""
        self._sync_workers()
        self._sync_sessions()
        self.parts.clear()
        session = session_uuid(event.session) if event.session else None
        with mock.patch.object(timezone, "now", return_value=at(self.sim.now)):
            live_run.scheduler_run(trigger=event.kind, session_id=session, was_active=event.was_active)
        (part,) = self.parts
        return part.snapshot, part.decision


def in_sim_ids(snapshot: Snapshot) -> dict[str, Any]:
    """A snapshot as plain data, sessions named by their simulator ids. A waiting session's ``since``
    is left out: live it is the session's last activation, in the simulator the time it entered its
    state; a policy reads it only through the order of ``pending`` (activation order on both sides),
    which is compared."""

    def sid(s: str) -> str:
        return sim_id(s) if "-" in s else s

    def view(v: Any) -> Any:
        return replace(v, id=sid(v.id), since=v.since if v.state == "executing" else None)

    return {
        "time": snapshot.time,
        "sessions": {sid(k): view(v) for k, v in snapshot.sessions.items()},
        "gpus": dict(snapshot.gpus),
        "gpu_types": dict(snapshot.gpu_types),
        "residents": {g: tuple(sid(s) for s in r) for g, r in snapshot.residents.items()},
        "gpu_load": dict(snapshot.gpu_load),
        "gpu_bytes": dict(snapshot.gpu_bytes),
        "pending": tuple(sid(s) for s in snapshot.pending),
        "idle_resident": tuple(sid(s) for s in snapshot.idle_resident),
        "bounds": (snapshot.min_gpus, snapshot.max_gpus),
        "jobs": (snapshot.job_demand_gpus, snapshot.job_gpus),
        "floor_load": snapshot.floor_load,
    }


def decision_in_sim_ids(decision: Decision) -> Decision:
    return replace(
        decision,
        assign=tuple((sim_id(s), g) for s, g in decision.assign),
        migrations=tuple(replace(m, session=sim_id(m.session)) for m in decision.migrations),
        suspend=tuple(sim_id(s) for s in decision.suspend),
        queue=tuple(sim_id(s) for s in decision.queue),
    )


class Replay(Simulator):
    """The simulator, asking the live loop for the same decision before each of its own."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.live = LiveMirror(self)
        self.compared: list[Decision] = []
        self._decision: Decision | None = None

    def _apply(self, d: Decision) -> None:
        self._decision = d
        super()._apply(d)

    def _trace_event(self, ev: Any) -> None:
        if ev.event == "active":
            self.live.activated[ev.session] = ev.t
        super()._trace_event(ev)

    def _decide(self, event: Event) -> None:
        live_snapshot, live_decision = self.live.decide(event)
        expected = in_sim_ids(self.snapshot())
        super()._decide(event)
        where = f"decision {len(self.compared)} at t={self.now} on {event.kind} {event.session or event.gpu or ''}"
        assert in_sim_ids(live_snapshot) == expected, where
        assert decision_in_sim_ids(live_decision) == self._decision, where
        self.compared.append(self._decision)


@pytest.fixture
def live_pool(tmp_path, settings):
    """The live loop on the trace's GPU profile, one served pool, no regions, floor or stages."""
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(PROFILE))
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "WORKER_PROFILE": str(path),
        "SERVED_MODELS": [PRESET],
        "REGION_FORECAST_FLOOR": False,
        "STAGE_PLACEMENT": "off",
    }
    SchedulerConfig.objects.update_or_create(
        pk=1,
        defaults={
            "policy": "turboserve",
            "min_gpus": 1,
            "max_gpus": 8,
            "target_utilization": None,
            "scale_in_cooldown_s": COOLDOWN_S,
        },
    )
    gpu_profiles.cache_clear()
    yield gpu_profiles()["cpu"]
    gpu_profiles.cache_clear()


@pytest.mark.parametrize(
    ("max_gpus", "sessions"),
    [
        pytest.param(8, 28, id="room-to-scale"),
        # Two GPUs of six sessions each for forty sessions: active users wait in the queue.
        pytest.param(2, 40, id="queueing"),
    ],
)
def test_a_trace_gets_the_same_decisions_live_and_in_the_simulator(
    live_pool, monkeypatch, max_gpus, sessions
):
    # given the live loop, its run's per-region parts observed as it records them
    SchedulerConfig.objects.filter(pk=1).update(max_gpus=max_gpus)
    record = live_run._record_and_apply

    def observed(**kwargs: Any) -> int | None:
        replay.live.parts.append(kwargs["part"])
        return record(**kwargs)

    monkeypatch.setattr(live_run, "_record_and_apply", observed)
    # and the simulator on the same profile and bounds, with the live loop's policy options
    replay = Replay(
        make_policy("turboserve", cooldown_s=COOLDOWN_S),
        SimConfig(profiles=[live_pool], initial_gpus=2, min_gpus=1, max_gpus=max_gpus, tick_s=4.0),
    )
    # when a trace is replayed through both, decision by decision (Replay asserts each pair)
    result = replay.run(trace(sessions=sessions))
    # then every decision matched, and the trace made the policy do what matters: place, suspend,
    # migrate, scale out and in — or, in a pool at its maximum, queue
    decisions = replay.compared
    assert len(decisions) == result.decisions > 100
    assert sum(len(d.assign) for d in decisions) > 20
    assert any(d.suspend for d in decisions)
    assert any(d.migrations for d in decisions)
    if max_gpus > 2:
        assert any(d.add_gpus for d in decisions)
        assert any(d.drain or d.release for d in decisions)
    else:
        assert result.queued_sessions > 0 and any(len(d.queue) > 1 for d in decisions)
