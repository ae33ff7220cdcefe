"""The move rule shared by the simulator and the live scheduler: a running session changes region
only when the saving beats its switching cost, within its RTT budget, at most the slot's limit."""

from __future__ import annotations

import pytest

from scheduling.core.regions.moves import (
    MoveCase,
    MoveSettings,
    PastMove,
    RegionNow,
    RunningSession,
    move_saving_ms,
    move_verdict,
    running_moves,
    switch_cost_ms,
)
from scheduling.core.regions.partition import regions_to_zero
from scheduling.core.types import Decision, GpuTypeSpec, GpuView, SessionView, Snapshot
from scheduling.sim.regions.simulator import RegionSimConfig

MB = 1e6


def settings(**overrides) -> MoveSettings:
    values = dict(
        rtt_budget_ms=60.0, chunk_ms=600.0, chunk_period_s=1.0, horizon_s=300.0, limit=4,
        wan_gbps=1.0, wan_gbps_pairs={},
    )  # fmt: skip
    return MoveSettings(**{**values, **overrides})


def region(capacity, load, sessions, *, rtt, price_ms=0.0, free=100, relief_s=None) -> RegionNow:
    return RegionNow(
        capacity=capacity, load=load, price_ms=price_ms, rtt_ms=rtt, free_sessions=free,
        relief_s=relief_s, sessions=sessions,
    )  # fmt: skip


def overloaded_east(**west) -> dict[str, RegionNow]:
    """East holds six sessions of load 1 on capacity 4 (stretch 1.5); west is idle, 25 ms from chi."""
    return {
        "east": region(4, 6, 6, rtt={"chi": 20.0}),
        "west": region(4, 0, 0, rtt={"chi": 25.0}, **west),
    }


def chi_sessions(n=6, state_bytes=12.8 * MB) -> list[RunningSession]:
    return [RunningSession(f"s{i}", "chi", "east", 1.0, state_bytes) for i in range(n)]


def test_the_switching_cost_is_the_state_over_the_wan_plus_one_rtt():
    # 12.8 MB at 1 Gbit/s is 102.4 ms, plus the 25 ms to reconnect
    assert switch_cost_ms(state_bytes=12.8 * MB, wan_gbps=1.0, rtt_ms=25.0) == pytest.approx(127.4)
    # and it is the simulator's stall, to the ulp
    config = RegionSimConfig()
    assert switch_cost_ms(
        state_bytes=config.state_mb * 1e6, wan_gbps=config.wan_mbps / 1000.0, rtt_ms=0.0
    ) == pytest.approx(102.4, rel=1e-12)


def test_the_saving_counts_the_session_and_its_neighbours_over_the_chunks():
    case = MoveCase(
        load=1.0, source_load=6.0, source_capacity=4.0, target_load=0.0, target_capacity=4.0,
        source_rtt_ms=20.0, target_rtt_ms=25.0, neighbours=5, chunk_ms=600.0, chunks=10.0,
    )  # fmt: skip
    # own: (20 + 900) − (25 + 600) = 295; neighbours: 5 × 600 × (1.5 − 1.25) = 750; × 10 chunks
    assert move_saving_ms(case) == pytest.approx(10 * (295 + 750))
    assert move_verdict(case, switch_cost_ms=10_449.0).pays
    assert not move_verdict(case, switch_cost_ms=10_450.0).pays  # strictly beats it


def test_an_overloaded_region_sheds_sessions_until_it_is_not_overloaded():
    # when a slot runs on east at 6 on 4, then two sessions move west (east is then at capacity)
    moves = running_moves(overloaded_east(), chi_sessions(), settings())
    assert [(m.source, m.target, m.why) for m in moves] == [("east", "west", "overload")] * 2
    assert all(m.saving_ms > m.switch_cost_ms for m in moves)


