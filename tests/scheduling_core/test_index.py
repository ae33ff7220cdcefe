"""The cluster index (scheduling/core/index.py) and the decisions that read it.

Decisions must be the same with the index its owner keeps and with one built fresh from the
snapshot; the placement queries that read the index must give what a scan of every GPU gives.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.gpu_profiles import BUILTIN_PROFILES
from scheduling.core.index import ClusterIndex
from scheduling.core.placement import PlacementWork
from scheduling.core.policy import make_policy
from scheduling.core.types import GpuView, SessionView, Snapshot
from scheduling.sim.generators import paper_trace
from scheduling.sim.simulator import SimConfig, Simulator

STATUSES = ("provisioning", "ready", "draining")
LOADS = (0.0, 0.5, 1.0, 1.78, 2.0, 3.0, 0.3)


def _state(index: ClusterIndex) -> dict:
    return {
        "status": dict(index.status),
        "ready": list(index.in_order(index.ready)),
        "provisioning": index.in_order(index.provisioning),
        "draining": index.in_order(index.draining),
        "ascending": {t: list(v) for t, v in index.ascending.items() if v},
        "descending": {t: list(v) for t, v in index.descending.items() if v},
        "held": {t: n for t, n in index.held.items() if n},
        "live": {t: n for t, n in index.live.items() if n},
        "total": index.total_load(),
    }


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 7),
            st.sampled_from(("a", "b")),
            st.sampled_from((*STATUSES, "drop")),
            st.sampled_from(LOADS),
        ),
        max_size=40,
    )
)
def test_incremental_index_equals_one_built_fresh(ops):
    """Given any sequence of GPU changes applied one by one, the index equals one built from the
    final GPUs in the same order."""
    index = ClusterIndex()
    gpus: dict[str, tuple[str, str, float]] = {}
    for n, gpu_type, status, load in ops:
        gid = f"g{n}"
        if status == "drop":
            index.drop_gpu(gid)
            gpus.pop(gid, None)
            continue
        index.set_gpu(gid, gpu_type, status, load)
        gpus[gid] = (gpu_type, status, load)
    views = {
        g: GpuView(g, t, s) for g, (t, s, _) in sorted(gpus.items(), key=lambda kv: index.position[kv[0]])
    }
    fresh = ClusterIndex.of(views, {g: load for g, (_, _, load) in gpus.items()})
    assert _state(index) == _state(fresh)
    exact = all(load != 0.3 and load != 1.78 for _, _, load in gpus.values())
    assert (index.total_load() is not None) == exact
    if exact:
        assert index.total_load() == sum(load for _, _, load in gpus.values())


def _snapshot(loads: list[float], types: list[str], statuses: list[str]) -> Snapshot:
    specs = {"b300-1.3b": BUILTIN_PROFILES["b300-1.3b"], "h100-1.3b": BUILTIN_PROFILES["h100-1.3b"]}
    gpus, sessions = [], []
    for i, (load, t, status) in enumerate(zip(loads, types, statuses, strict=True)):
        gid = f"g{i:02d}"
        gpus.append(GpuView(gid, t, status))
        for k in range(int(load)):
            sessions.append(SessionView(f"s{i:02d}-{k}", 1, "executing", 1.0, gid, since=0.0))
    sessions.append(SessionView("new", 1, "queued", 1.0, None))
    return Snapshot.build(time=10.0, sessions=sessions, gpus=gpus, gpu_types=specs)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 12).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 12), min_size=n, max_size=n),
            st.lists(st.sampled_from(("b300-1.3b", "h100-1.3b")), min_size=n, max_size=n),
            st.lists(st.sampled_from(("ready", "ready", "draining", "provisioning")), min_size=n, max_size=n),
            st.lists(
                st.tuples(
                    st.sampled_from(("move", "out", "in")), st.integers(0, n - 1), st.integers(0, n - 1)
                )
            ),
        )
    )
)
def test_placement_queries_match_a_scan_of_every_gpu(case):
    """Given a snapshot and any moves and eligibility changes a decision makes, the least-loaded,
    most-loaded and few-least-loaded GPUs of each type and the total load are what a scan of every
    GPU gives (ties by id)."""
    loads, types, statuses, steps = case
    snapshot = _snapshot([float(x) for x in loads], types, statuses)
    work = PlacementWork(snapshot)
    gids = list(snapshot.gpus)
    for op, a, b in steps:
        src, dst = gids[a], gids[b]
        if op == "move" and src != dst and work.residents(src) and dst in work.eligible_set:
            work.move(work.residents(src)[0], src, dst)
        elif op == "out":
            work.make_ineligible(src)
        elif op == "in":
            work.make_eligible(src)
    eligible = [g for g in gids if g in work.eligible_set]
    assert sorted(work.eligible) == sorted(eligible) and work.n_eligible == len(eligible)
    for t in work.type_order:
        mine = [g for g in eligible if snapshot.gpus[g].gpu_type == t]
        fitting = [g for g in mine if work.fits(g, "new")]
        expect_least = min(fitting, key=lambda g: (work.load[g], g)) if fitting else None
        assert work.least_loaded(t, "new") == expect_least
        expect_most = min(mine, key=lambda g: (-work.load[g], g)) if mine else None
        assert work._most_loaded(t) == expect_most
        few = sorted((g for g in mine if g != gids[0]), key=lambda g: (work.load[g], g))[:3]
        assert work._least_loaded_few(t, gids[0], 3) == few
    assert work.total_load() == sum(work.load[g] for g in snapshot.gpu_load)


class _NoIndexSimulator(Simulator):
    """The simulator handing its policy snapshots without its index (one is built per decision)."""

    def snapshot(self) -> Snapshot:
        snapshot = super().snapshot()
        return Snapshot(**{f: getattr(snapshot, f) for f in Snapshot.__dataclass_fields__ if f != "index"})


def _decisions(sim_class: type[Simulator], trace: str, profiles: list, load_mix) -> list[dict]:
    _, events = paper_trace(trace, seed=2, load_mix=load_mix)
    sim = sim_class(
        make_policy("turboserve"), SimConfig(profiles=profiles, initial_gpus=4, min_gpus=1, max_gpus=64)
    )
    rows: list[dict] = []
    apply = sim._apply

    def recording(decision):
        row = decision.to_json()
        row.pop("scheduler_ms")
        rows.append(row)
        apply(decision)

    sim._apply = recording  # type: ignore[method-assign]
    sim.run(events)
    return rows


def test_decisions_are_the_same_with_the_kept_index_and_without():
    """Given a paper trace on two GPU types with loads that do not add exactly (1.78), when the
    simulator runs it handing the index it keeps and when it hands none, then every decision is the
    same (scale-out, drains, releases and migrations included)."""
    profiles = [BUILTIN_PROFILES["h100-1.3b"], BUILTIN_PROFILES["paper-k5"]]
    mix = {1.0: 0.6, 1.78: 0.3, 0.5: 0.1}
    kept = _decisions(Simulator, "T1", profiles, mix)
    fresh = _decisions(_NoIndexSimulator, "T1", profiles, mix)
    assert kept == fresh
    assert any(row["migrations"] for row in kept) and any(row["add_gpus"] for row in kept)
    assert any(row["release"] for row in kept)
