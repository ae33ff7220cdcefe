"""The decision run: one composition of named pure steps, the same in the live loop and the simulator.

Four papers shape one scheduler decision. Each shapes it in a step of its own, with typed inputs and
outputs, composed here and nowhere else (``decision_run``):

1. ``partition`` (TORTA regions, ``regions.partition.partition_snapshot``): the pool's snapshot
   split into one snapshot per region; a region at zero whose predictive floor asks for GPUs takes
   part. A pool in one region is its own partition (the snapshot as it is).
   Then ``fair_share`` (tenants, issue 29, ``tenants.fair_order``): in each region's snapshot the
   waiting sessions in weighted fair-share order (the tenant furthest under its share first, FCFS
   within a tenant), and the sessions of tenants over a GPU-second quota marked ``spare_only`` (no
   scale-out for them). Without tenants the snapshots are unchanged.
2. ``add_job_demand`` (GenServe, ``jobs.backlog``): each region's snapshot gains its one-shot jobs'
   GPU demand (``job_demand_gpus``) and the GPUs running jobs (``job_gpus``).
3. ``add_floor`` (TORTA Eq. 6): each region's snapshot gains its predictive floor's forecast load
   (``floor_load``).
4. ``route_event`` and ``observed_events``: the region whose policy observes the event (its
   session's, else its GPU's); every other region's policy observes a tick (an event with neither,
   a periodic tick, is a tick everywhere).
5. ``decide_by_region`` (TurboServe per region, ``regions.partition``): each region's policy decides
   on its snapshot — the jobs and the floor are fields of it, never attributes set on the policy —
   and sessions a region had to queue spill to a near region with room.
6. ``to_zero`` (TORTA, ``regions.partition.regions_to_zero``): an idle region with a forecast of
   none gives back its GPUs (several regions only).

The result (``DecisionRun``) says, per region, what its policy saw and decided and which sessions
were re-routed; whoever runs the pipeline applies it. The live loop (``scheduling.live.run``) reads
the inputs from PostgreSQL and Redis, hands each region's policy its persisted state, and after the
run saves that state, records the re-routes, fails encoders over (the rule: ``stages.encoders``),
records and applies each region's decision and advances the stage placement (``stages.placement``);
the simulator (``scheduling.sim.simulator``) builds the inputs from its own state and applies the
one region's decision in virtual time. Both call ``decision_run``, so ``simulate`` measures the
composition that runs live.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .jobs.backlog import backlog_gpus
from .policy import Policy
from .regions.partition import RegionLayout, decide_by_region, partition_snapshot, regions_to_zero
from .tenants import TenantShares, fair_order, spare_only_sessions
from .types import Decision, Event, EventKind, Snapshot

# The policies of the regions a run decides for, asked once per run with the regions in name order
# (the live loop loads each region's persisted state; the simulator has its one policy).
PolicyProvider = Callable[[Sequence[str]], Mapping[str, Policy]]
# A pool in one region (the simulator's): every id in the default region.
ONE_REGION = RegionLayout()


@dataclass(frozen=True)
class JobDemand:
    """One pool's one-shot jobs in flight, as the autoscaler counts them (issue 14).

    ``open_jobs``: ``(deadline, id, remaining seconds on one GPU)`` of each job, keyed by the GPU
    holding it (``None``: queued, counted in the default region); ``holders``: the GPUs running or
    pausing a job; ``slots_per_gpu``: how many jobs one GPU runs at once (live: K, a job takes one
    session slot; the simulator: 1, a job takes whole GPUs), the demand's unit."""

    open_jobs: Mapping[str | None, Sequence[tuple[float, str, float]]] = field(default_factory=dict)
    holders: Collection[str] = ()
    slots_per_gpu: float = 1.0