def test_no_move_when_the_state_is_too_big_for_the_wan():
    # given each session's state 3.5 GB over a 0.05 Gbit/s link between east and west (560 s stall)
    moves = running_moves(
        overloaded_east(), chi_sessions(state_bytes=3.5e9), settings(wan_gbps_pairs={("west", "east"): 0.05})
    )
    # then the saving over 300 chunks (313.5 s) does not pay for it, and nothing moves
    assert moves == []
    # while the same state over the default 1 Gbit/s (28 s) does
    assert len(running_moves(overloaded_east(), chi_sessions(state_bytes=3.5e9), settings())) == 2


def test_booting_gpus_that_relieve_the_region_soon_make_a_move_not_worth_it():
    regions = overloaded_east()
    regions["east"] = region(4, 6, 6, rtt={"chi": 20.0}, relief_s=0.1)
    assert running_moves(regions, chi_sessions(), settings()) == []


def test_a_region_beyond_the_rtt_budget_is_never_a_target():
    regions = overloaded_east()
    regions["west"] = region(4, 0, 0, rtt={"chi": 61.0})
    assert running_moves(regions, chi_sessions(), settings()) == []


def test_no_target_without_room_or_memory_and_at_most_the_limit():
    assert running_moves(overloaded_east(free=0), chi_sessions(), settings()) == []
    assert len(running_moves(overloaded_east(), chi_sessions(), settings(limit=1))) == 1
    assert running_moves(overloaded_east(), chi_sessions(), settings(limit=0)) == []


def test_the_plan_sheds_an_origins_excess_when_the_price_pays_for_the_move():
    # given east not overloaded but dear (100 ms-equivalents per load unit more than west), and the
    # plan wanting one unit of chi out of east and into west
    regions = {
        "east": region(4, 2, 2, rtt={"chi": 20.0}, price_ms=150.0),
        "west": region(4, 0, 0, rtt={"chi": 25.0}, price_ms=50.0),
    }
    excess = {("chi", "east"): 1.0, ("chi", "west"): -1.0}
    moves = running_moves(regions, chi_sessions(2), settings(), excess=excess)
    # then one session moves (own saving: 300 chunks × (100 − 5) ms-eq against a 127 ms stall)
    assert [(m.source, m.target, m.why) for m in moves] == [("east", "west", "plan")]
    assert moves[0].saving_ms == pytest.approx(300 * 95.0)
    # and without the price difference, 5 ms more RTT never pays
    regions["east"] = region(4, 2, 2, rtt={"chi": 20.0}, price_ms=50.0)
    assert running_moves(regions, chi_sessions(2), settings(), excess=excess) == []


# -- hysteresis: a session that moved recently stays, and a move back pays both switches ------------


def test_a_session_moved_within_the_cooldown_is_held():
    case = MoveCase(
        load=1.0, source_load=6.0, source_capacity=4.0, target_load=0.0, target_capacity=4.0,
        source_rtt_ms=20.0, target_rtt_ms=25.0, neighbours=5, chunk_ms=600.0, chunks=10.0,
    )  # fmt: skip
    recent = PastMove(age_s=60.0, source="south", switch_cost_ms=100.0)
    # given a move that pays (10,450 ms saved against 127 ms), by a session that moved 60 s ago
    verdict = move_verdict(case, switch_cost_ms=127.0, target="west", last_move=recent, cooldown_s=300.0)
    # then it is held by the cooldown, and pays once the cooldown has passed
    assert (verdict.pays, verdict.held) == (False, "cooldown")
    assert move_verdict(case, switch_cost_ms=127.0, target="west", last_move=recent, cooldown_s=60.0).pays


