"""The scale planner (BlitzScale §5.1): chains, link discipline, busy links, disk as last resort."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.scaleplan import (
    GB,
    Chain,
    Endpoint,
    ScalePlan,
    ScalePlanError,
    Topology,
    cluster_endpoints,
    disk_endpoint,
    host_cache_endpoint,
    plan_scale_out,
)

NVLINK = Topology.cluster(nvlink_gbps=200.0, rdma_gbps=12.5, pcie_gbps=25.0, nvme_gbps=3.0)


def endpoints_by_id(sources, targets):
    out = {e.id: e for e in (*sources, *targets)}
    for t in targets:
        out.setdefault(f"disk@{t.host}", disk_endpoint(t.host, t.domain))
    return out


def check_plan(plan: ScalePlan, sources, targets, topology: Topology, weights_bytes: int) -> None:
    """The invariants every plan keeps (used by the unit and the property tests)."""
    by_id = endpoints_by_id(sources, targets)
    planned = [t for c in plan.chains for t in c.targets]
    # Every target appears in exactly one chain, and nothing else is a receiver.
    assert sorted(planned) == sorted(t.id for t in targets)
    # No directed link carries two planned flows: each endpoint sends at most once, receives at most once.
    flows = [hop for c in plan.chains for hop in c.hops]
    senders = [a for a, _ in flows]
    receivers = [b for _, b in flows]
    assert len(senders) == len(set(senders))
    assert len(receivers) == len(set(receivers))
    for chain in plan.chains:
        assert by_id[chain.source].kind == chain.source_kind
        bottleneck = math.inf
        previous_ready = 0.0
        for depth, ((a, b), ready) in enumerate(zip(chain.hops, chain.ready_s, strict=True), start=1):
            flow = topology.flow_gbps(by_id[a], by_id[b])
            assert flow is not None, f"{a} → {b} has no path"
            bottleneck = min(bottleneck, flow)
            # Ready time is the pipelined-chain formula with the bottleneck so far …
            assert ready == pytest.approx(topology.ready_s(weights_bytes, bottleneck, depth))
            # … so along a chain the speed never rises and ready times never fall.
            assert ready >= previous_ready
            previous_ready = ready
        assert chain.gbps == pytest.approx(bottleneck)
        assert chain.expected_seconds == pytest.approx(chain.ready_s[-1])
    assert dict(plan.expected_ready_s) == {
        t: r for c in plan.chains for t, r in zip(c.targets, c.ready_s, strict=True)
    }
    # Chains are listed fastest first.
    speeds = [c.gbps for c in plan.chains]
    assert speeds == sorted(speeds, reverse=True)


def test_one_source_chains_every_target_at_the_bottleneck_speed():
    hosts = cluster_endpoints(hosts=3, gpus_per_host=2)
    source, targets = hosts[0][0], [hosts[0][1], *hosts[1], *hosts[2]]
    plan = plan_scale_out(sources=[source], targets=targets, topology=NVLINK, weights_bytes=16 * GB)
    check_plan(plan, [source], targets, NVLINK, 16 * GB)
    assert len(plan.chains) == 1
    chain = plan.chains[0]
    # The NVLink neighbour first (fastest link), then the other hosts over RDMA.
    assert chain.source == "h0g0" and chain.targets[0] == "h0g1"
    assert chain.gbps == 12.5
    # A chain to five receivers costs barely more than a unicast to one (Fig. 13 a): the pipeline
    # fill, not a multiple of the transfer.
    one = NVLINK.ready_s(16 * GB, 12.5, 1)
    assert chain.expected_seconds < 1.25 * one < 5 * one


def test_two_sources_make_two_chains_and_each_stays_within_its_leaf():
    hosts = cluster_endpoints(hosts=4, gpus_per_host=1, hosts_per_domain=2)
    topology = Topology.cluster(nvlink_gbps=None, rdma_gbps=12.5, spine_oversubscription=4.0)
    sources = [hosts[0][0], hosts[2][0]]
    targets = [hosts[1][0], hosts[3][0]]
    plan = plan_scale_out(sources=sources, targets=targets, topology=topology, weights_bytes=GB)
    check_plan(plan, sources, targets, topology, GB)
    assert {(c.source, c.targets) for c in plan.chains} == {("h0g0", ("h1g0",)), ("h2g0", ("h3g0",))}
    assert all(c.gbps == 12.5 for c in plan.chains)  # nothing crosses the oversubscribed spine


def test_no_pool_copy_means_one_disk_chain_per_host():
    hosts = cluster_endpoints(hosts=2, gpus_per_host=3)
    targets = [e for h in hosts for e in h]
    plan = plan_scale_out(sources=[], targets=targets, topology=NVLINK, weights_bytes=4 * GB)
    check_plan(plan, [], targets, NVLINK, 4 * GB)
    assert sorted(c.source for c in plan.chains) == ["disk@h0", "disk@h1"]
    assert all(c.source_kind == "disk" and c.gbps == 3.0 for c in plan.chains)
    # Read once from NVMe, forwarded over NVLink: each host's three GPUs share one chain.
    assert sorted(len(c.targets) for c in plan.chains) == [3, 3]


def test_disk_is_the_last_resort_when_a_pool_copy_is_faster():
    hosts = cluster_endpoints(hosts=3, gpus_per_host=1)
    cache = host_cache_endpoint("h0", "d0")
    targets = [hosts[1][0], hosts[2][0]]
    plan = plan_scale_out(sources=[cache], targets=targets, topology=NVLINK, weights_bytes=8 * GB)
    check_plan(plan, [cache], targets, NVLINK, 8 * GB)
    assert [c.source for c in plan.chains] == ["cache@h0"]
    assert plan.chains[0].source_kind == "host_cache"


def test_disk_wins_only_where_the_network_is_slower():
    # A spine oversubscribed 8:1 leaves 1.56 GB/s across leaves, below the 3 GB/s NVMe: the far
    # target reads its own disk, the near one still loads from the peer.
    hosts = cluster_endpoints(hosts=3, gpus_per_host=1, hosts_per_domain=2)
    topology = Topology.cluster(nvlink_gbps=None, rdma_gbps=12.5, spine_oversubscription=8.0)
    source, near, far = hosts[0][0], hosts[1][0], hosts[2][0]
    plan = plan_scale_out(sources=[source], targets=[near, far], topology=topology, weights_bytes=8 * GB)
    check_plan(plan, [source], [near, far], topology, 8 * GB)
    assert plan.upstream_of("h1g0") == "h0g0"
    assert plan.upstream_of("h2g0") == "disk@h2"


def test_busy_links_are_avoided_when_an_equal_path_is_free():
    hosts = cluster_endpoints(hosts=3, gpus_per_host=1)
    a, b, target = hosts[0][0], hosts[1][0], hosts[2][0]
    # a's outbound direction carries a migration; b is as close to the target and free.
    topology = NVLINK.with_busy({("h0g0", "someone")})
    plan = plan_scale_out(sources=[a, b], targets=[target], topology=topology, weights_bytes=GB)
    check_plan(plan, [a, b], [target], topology, GB)
    assert plan.upstream_of("h2g0") == "h1g0"
    # The opposite direction of the same link is free (RDMA is full duplex): inbound migrations to
    # a do not slow a flow out of a.
    inbound = NVLINK.with_busy({("someone", "h0g0")})
    plan = plan_scale_out(sources=[a], targets=[target], topology=inbound, weights_bytes=GB)
    assert plan.chains[0].gbps == 12.5


def test_a_busy_target_is_served_at_its_share_and_ordered_after_free_ones():
    hosts = cluster_endpoints(hosts=3, gpus_per_host=1)
    source, busy, free = hosts[0][0], hosts[1][0], hosts[2][0]
    topology = NVLINK.with_busy({("x", "h1g0")})
    plan = plan_scale_out(sources=[source], targets=[busy, free], topology=topology, weights_bytes=GB)
    check_plan(plan, [source], [busy, free], topology, GB)
    assert plan.chains[0].targets == ("h2g0", "h1g0")
    assert plan.chains[0].gbps == 12.5 * topology.busy_share


def test_empty_targets_give_an_empty_plan():
    plan = plan_scale_out(sources=[], targets=[], topology=NVLINK, weights_bytes=1)
    assert plan.chains == () and plan.expected_seconds == 0.0


def test_json_round_trip_and_shape():
    hosts = cluster_endpoints(hosts=2, gpus_per_host=2)
    plan = plan_scale_out(
        sources=[hosts[0][0]], targets=[hosts[0][1], *hosts[1]], topology=NVLINK, weights_bytes=GB
    )
    data = plan.to_json()
    assert data["fallback"] == "disk"
    assert set(data["chains"][0]) >= {"source", "targets", "gbps", "expected_seconds"}
    again = ScalePlan.from_json(data)
    assert again == plan and dict(again.expected_ready_s) == dict(plan.expected_ready_s)
    # The documented minimal shape (no per-target times) is accepted: each target gets the chain's time.
    minimal = ScalePlan.from_json(
        {
            "chains": [{"source": "s", "targets": ["a", "b"], "gbps": 10, "expected_seconds": 2.5}],
            "fallback": "disk",
        }
    )
    assert dict(minimal.expected_ready_s) == {"a": 2.5, "b": 2.5}
    assert Topology.from_json(NVLINK.with_busy({("a", "b")}).to_json()) == NVLINK.with_busy({("a", "b")})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"weights_bytes": 0}, "weights_bytes"),
        ({"targets": [Endpoint("c", "h", "d", "host_cache")]}, "target 'c' must be a gpu"),
        ({"sources": [Endpoint("t", "h", "d")]}, "given twice"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    args = {"sources": [], "targets": [Endpoint("t", "h", "d")], "topology": NVLINK, "weights_bytes": GB}
    args.update(kwargs)
    with pytest.raises(ScalePlanError, match=field):
        plan_scale_out(**args)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Endpoint("x", "h", "d", "tape"), "kind"),
        (lambda: Topology(rdma_gbps=0), "rdma_gbps"),
        (lambda: Topology(rdma_gbps=1, spine_oversubscription=0.5), "spine_oversubscription"),
        (lambda: Topology(rdma_gbps=1, busy_share=0), "busy_share"),
        (lambda: Topology.from_json({"rdma_gbps": 1, "speed": 2}), "speed"),
        (lambda: ScalePlan.from_json({"chains": [{"source": "s"}]}), "targets"),
        (
            lambda: ScalePlan(chains=(Chain("a", ("t",), 1, 1), Chain("b", ("t",), 1, 1))),
            "more than one chain",
        ),
    ],
)
def test_bad_values_name_the_field(build, field):
    with pytest.raises(ScalePlanError, match=field):
        build()


# --- properties -----------------------------------------------------------------------------------


@st.composite
def scale_out_cases(draw):
    n_hosts = draw(st.integers(1, 6))
    per_host = draw(st.integers(1, 4))
    hosts_per_domain = draw(st.integers(1, 3))
    hosts = cluster_endpoints(hosts=n_hosts, gpus_per_host=per_host, hosts_per_domain=hosts_per_domain)
    gpus = [e for h in hosts for e in h]
    roles = draw(
        st.lists(st.sampled_from(["source", "target", "none"]), min_size=len(gpus), max_size=len(gpus))
    )
    sources = [g for g, r in zip(gpus, roles, strict=True) if r == "source"]
    targets = [g for g, r in zip(gpus, roles, strict=True) if r == "target"]
    for h in range(n_hosts):
        if draw(st.booleans()):
            sources.append(host_cache_endpoint(f"h{h}", f"d{h // hosts_per_domain}"))
    ids = [e.id for e in (*sources, *targets)] or ["x"]
    busy = draw(st.frozensets(st.tuples(st.sampled_from(ids), st.sampled_from(ids)), max_size=4))
    topology = Topology(
        rdma_gbps=draw(st.sampled_from([1.0, 12.5, 25.0, 50.0])),
        nvlink_gbps=draw(st.sampled_from([None, 100.0, 200.0])),
        pcie_gbps=draw(st.sampled_from([12.0, 25.0])),
        nvme_gbps=draw(st.sampled_from([0.5, 3.0, 7.0])),
        spine_oversubscription=draw(st.sampled_from([1.0, 2.0, 8.0])),
        hop_latency_s=draw(st.sampled_from([0.0, 0.01, 0.1])),
        pipeline_blocks=draw(st.integers(1, 64)),
        busy=busy,
        busy_share=draw(st.sampled_from([0.25, 0.5, 1.0])),
    )
    weights_bytes = draw(st.integers(1, 50 * GB))
    return sources, targets, topology, weights_bytes


@settings(max_examples=300, deadline=None)
@given(scale_out_cases(), st.randoms(use_true_random=False))
def test_every_plan_keeps_the_invariants_and_does_not_depend_on_input_order(case, rnd: random.Random):
    sources, targets, topology, weights_bytes = case
    plan = plan_scale_out(sources=sources, targets=targets, topology=topology, weights_bytes=weights_bytes)
    check_plan(plan, sources, targets, topology, weights_bytes)
    shuffled_sources, shuffled_targets = list(sources), list(targets)
    rnd.shuffle(shuffled_sources)
    rnd.shuffle(shuffled_targets)
    again = plan_scale_out(
        sources=shuffled_sources, targets=shuffled_targets, topology=topology, weights_bytes=weights_bytes
    )
    assert again == plan
    assert ScalePlan.from_json(plan.to_json()) == plan


@settings(max_examples=200, deadline=None)
@given(scale_out_cases())
def test_no_target_waits_longer_than_its_own_disk_alone_would_take_when_it_is_first(case):
    """The greedy takes the earliest-ready pair first, so the first target of every chain is ready no
    later than a direct read of its own disk (which was always a candidate for it)."""
    sources, targets, topology, weights_bytes = case
    plan = plan_scale_out(sources=sources, targets=targets, topology=topology, weights_bytes=weights_bytes)
    by_id = endpoints_by_id(sources, targets)
    earliest = min(plan.expected_ready_s.values(), default=None)
    if earliest is None:
        return
    direct_disk = min(
        topology.ready_s(weights_bytes, topology.flow_gbps(by_id[f"disk@{t.host}"], t), 1) for t in targets
    )
    assert earliest <= direct_disk + 1e-12
