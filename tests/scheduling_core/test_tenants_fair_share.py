"""Weighted fair share in the decision (``scheduling.core.tenants``, pipeline step ``fair_share``): the
tenant furthest under its share is offered the GPUs first, FCFS within a tenant, and a tenant over a
GPU-second quota waits on spare capacity and never makes the pool scale out."""

from __future__ import annotations

from scheduling.core.pipeline import DecisionInputs, decision_run
from scheduling.core.tenants import TenantShares, fair_order
from scheduling.core.turboserve import TurboServePolicy
from scheduling.core.types import Event, GpuTypeSpec, GpuView, SessionView, Snapshot

SPEC = GpuTypeSpec(
    name="t",
    gpu_type="t",
    capacity=4.0,
    latency_points=((0.0, 100.0), (8.0, 300.0)),
    price_per_hour=1.0,
    provisioning_delay_s=30.0,
    memory_limit_sessions=2,
)


def waiting(sid: str, since: float) -> SessionView:
    return SessionView(id=sid, alpha=1, state="queued", since=since)


def running(sid: str, gpu: str) -> SessionView:
    return SessionView(id=sid, alpha=1, state="executing", gpu=gpu, since=0.0)


def full_pool(*pending: SessionView, max_gpus: int = 10) -> Snapshot:
    """One ready GPU at half its K with no memory left (two residents), and ``pending`` waiting."""
    return Snapshot.build(
        time=100.0,
        sessions=[running("r1", "g1"), running("r2", "g1"), *pending],
        gpus=[GpuView(id="g1", gpu_type="t", status="ready", ready_at=0.0)],
        gpu_types={"t": SPEC},
        max_gpus=max_gpus,
    )


def test_the_tenant_under_its_share_goes_first_fcfs_within_each_tenant():
    shares = TenantShares(
        session_tenant={"a1": "a", "a2": "a", "b1": "b", "b2": "b"},
        weights={"a": 3.0, "b": 1.0},
        # a used 60 s for a weight of 3 (20 per unit), b 30 s for 1 (30 per unit): a is under its share
        usage={"a": 60.0, "b": 30.0},
    )
    assert fair_order(("b1", "a1", "b2", "a2"), shares) == ("a1", "a2", "b1", "b2")
    # b's 30 s is now under its quarter of 200: b goes first, its sessions still in arrival order
    assert fair_order(
        ("b1", "a1", "b2", "a2"), TenantShares(**{**shares.__dict__, "usage": {"a": 170.0, "b": 30.0}})
    ) == (
        "b1",
        "b2",
        "a1",
        "a2",
    )


def test_one_tenant_keeps_arrival_order_and_a_tenant_over_quota_goes_last():
    assert fair_order(("x", "y"), TenantShares(session_tenant={"x": "a", "y": "a"})) == ("x", "y")
    shares = TenantShares(
        session_tenant={"a1": "a", "b1": "b"}, usage={"b": 0.0, "a": 99.0}, spare_only=frozenset({"b"})
    )
    assert fair_order(("b1", "a1"), shares) == ("a1", "b1")


def test_the_decision_queues_in_fair_share_order():
    snap = full_pool(waiting("b1", 1.0), waiting("a1", 2.0))
    shares = TenantShares(
        session_tenant={"a1": "a", "b1": "b"}, weights={"a": 3.0}, usage={"a": 30.0, "b": 30.0}
    )
    event = Event(time=100.0, kind="tick")
    policy = TurboServePolicy(rho_hat=0.7, autoscale=False)
    run = decision_run(
        DecisionInputs(snapshot=snap, event=event, tenants=shares), lambda rs: dict.fromkeys(rs, policy)
    )
    (part,) = run.regions.values()
    assert part.snapshot.pending == ("a1", "b1")
    assert part.decision.queue == ("a1", "b1")
    # without tenants: arrival order
    plain = decision_run(DecisionInputs(snapshot=snap, event=event), lambda rs: dict.fromkeys(rs, policy))
    assert plain.regions["local"].decision.queue == ("b1", "a1")


def test_a_tenant_over_its_gpu_quota_never_triggers_scale_out():
    snap = full_pool(waiting("b1", 1.0), waiting("b2", 2.0))
    event = Event(time=100.0, kind="active", session="b2")
    over = TenantShares(session_tenant={"b1": "b", "b2": "b"}, spare_only=frozenset({"b"}))
    within = TenantShares(session_tenant={"b1": "b", "b2": "b"})

    def decide(shares):
        policy = TurboServePolicy(rho_hat=0.7)
        run = decision_run(
            DecisionInputs(snapshot=snap, event=event, tenants=shares), lambda rs: dict.fromkeys(rs, policy)
        )
        return run.regions["local"]

    # within its quota, the waiting sessions make the pool grow; over it, they wait for spare room
    assert decide(within).decision.add_gpus != ()
    spared = decide(over)
    assert spared.snapshot.spare_only == {"b1", "b2"}
    assert spared.decision.add_gpus == () and spared.decision.queue == ("b1", "b2")


def test_running_sessions_of_a_tenant_over_quota_do_not_count_as_demand():
    # Given: a GPU loaded above the target (ρ = 0.5 > 0.3) by a tenant over its quota's sessions alone
    snap = full_pool()
    event = Event(time=100.0, kind="tick")
    over = TenantShares(session_tenant={"r1": "b", "r2": "b"}, spare_only=frozenset({"b"}))
    policy = TurboServePolicy(rho_hat=0.3)
    run = decision_run(
        DecisionInputs(snapshot=snap, event=event, tenants=over), lambda rs: dict.fromkeys(rs, policy)
    )
    decision = run.regions["local"].decision
    # Then: they keep running where they are, and the pool does not grow for them
    assert decision.add_gpus == () and decision.signals.n_req == 0.0
    assert decision.drain == decision.release == ()
    baseline = decision_run(
        DecisionInputs(snapshot=snap, event=event),
        lambda rs: dict.fromkeys(rs, TurboServePolicy(rho_hat=0.3)),
    )
    assert baseline.regions["local"].decision.add_gpus != ()