def test_a_move_back_is_charged_the_switch_that_brought_the_session_too():
    case = MoveCase(
        load=1.0, source_load=6.0, source_capacity=4.0, target_load=0.0, target_capacity=4.0,
        source_rtt_ms=20.0, target_rtt_ms=25.0, neighbours=5, chunk_ms=600.0, chunks=10.0,
    )  # fmt: skip
    came_from_west = PastMove(age_s=900.0, source="west", switch_cost_ms=10_000.0)
    # back to west: 127 + 10,000 ms charged against 10,450 saved — pays; with a dearer first switch not
    back = move_verdict(case, switch_cost_ms=127.0, target="west", last_move=came_from_west, cooldown_s=300.0)
    assert (back.switch_cost_ms, back.charged_ms, back.pays) == (127.0, 10_127.0, True)
    dearer = PastMove(age_s=900.0, source="west", switch_cost_ms=10_400.0)
    assert not move_verdict(case, switch_cost_ms=127.0, target="west", last_move=dearer).pays
    # and onward to a third region only its own switch is charged
    onward = move_verdict(case, switch_cost_ms=127.0, target="north", last_move=dearer)
    assert (onward.charged_ms, onward.pays) == (127.0, True)


def test_the_slot_skips_sessions_in_their_cooldown_and_charges_a_move_back():
    sessions = chi_sessions()
    # given every session but s5 moved into east 60 s ago (s5 long ago), with a 300 s cooldown
    recent = PastMove(age_s=60.0, source="west", switch_cost_ms=127.4)
    old = PastMove(age_s=3600.0, source="west", switch_cost_ms=127.4)
    held = [RunningSession(s.id, s.origin, s.region, s.load, s.state_bytes, recent) for s in sessions[:5]]
    held.append(RunningSession("s5", "chi", "east", 1.0, 12.8 * MB, old))
    moves = running_moves(overloaded_east(), held, settings(cooldown_s=300.0))
    # then only s5 moves, charged its own switch (west is 25 ms from chi) and the one that brought it
    assert [(m.session, m.target) for m in moves] == [("s5", "west")]
    assert (moves[0].switch_cost_ms, moves[0].charged_ms) == pytest.approx((127.4, 2 * 127.4))
    # and without the cooldown the slot sheds two as before
    assert len(running_moves(overloaded_east(), held, settings(cooldown_s=0.0))) == 2


# -- an idle region to zero ------------------------------------------------------------------------


def zero_case(sessions=(), gpus=("w1", "w2"), decision: Decision | None = None):
    spec = GpuTypeSpec(
        name="t", gpu_type="t", capacity=4.0, latency_points=((0.0, 100.0), (8.0, 300.0)),
        price_per_hour=1.0, provisioning_delay_s=30.0, memory_limit_sessions=2,
    )  # fmt: skip
    snap = Snapshot.build(
        time=100.0,
        sessions=sessions,
        gpus=[GpuView(id=g, gpu_type="t", status="ready", ready_at=0.0) for g in gpus],
        gpu_types={"t": spec},
        min_gpus=0,
        max_gpus=10,
    )
    return {"west": snap}, {"west": decision or Decision(time=100.0, target_budget=len(gpus))}


def test_an_idle_region_with_a_forecast_of_none_releases_every_gpu_down_to_its_minimum():
    snaps, decisions = zero_case()
    out = regions_to_zero(snaps, decisions, idle={"west"}, minimum={})
    assert (out["west"].release, out["west"].target_budget) == (("w1", "w2"), 0)
    # a per-region minimum keeps that many
    assert regions_to_zero(snaps, decisions, idle={"west"}, minimum={"west": 1})["west"].release == ("w1",)
    # and a region not idle by the forecast keeps its GPUs
    assert regions_to_zero(snaps, decisions, idle=set(), minimum={})["west"].release == ()


def test_a_region_holding_a_session_or_scaling_out_is_not_scaled_to_zero():
    parked = SessionView(id="s", alpha=0, state="suspended", gpu=None, load=1.0, since=1.0)
    snaps, decisions = zero_case(sessions=[parked])
    assert regions_to_zero(snaps, decisions, idle={"west"}, minimum={})["west"].release == ()
    snaps, decisions = zero_case(decision=Decision(time=100.0, add_gpus=(("t", 1),)))
    assert regions_to_zero(snaps, decisions, idle={"west"}, minimum={})["west"].release == ()