@dataclass(frozen=True)
class DecisionInputs:
    """What one decision run starts from.

    ``snapshot``: the whole pool, after the event's bookkeeping; ``layout``: where its GPUs and
    sessions are (one region without one); ``jobs``: the one-shot jobs (``None``: none tracked);
    ``floor_load``: each region's predictive-floor input F (``None``: no floor); ``idle_forecast``:
    the regions whose forecast is no demand, asked only when the pool spans several regions;
    ``region_minimum``: the GPUs such a region keeps; ``tenants``: each session's tenant, the
    tenants' weights and recent GPU-seconds (``None``: no fair share, arrival order)."""

    snapshot: Snapshot
    event: Event
    layout: RegionLayout = ONE_REGION
    jobs: JobDemand | None = None
    floor_load: Mapping[str, float] | None = None
    idle_forecast: Callable[[], Collection[str]] = frozenset
    region_minimum: Mapping[str, int] = field(default_factory=dict)
    tenants: TenantShares | None = None


# The results are slotted, not frozen: a frozen dataclass's __init__ sets each field through
# object.__setattr__, four times slower, and the simulator builds them at every decision
# (bench_scheduler times it). Treat them as read-only.
@dataclass(slots=True)
class RegionDecision:
    """One region's part of a run: the snapshot its policy saw (its jobs and floor included), the
    event it observed (the run's in the event's region, else a tick), its decision, the sessions the
    spill re-routed into it and the GPUs the to-zero rule added to its releases."""

    snapshot: Snapshot
    event: Event
    decision: Decision
    rerouted_in: tuple[str, ...] = ()
    released_to_zero: tuple[str, ...] = ()


@dataclass(slots=True)
class DecisionRun:
    """A run's result: each region's decision by region name (in name order), every re-routed
    session's new region and the region whose policy observed the event (``None``: none did)."""

    regions: Mapping[str, RegionDecision]
    rerouted: Mapping[str, str]
    event_region: str | None


def decision_run(inputs: DecisionInputs, policies: PolicyProvider) -> DecisionRun:
    """The steps of the module docstring, in order."""
    layout, snapshot = inputs.layout, inputs.snapshot
    snapshots = partition(snapshot, layout, inputs.floor_load)
    if inputs.tenants is not None:
        snapshots = {region: fair_share(part, inputs.tenants) for region, part in snapshots.items()}
    snapshots = add_job_demand(snapshots, inputs.jobs, layout, snapshot.time)
    snapshots = add_floor(snapshots, inputs.floor_load)
    event_region = route_event(snapshot, layout, inputs.event)
    events = observed_events(snapshots, inputs.event, event_region)
    decisions, rerouted = decide_by_region(
        policies(list(snapshots)), snapshots, events, alternatives=layout.alternatives
    )
    released: dict[str, tuple[str, ...]] = {}
    if len(snapshots) > 1:
        decisions, released = to_zero(
            snapshots, decisions, idle=inputs.idle_forecast(), minimum=inputs.region_minimum
        )
    return DecisionRun(
        regions={
            region: RegionDecision(
                snapshot=part,
                event=events[region],
                decision=decisions[region],
                rerouted_in=_rerouted_into(rerouted, region),
                released_to_zero=released.get(region, ()),
            )
            for region, part in snapshots.items()
        },
        rerouted=rerouted,
        event_region=event_region,
    )


def _rerouted_into(rerouted: Mapping[str, str], region: str) -> tuple[str, ...]:
    return tuple(sorted(sid for sid, to in rerouted.items() if to == region)) if rerouted else ()


def fair_share(snapshot: Snapshot, tenants: TenantShares | None) -> Snapshot:
    """Step 1b, per region: the waiting sessions in fair-share order and the over-quota tenants'
    sessions marked ``spare_only``."""
    if tenants is None:
        return snapshot
    pending = fair_order(snapshot.pending, tenants)
    spare = spare_only_sessions(list(snapshot.sessions), tenants)
    if pending == snapshot.pending and spare == snapshot.spare_only:
        return snapshot
    return replace(snapshot, pending=pending, spare_only=spare)


