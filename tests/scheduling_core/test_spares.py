"""Boot-aware spare capacity (issue 27): the pure rule, the policy that uses it, the simulator."""

from __future__ import annotations

import math

import pytest

from scheduling.core.spares import DEFAULT_MARGIN_Z, SpareInputs, spare_target
from scheduling.core.turboserve import TurboServePolicy
from scheduling.core.types import GB, Event, GpuTypeSpec, GpuView, SessionView, Snapshot
from scheduling.sim.simulator import SimConfig, simulate
from scheduling.sim.traces import TraceEvent


def inputs(**kw) -> SpareInputs:
    base = {
        "policy": "boot-aware",
        "delay_s": 30.0,
        "delay_source": "predicted",
        "bin_s": 5.0,
        "mean_per_bin": 1.0,
        "std_per_bin": 2.0,
        "margin_z": 1.0,
        "floor": 0.0,
    }
    return SpareInputs(**{**base, **kw})


def spec(k=4.0, mem=8, delay=30.0) -> GpuTypeSpec:
    return GpuTypeSpec(
        name="t",
        gpu_type="t",
        capacity=k,
        latency_points=((0.0, 400.0), (2 * k, 1200.0)),
        price_per_hour=3.6,
        provisioning_delay_s=delay,
        memory_limit_sessions=mem,
        state_bytes=int(GB),
    )


def test_target_is_drift_over_the_delay_plus_z_sigma_root_bins():
    # 30 s / 5 s = 6 bins: drift 1 × 6 = 6, margin 1 × 2 × √6.
    got = spare_target(inputs())
    assert got.expected == pytest.approx(6.0)
    assert got.margin == pytest.approx(2.0 * math.sqrt(6.0))
    assert got.target == pytest.approx(6.0 + 2.0 * math.sqrt(6.0))
    assert "30.0 s scale-out (predicted)" in got.why
    # A shorter predicted delay (peer scale-out) needs fewer spares.
    assert spare_target(inputs(delay_s=2.0)).target < got.target / 3


def test_a_falling_trend_adds_nothing_and_the_floor_holds():
    falling = spare_target(inputs(mean_per_bin=-3.0, std_per_bin=0.0))
    assert falling.expected == 0.0 and falling.target == 0.0
    floored = spare_target(inputs(mean_per_bin=0.0, std_per_bin=0.0, floor=4.0))
    assert floored.target == 4.0
    assert floored.why.startswith("floor 4")
    record = floored.to_json()
    assert record["target"] == 4.0 and record["floor"] == 4.0 and record["delay_source"] == "predicted"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("policy", "sometimes", "spare policy"),
        ("delay_s", -1.0, "delay_s"),
        ("margin_z", math.nan, "margin_z"),
        ("floor", -2.0, "floor"),
        ("bin_s", 0.0, "bin_s"),
    ],
)
def test_bad_inputs_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        inputs(**{field: value})


def test_off_is_the_headroom_as_before():
    # SPARE_POLICY=off feeds the same rule the detector's old formula: stated delay, headroom_z.
    policy = TurboServePolicy(rho_hat=0.8, headroom_z=0.5)
    for t in (0.0, 1.0, 6.0, 7.0, 12.0):
        policy.detector.observe(t, "active")
    snap = Snapshot.build(time=13.0, sessions=[], gpus=[GpuView("g1", "t", "ready")], gpu_types={"t": spec()})
    decision = policy.decide(snap, Event(13.0, "tick"))
    assert decision.signals.spares is not None
    assert decision.signals.spares.inputs.delay_source == "stated"
    assert decision.signals.headroom == pytest.approx(
        policy.detector.expected_net_activations(13.0, 30.0, 0.5)
    )


def _one_gpu_two_sessions(time: float, predicted: dict[str, float] | None = None) -> Snapshot:
    sessions = [SessionView(f"s{i}", 1, "executing", 1.0, "g1", GB) for i in range(2)]
    snap = Snapshot.build(
        time=time, sessions=sessions, gpus=[GpuView("g1", "t", "ready")], gpu_types={"t": spec()}, max_gpus=8
    )
    if predicted is not None:
        snap = Snapshot(
            **{**{f: getattr(snap, f) for f in snap.__dataclass_fields__}, "scale_out_delay_s": predicted}
        )
    return snap


def test_boot_aware_spares_scale_out_before_the_load_shows_in_rho():
    # Two sessions on one GPU of K = 4 at ρ̂ = 0.8: ρ = 0.5 is inside the band, so the paper's loop
    # and the old headroom (z = 0.5 on a quiet detector: 0) keep one GPU. A floor of 3 spare sessions
    # leaves 2 < 3 free at K: boot-aware spares ask for a second GPU now.
    off = TurboServePolicy(rho_hat=0.8, cooldown_s=0.0)
    on = TurboServePolicy(rho_hat=0.8, cooldown_s=0.0, spares="boot-aware", spare_min=3.0)
    assert not off.decide(_one_gpu_two_sessions(1.0), Event(1.0, "tick")).add_gpus
    decision = on.decide(_one_gpu_two_sessions(1.0), Event(1.0, "tick"))
    assert decision.add_gpus == (("t", 1),)
    assert decision.signals.spares.target == 3.0
    assert decision.signals.spares.inputs.delay_source == "stated"  # no scale-out seen yet


def test_boot_aware_spares_read_the_predicted_delay():
    policy = TurboServePolicy(rho_hat=0.8, spares="boot-aware", spare_margin_z=DEFAULT_MARGIN_Z)
    for t in (0.0, 5.0, 6.0, 11.0):
        policy.detector.observe(t, "active")
    cold = policy.decide(_one_gpu_two_sessions(12.0), Event(12.0, "tick")).signals.spares
    peer = policy.decide(_one_gpu_two_sessions(12.0, {"t": 2.0}), Event(12.0, "tick")).signals.spares
    assert cold.inputs.delay_s == 30.0 and peer.inputs.delay_s == 2.0
    assert peer.inputs.delay_source == "predicted"
    assert 0 < peer.target < cold.target


def test_policy_refuses_an_unknown_spare_policy():
    with pytest.raises(ValueError, match="spares must be one of off, boot-aware"):
        TurboServePolicy(spares="always")


def test_simulated_spares_are_ready_when_a_burst_arrives():
    # Two users active from t = 0.5, four more at t = 100 (K = 4, 30 s cold boot). The start-up drift
    # makes both policies scale out at first and scale back in once it has passed. With boot-aware
    # spares (a floor of one GPU's K) the pool keeps a second ready GPU and the burst spreads over two
    # GPUs; without them the burst lands on one GPU above K while a new one boots.
    rows = [TraceEvent(0.0, f"s{i}", "arrive") for i in range(6)]
    rows += [TraceEvent(0.5, f"s{i}", "active") for i in range(2)]
    rows += [TraceEvent(100.0 + 0.1 * i, f"s{i}", "active") for i in range(2, 6)]
    rows += [TraceEvent(160.0, f"s{i}", "depart") for i in range(6)]
    config = SimConfig(profiles=[spec()], initial_gpus=1, min_gpus=1, max_gpus=8)

    def run(**kw):
        return simulate(rows, TurboServePolicy(rho_hat=0.8, **kw), config)

    off = run()
    on = run(spares="boot-aware", spare_min=4.0)
    assert off.worst_chunk_latency_ms == pytest.approx(spec().latency_ms(6.0))  # six on one GPU
    assert on.worst_chunk_latency_ms < off.worst_chunk_latency_ms
    assert on.gpu_cost_usd > off.gpu_cost_usd  # the spare GPU is paid for while it waits
