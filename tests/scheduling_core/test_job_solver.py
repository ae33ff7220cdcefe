"""GenServe round solver (Alg. 1): DP optimality, preemption choice, EDF batching, policy differences."""

from __future__ import annotations

import itertools
import random

import pytest

from scheduling.core.jobs.solver import (
    ROUND_SOLVERS,
    ImageRequest,
    RoundInput,
    VideoRequest,
    _add,
    _image_scores,
    edf_batches,
    round_solver,
)

SPEEDUP = {1: 1.0, 2: 1.9, 4: 3.6, 8: 6.5}


def _video(vid: str, deadline: float, work_s: float, degree: int = 0, arrival: float = 0.0) -> VideoRequest:
    return VideoRequest(vid, deadline, arrival, degree, {d: work_s / s for d, s in SPEEDUP.items()})


def _image(
    iid: str, deadline: float, size: int = 768, arrival: float = 0.0, step_s: float = 0.03
) -> ImageRequest:
    # Batch of b: 28 steps of (fixed + b × compute), like the built-in SD3.5 profile's shape.
    return ImageRequest(
        iid, ("sd", size, size, 28), deadline, arrival, tuple(28 * (0.01 + b * step_s) for b in range(1, 9))
    )


def _random_input(rng: random.Random) -> RoundInput:
    videos = tuple(
        _video(f"v{i}", rng.uniform(5, 80), rng.uniform(5, 60), degree=rng.choice((0, 0, 1, 2)))
        for i in range(rng.randint(1, 4))
    )
    gpus = max(rng.randint(1, 8), sum(v.degree for v in videos))
    images = tuple(
        _image(f"i{i}", rng.uniform(0.5, 6), size=rng.choice((256, 768)), arrival=rng.uniform(0, 1))
        for i in range(rng.randint(0, 6))
    )
    return RoundInput(now=0.0, gpus=gpus, round_s=2.0, images=images, videos=videos)


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force_on_small_instances(seed):
    inp = _random_input(random.Random(seed))
    policy = round_solver("genserve")
    plan = policy.plan(inp)
    batches = edf_batches(inp.images, inp.now, policy.max_batch)
    images = _image_scores(batches, inp.gpus)
    best = None
    for combo in itertools.product(*(policy.video_options(v, inp) for v in inp.videos)):
        used = sum(cost for cost, _ in combo)
        if used > inp.gpus:
            continue
        total = images[inp.gpus - used]
        for _, score in combo:
            total = _add(total, score)
        best = total if best is None or total > best else best
    assert plan.score == pytest.approx(best)
    assert plan.gpus_used() <= inp.gpus
    # The plan's own degrees and batches reproduce its score.
    options = {v.id: dict(policy.video_options(v, inp)) for v in inp.videos}
    rebuilt = images[len(plan.batches)]
    for vid, degree in plan.degrees.items():
        rebuilt = _add(rebuilt, options[vid][degree])
    assert rebuilt == pytest.approx(plan.score)


@pytest.mark.parametrize("name", ["genserve", "genserve-no-dp"])
def test_preemption_pauses_the_video_with_the_most_slack(name):
    # Two GPUs, both held by videos at SP 1; an urgent image arrives. Both videos stay on time if
    # paused one round; the one with the later deadline (more slack) must be paused.
    tight = _video("tight", deadline=40.0, work_s=30.0, degree=1)
    loose = _video("loose", deadline=90.0, work_s=30.0, degree=1)
    inp = RoundInput(
        now=0.0, gpus=2, round_s=2.0, images=(_image("img", deadline=2.0),), videos=(tight, loose)
    )
    plan = round_solver(name).plan(inp)
    assert plan.degrees == {"tight": 1, "loose": 0}
    assert [b.ids for b in plan.batches] == [("img",)]


def test_a_paused_video_resumes_when_its_slack_tightens():
    # Paused, with one GPU that a late image wants too. While the video can afford another round of
    # pause the image is served; once a round of pause would cost the deadline, the video resumes.
    image = _image("img", deadline=0.5)
    relaxed = RoundInput(0.0, 1, 2.0, (image,), (_video("v", deadline=40.0, work_s=30.0),))
    assert round_solver("genserve").plan(relaxed).degrees == {"v": 0}
    tight = RoundInput(0.0, 1, 2.0, (image,), (_video("v", deadline=31.0, work_s=30.0),))
    plan = round_solver("genserve").plan(tight)
    assert plan.degrees == {"v": 1} and plan.batches == ()


def test_edf_batches_group_by_resolution_while_the_earliest_deadline_holds():
    images = [
        _image("a", 2.5, size=256),
        _image("b", 9.0, size=256),
        _image("c", 2.0, size=768),
        _image("d", 9.0, size=256),
    ]
    batches = edf_batches(images, now=0.0, max_batch=8)
    # EDF: "c" first (alone: another resolution). A batch of 3 takes 28 × (0.01 + 0.09) = 2.8 s >
    # 2.5 s, a batch of 2 1.96 s: "a" batches with one more image only.
    assert [b.ids for b in batches] == [("c",), ("a", "b"), ("d",)]
    assert [b.meets for b in batches] == [True, True, True]


def test_policies_make_different_decisions():
    # One GPU, one running video with slack, an urgent image: only preempting policies serve it.
    inp = RoundInput(
        0.0, 1, 2.0, (_image("img", deadline=2.0),), (_video("v", deadline=90.0, work_s=30.0, degree=1),)
    )
    served = {name: bool(p.plan(inp).batches) for name, p in ROUND_SOLVERS.items()}
    assert served == {
        "genserve": True,
        "genserve-no-preempt": False,
        "genserve-no-dp": True,
        "genserve-no-sp": True,
        "fcfs-preempt": True,
        "fcfs": False,
        "edf": False,
    }
    # Four idle GPUs and one waiting video: SP policies use them all, the others one.
    idle = RoundInput(0.0, 4, 2.0, (), (_video("v", deadline=90.0, work_s=30.0),))
    assert {n: p.plan(idle).degrees["v"] for n, p in ROUND_SOLVERS.items()} == {
        "genserve": 4,
        "genserve-no-preempt": 4,
        "genserve-no-dp": 4,
        "genserve-no-sp": 1,
        "fcfs-preempt": 1,
        "fcfs": 1,
        "edf": 1,
    }


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="genserve-no-sp"):
        round_solver("sjf")
