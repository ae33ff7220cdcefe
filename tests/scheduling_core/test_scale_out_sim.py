"""The provisioning delay as a model (boot + weights by source) and the simulator's fairness rules."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scheduling.core.gpu_profiles import BUILTIN_PROFILES, ProfileError, profile_from_json
from scheduling.core.policy import Policy, make_policy
from scheduling.core.provisioning import ScaleOutModel
from scheduling.core.scaleplan import ScalePlanError, Topology
from scheduling.core.types import GB, Decision
from scheduling.sim.cli import CliError, run_simulate
from scheduling.sim.compare import compare_policies
from scheduling.sim.simulator import SimConfig, SimulationError, simulate
from scheduling.sim.traces import write_trace

from .test_simulator import burst_trace, flat_spec, trace

# Links chosen so the paths differ clearly: disk 1 GB/s, the network 10 GB/s, 10 GB of weights.
MODEL = ScaleOutModel(
    boot_s=1.0,
    weights_bytes=10 * GB,
    topology=Topology.cluster(
        nvlink_gbps=100.0, rdma_gbps=10.0, pcie_gbps=20.0, nvme_gbps=1.0, hop_latency_s=0.0
    ),
    path="disk",
    gpus_per_host=2,
    hosts_per_domain=2,
)


def spec_with(model=MODEL, **kw):
    return flat_spec(k=2, mem=20, delay=30.0, scale_out=model, **kw)


def ramp(n=8):
    return burst_trace(n, start=1.0, end=80.0)


def run(path, n=8, initial=1, model=MODEL):
    config = SimConfig(
        profiles=[spec_with(model)], initial_gpus=initial, min_gpus=1, max_gpus=8, scale_out=path
    )
    return simulate(ramp(n), make_policy("turboserve", rho_hat=0.8), config)


def test_each_scale_out_gets_boot_plus_the_plans_load_time_by_source():
    disk, cache, peer = run("disk"), run("host-cache"), run("peer")
    for result, kind in ((disk, "disk"), (cache, "host_cache"), (peer, "gpu")):
        assert result.scale_out["gpus"] >= 1
        assert kind in result.scale_out["by_source"]
    # 10 GB at 1 GB/s from disk after 1 s of boot; from a peer, the first new GPU sits beside the
    # serving one (slot 1 of host 0) and gets the weights over NVLink at 100 GB/s.
    assert disk.scale_out["delay_s_min"] == pytest.approx(1.0 + 10.0)
    assert peer.scale_out["delay_s_min"] == pytest.approx(1.0 + 0.1)
    assert peer.scale_out["delay_s_max"] < disk.scale_out["delay_s_min"]
    # What the policy planned with: one GPU joining on that path.
    assert disk.scale_out["expected_delay_s"]["test"] == pytest.approx(11.0)
    assert peer.scale_out["expected_delay_s"]["test"] == pytest.approx(2.0)
    # Faster joins: the ramp waits less.
    assert peer.worst_chunk_latency_ms <= disk.worst_chunk_latency_ms
    assert disk.scale_out_events and all(e["path"] == "disk" for e in disk.scale_out_events)


def test_a_batch_of_new_gpus_shares_one_chain_so_three_cost_barely_more_than_one():
    class AddThree(Policy):
        name = "add-three"

        def __init__(self):
            self.inner = make_policy("lag")
            self.done = False

        def decide(self, snapshot, event):
            d = self.inner.decide(snapshot, event)
            if self.done:
                return d
            self.done = True
            return replace(d, add_gpus=(("test", 3),))

    events = trace((0.0, "a", "arrive"), (30.0, "a", "depart"))
    config = SimConfig(profiles=[spec_with()], initial_gpus=1, min_gpus=1, max_gpus=8, scale_out="host-cache")
    result = simulate(events, AddThree(), config)
    (event,) = result.scale_out_events
    assert event["gpus"] == 3 and event["sources"] == {"host_cache": 3}
    one = MODEL.nominal_delay_s("host-cache")
    assert max(event["delay_s"]) < 1.25 * one


def test_the_profiles_own_path_is_the_default_and_fixed_keeps_the_constant():
    own = simulate(
        ramp(), make_policy("turboserve", rho_hat=0.8), SimConfig(profiles=[spec_with()], initial_gpus=1)
    )
    assert own.scale_out["path"] == {"test": "disk"}
    fixed = simulate(
        ramp(),
        make_policy("turboserve", rho_hat=0.8),
        SimConfig(profiles=[spec_with(replace(MODEL, path="fixed"))], initial_gpus=1),
    )
    assert fixed.scale_out["path"] == {"test": "fixed"}
    assert fixed.scale_out["delay_s_min"] == fixed.scale_out["delay_s_max"] == 30.0
    # A profile without a model cannot be asked for a path.
    with pytest.raises(ScalePlanError, match="no scale_out model"):
        simulate(ramp(), make_policy("lag"), SimConfig(profiles=[flat_spec()], scale_out="peer"))


def test_builtin_profiles_document_their_links_and_keep_their_cold_boot_by_default():
    for spec in BUILTIN_PROFILES.values():
        model = spec.scale_out
        assert model is not None and model.path == "fixed"
        assert "datasheet" in model.topology.source
        t = model.topology
        assert t.nvlink_gbps > t.pcie_gbps > t.nvme_gbps and t.rdma_gbps > t.nvme_gbps
        # Peers beat disk, and every path beats the stated cold boot.
        assert model.nominal_delay_s("peer") < model.nominal_delay_s("disk") < spec.provisioning_delay_s
        assert profile_from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_measured_profiles_may_carry_phases_and_old_ones_still_load():
    base = {"name": "m", "capacity": 2, "price_per_hour": 1.0, "provisioning_delay_s": 3.0}
    base["latency_ms"] = [[1, 10.0], [2, 12.0]]
    base["memory_limit_sessions"] = 4
    assert profile_from_json(base).scale_out is None
    measured = {
        **base,
        "scale_out": {
            "weights_bytes": 10**9,
            "path": "disk",
            "topology": {"rdma_gbps": 1.0, "nvme_gbps": 0.5},
            "measured_phases_s": {"process_up": 1.2, "cuda_context": 0.3, "weights_disk": 2.0},
        },
    }
    spec = profile_from_json(measured)
    assert spec.scale_out.boot_s == pytest.approx(1.5)  # the phases before any weight moves
    assert dict(spec.scale_out.measured_phases_s)["weights_disk"] == 2.0
    with pytest.raises(ProfileError, match="scale_out has unknown field"):
        profile_from_json({**measured, "scale_out": {**measured["scale_out"], "speed": 1}})
    with pytest.raises(ProfileError, match="boot_s"):
        profile_from_json({**measured, "scale_out": {"weights_bytes": 1, "topology": {"rdma_gbps": 1}}})


def test_cli_reports_the_delays_and_names_bad_combinations(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, ramp(40), meta={"name": "ramp", "duration_s": 80.0})
    out = run_simulate(
        trace=str(path), policy="turboserve", profile="h20-1.3b", max_gpus=6, initial_gpus=1, scale_out="peer"
    )
    json.dumps(out)
    assert out["scale_out"]["path"] == {"h20-1.3b": "peer"}
    assert out["scale_out"]["delay_s_max"] < BUILTIN_PROFILES["h20-1.3b"].provisioning_delay_s
    with pytest.raises(CliError) as exc:
        run_simulate(trace=str(path), policy="lag", scale_out="peer", provisioning_delay_s=0.0)
    assert exc.value.flag == "scale-out"
    with pytest.raises(CliError) as exc:
        run_simulate(trace=str(path), policy="lag", scale_out="tape")
    assert exc.value.flag == "scale-out"


# --- fairness: the simulator judges the contract -----------------------------------------------


class QueueWhileFree(Policy):
    """Queues every pending session, whatever memory is free."""

    name = "queue-while-free"

    def decide(self, snapshot, event):
        return Decision(time=snapshot.time, queue=tuple(snapshot.pending))


def test_queueing_while_a_ready_gpu_has_memory_is_rejected():
    events = trace((0.0, "a", "arrive"), (1.0, "a", "active"), (3.0, "a", "depart"))
    with pytest.raises(SimulationError, match="queued while ready GPU"):
        simulate(events, QueueWhileFree(), SimConfig(profiles=[flat_spec()], initial_gpus=1))


def test_queueing_is_allowed_when_every_ready_gpu_is_full():
    # One GPU holding one session at most: the second active session may wait.
    events = trace(
        (0.0, "a", "arrive"),
        (0.0, "b", "arrive"),
        (1.0, "a", "active"),
        (1.0, "b", "active"),
        (4.0, "a", "depart"),
    )
    events += trace((4.0, "b", "depart"))
    result = simulate(
        events,
        make_policy("lag"),
        SimConfig(profiles=[flat_spec(mem=1)], initial_gpus=1, min_gpus=1, max_gpus=1),
    )
    assert result.queued_sessions == 1


def test_matched_cost_for_another_autoscaler_is_a_search_for_the_closest_cost():
    spec = flat_spec(k=2, mem=10, delay=5.0)
    config = SimConfig(profiles=[spec], initial_gpus=2, min_gpus=1, max_gpus=6)
    events = burst_trace(10, start=1.0, end=60.0)
    out = compare_policies(
        events, config, trace="burst", policies=("turboserve", "turboserve-no-migration"), rho_grid=(0.9, 0.6)
    )
    ref = out["policies"]["turboserve"]
    other = out["policies"]["turboserve-no-migration"]
    ref_cost = ref["cost_at_matched_cost_usd"]
    chosen = abs(other["cost_at_matched_cost_usd"] - ref_cost)
    assert other["config_at_matched_cost"]
    assert all(chosen <= abs(row["gpu_cost_usd"] - ref_cost) + 1e-9 for row in other["configs_tried"])


def test_flows_still_streaming_count_as_busy_for_the_next_scale_out():
    class AddTwice(Policy):
        """One GPU at the first decision, another at the next (while the first still loads)."""

        name = "add-twice"

        def __init__(self):
            self.inner = make_policy("lag")
            self.added = 0

        def decide(self, snapshot, event):
            d = self.inner.decide(snapshot, event)
            if self.added >= 2:
                return d
            self.added += 1
            return replace(d, add_gpus=(("test", 1),))

    events = trace((0.0, "a", "arrive"), (0.5, "b", "arrive"), (30.0, "a", "depart"), (30.0, "b", "depart"))
    config = SimConfig(profiles=[spec_with()], initial_gpus=1, min_gpus=1, max_gpus=8, scale_out="host-cache")
    result = simulate(events, AddTwice(), config)
    first, second = result.scale_out_events
    # The one host copy's outbound direction still carries the first flow: the second gets half of it.
    assert first["sources"] == second["sources"] == {"host_cache": 1}
    # The first new GPU shares host 0 with the copy (PCIe); the second is on host 1 (RDMA).
    pcie = MODEL.weights_bytes / (MODEL.topology.pcie_gbps * GB)
    rdma = MODEL.weights_bytes / (MODEL.topology.rdma_gbps * GB)
    assert first["delay_s"] == [pytest.approx(MODEL.boot_s + pcie)]
    assert second["t"] < first["t"] + first["delay_s"][0]
    assert second["delay_s"] == [pytest.approx(MODEL.boot_s + rdma / MODEL.topology.busy_share)]