def partition(
    snapshot: Snapshot, layout: RegionLayout, floor_load: Mapping[str, float] | None
) -> dict[str, Snapshot]:
    """Step 1: one snapshot per region, in name order; a region at zero (a limits row, no GPU) takes
    part once its floor's forecast load is coming, so its floor can ask for GPUs."""
    if floor_load is None and layout.one_region:
        return {layout.default: snapshot}
    include = [r for r, f in (floor_load or {}).items() if f > 0 and r in layout.gpu_limits]
    return partition_snapshot(
        snapshot,
        session_region=layout.session_region,
        gpu_region=layout.gpu_region,
        gpu_limits=layout.gpu_limits,
        default=layout.default,
        include=include,
    )


def add_job_demand(
    snapshots: Mapping[str, Snapshot], jobs: JobDemand | None, layout: RegionLayout, now: float
) -> Mapping[str, Snapshot]:
    """Step 2: each region's snapshot gains the backlog demand (``backlog_gpus``) of the jobs its GPUs
    hold — queued ones count in the default region — in GPUs of ``slots_per_gpu`` jobs, and its GPUs
    holding running or paused jobs. Without jobs tracked the snapshots are unchanged."""
    if jobs is None:
        return snapshots
    by_region: dict[str, list[tuple[float, str, float]]] = {}
    for gpu, open_jobs in jobs.open_jobs.items():
        region = layout.gpu_region.get(gpu, layout.default) if gpu is not None else layout.default
        by_region.setdefault(region, []).extend(open_jobs)
    return {
        region: replace(
            snapshot,
            job_demand_gpus=backlog_gpus(by_region.get(region, []), now) / jobs.slots_per_gpu,
            job_gpus=tuple(sorted(g for g in jobs.holders if g in snapshot.gpus)),
        )
        for region, snapshot in snapshots.items()
    }


def add_floor(
    snapshots: Mapping[str, Snapshot], floor_load: Mapping[str, float] | None
) -> Mapping[str, Snapshot]:
    """Step 3: each region's snapshot gains its predictive floor's forecast load F (0 for a region
    the forecast does not name). Without a floor the snapshots are unchanged."""
    if floor_load is None:
        return snapshots
    return {
        region: replace(snapshot, floor_load=floor_load.get(region, 0.0))
        for region, snapshot in snapshots.items()
    }


def route_event(snapshot: Snapshot, layout: RegionLayout, event: Event) -> str | None:
    """Step 4: the region whose policy observes ``event``: the one its session runs in, else the
    session's routed one (a departed session is no longer in the snapshot: the layout still names
    its region), else its GPU's. ``None`` for an event with neither: every region decides a tick."""
    if event.session is not None:
        view = snapshot.sessions.get(event.session)
        if view is not None and view.state == "executing" and view.gpu is not None:
            return layout.gpu_region.get(view.gpu, layout.default)
        return layout.session_region.get(event.session, layout.default)
    if event.gpu is not None:
        return layout.gpu_region.get(event.gpu, layout.default)
    return None


def observed_events(
    snapshots: Mapping[str, Snapshot], event: Event, event_region: str | None
) -> dict[str, Event]:
    """Step 4 (continued): what each region's policy observes: the event in its region, a tick of
    the same time in every other."""
    tick = None
    events = {}
    for region in snapshots:
        if region == event_region:
            events[region] = event
        else:
            tick = tick or Event(time=event.time, kind=EventKind.TICK)
            events[region] = tick
    return events


def to_zero(
    snapshots: Mapping[str, Snapshot],
    decisions: Mapping[str, Decision],
    *,
    idle: Collection[str],
    minimum: Mapping[str, int],
) -> tuple[dict[str, Decision], dict[str, tuple[str, ...]]]:
    """Step 6: ``regions_to_zero``; returns the decisions and, per region it changed, the releases it
    added (so their scale-in says why, not "consolidated")."""
    out = regions_to_zero(snapshots, decisions, idle=idle, minimum=minimum)
    added = {
        region: tuple(sorted(set(d.release) - set(decisions[region].release)))
        for region, d in out.items()
        if d is not decisions[region]
    }
    return out, added
