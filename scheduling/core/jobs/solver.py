"""GenServe's round solver (Alg. 1) and the baselines it is compared with.

Every round (every Δ denoising steps, and whenever a job arrives, finishes or GPUs change) the
caller describes the jobs waiting or running on the ``gpus`` GPUs the streams leave (GPUs busy with
an image batch are not counted: a batch runs to its end) and a policy returns a :class:`RoundPlan`:
the SP degree of every video (0 = paused or still waiting) and the image batches to start.

GenServe (slides §4.4, Alg. 1), three stages:

1. *Candidates.* Images in EDF order form batches of one resolution (same model and remaining
   steps), a batch growing while it still meets its earliest member's deadline (Eq. 6); the image
   candidate for ``g`` GPUs is the first ``g`` batches. Each video gets one option per SP degree
   ``p`` (cost ``p`` GPUs, projected laxity ℓ = D − now − remaining(p), where remaining(p) = remaining
   steps × step time at ``p`` + decode) and a *pause* option (cost 0, ℓ = D − (now + round) −
   remaining(1): would it still make its deadline if resumed next round on one GPU?) (Eq. 7).
2. *Grouped knapsack* over the videos by dynamic programming on the GPU count, one option per video.
3. Each terminal GPU count ``b`` is combined with the image candidate on ``N − b`` GPUs; the best
   total wins and is backtracked.

The score is lexicographic, summed over requests: (requests expected to meet their SLO — the
slides' objective Σ z_r —, images served, video progress = Σ SP speedups, slack of the paused
videos). So GPUs go first to whatever keeps more requests within their SLO; then to late images
(never starved); then to videos' speed (SP upgrade when GPUs idle, downgrade when images need
them); and among equal plans the video paused is the one with the most slack (§4.2). A paused
video resumes when pausing it another round would cost its deadline (its pause option stops
counting as meeting) or when GPUs are free (its run option adds speed).

Baselines and ablations share the candidates: ``fcfs``/``edf`` start one job per GPU in arrival /
deadline order (SP 1, no batching, no preemption); the greedy (``dp=False``) variants walk the
queue in order, pause the running video with the most slack for an image that can still meet its
deadline (``preempt``), and give videos the smallest SP degree that meets their deadline,
upgrading with GPUs left over (``sp``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Score = tuple[float, float, float, float]
_ZERO: Score = (0.0, 0.0, 0.0, 0.0)
_NEG: Score = (-1e18, 0.0, 0.0, 0.0)


def _add(a: Score, b: Score) -> Score:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


@dataclass(frozen=True)
class ImageRequest:
    id: str
    group: tuple  # batching key: (model, width, height, remaining steps)
    deadline: float
    arrival: float
    # Time to finish in a batch of b images = batch_s[b - 1] (all remaining steps); len = max batch.
    batch_s: tuple[float, ...]


@dataclass(frozen=True)
class VideoRequest:
    id: str
    deadline: float
    arrival: float
    degree: int  # current SP degree; 0 = not running (waiting or paused)
    # Time to finish (remaining steps at degree p, plus the decode) by each offered degree p.
    remaining_s: Mapping[int, float]


@dataclass(frozen=True)
class RoundInput:
    now: float
    gpus: int  # GPUs jobs may use this round (those running videos included)
    round_s: float  # how long until the next round (Δ steps)
    images: tuple[ImageRequest, ...] = ()
    videos: tuple[VideoRequest, ...] = ()


@dataclass(frozen=True)
class ImageBatch:
    ids: tuple[str, ...]
    duration_s: float
    meets: bool


@dataclass(frozen=True)
class RoundPlan:
    degrees: Mapping[str, int]  # every video of the input; 0 = paused / waiting
    batches: tuple[ImageBatch, ...]
    score: Score

    def gpus_used(self) -> int:
        return sum(self.degrees.values()) + len(self.batches)


def edf_batches(images: Sequence[ImageRequest], now: float, max_batch: int) -> list[ImageBatch]:
    """Images in deadline order, batched by group while the batch meets its earliest member's
    deadline. An image already late alone batches only with other late images (nothing to protect)."""
    order = sorted(images, key=lambda i: (i.deadline, i.arrival, i.id))
    used: set[str] = set()
    batches: list[ImageBatch] = []
    for index, first in enumerate(order):
        if first.id in used:
            continue
        used.add(first.id)
        members = [first]
        late = now + first.batch_s[0] > first.deadline
        for other in order[index + 1 :]:
            if len(members) >= min(max_batch, len(first.batch_s)):
                break
            if other.id in used or other.group != first.group:
                continue
            if late:
                if now + other.batch_s[0] <= other.deadline:
                    continue
            elif now + first.batch_s[len(members)] > first.deadline:
                break
            members.append(other)
            used.add(other.id)
        duration = first.batch_s[len(members) - 1]
        batches.append(ImageBatch(tuple(m.id for m in members), duration, now + duration <= first.deadline))
    return batches


def _image_scores(batches: Sequence[ImageBatch], gpus: int) -> list[Score]:
    """Score of the image candidate on g = 0..gpus GPUs: the first g EDF batches."""
    scores = [_ZERO]
    for g in range(1, gpus + 1):
        prev = scores[-1]
        if g <= len(batches):
            b = batches[g - 1]
            prev = (prev[0] + (len(b.ids) if b.meets else 0), prev[1] + len(b.ids), 0.0, 0.0)
        scores.append(prev)
    return scores


@dataclass(frozen=True)
class RoundSolver:
    """One round solver: GenServe's (Alg. 1) or a baseline/ablation of it, by name in ``ROUND_SOLVERS``
    (the simulator's ``--job-policy``). Not the live dispatcher's ``JobPolicy``
    (``scheduling.core.jobs.policy``): its ``genserve`` policy calls this solver every round."""

    name: str
    dp: bool = True
    preempt: bool = True
    sp: bool = True
    batching: bool = True
    order: str = "edf"  # the greedy variants' queue order: "fcfs" (arrival) or "edf" (deadline)
    max_batch: int = 8

    def describe(self) -> dict[str, object]:
        return {
            k: getattr(self, k) for k in ("name", "dp", "preempt", "sp", "batching", "order", "max_batch")
        }

    # -- candidates ------------------------------------------------------------------------------
    def _degrees(self, video: VideoRequest, gpus: int) -> list[int]:
        return sorted(d for d in video.remaining_s if d <= gpus and (self.sp or d == 1))

    def _pause_slack(self, video: VideoRequest, inp: RoundInput) -> float:
        # Judged on one GPU, whatever degree it runs at now: a paused video resumes where GPUs are
        # free, and one GPU is all it can count on. (Judging a running video at its current degree
        # and a waiting one at 1 made paused SP videos look safe, then need a rescue at high SP.)
        return video.deadline - inp.now - inp.round_s - video.remaining_s[1]

    def video_options(self, video: VideoRequest, inp: RoundInput) -> list[tuple[int, Score]]:
        """(GPU cost = SP degree, score) per option; cost 0 = paused / waiting."""
        options: list[tuple[int, Score]] = []
        if video.degree == 0 or self.preempt:
            slack = self._pause_slack(video, inp)
            options.append((0, (1.0 if slack >= 0 else 0.0, 0.0, 0.0, slack)))
        speed1 = video.remaining_s[1]
        for d in self._degrees(video, inp.gpus):
            if video.degree and not self.preempt and d < video.degree:
                continue  # without preemption a running video is never paused nor downgraded
            laxity = video.deadline - inp.now - video.remaining_s[d]
            options.append((d, (1.0 if laxity >= 0 else 0.0, 0.0, speed1 / video.remaining_s[d], 0.0)))
        if not options:  # a running video whose degree is no longer offered keeps running at 1
            options.append((1, (0.0, 0.0, 1.0, 0.0)))
        return options

    # -- solving ---------------------------------------------------------------------------------
    def plan(self, inp: RoundInput) -> RoundPlan:
        if self.dp:
            return self._solve_dp(inp)
        return self._solve_greedy(inp)

    def _batches(self, inp: RoundInput) -> list[ImageBatch]:
        return edf_batches(inp.images, inp.now, self.max_batch if self.batching else 1)

    def _solve_dp(self, inp: RoundInput) -> RoundPlan:
        n = inp.gpus
        dp: list[Score] = [_ZERO] + [_NEG] * n  # dp[b]: best score using exactly b GPUs
        choices: list[list[int]] = []
        for video in inp.videos:
            options = self.video_options(video, inp)
            nxt: list[Score] = [_NEG] * (n + 1)
            pick = [-1] * (n + 1)
            for b in range(n + 1):
                for cost, score in options:
                    if cost > b or dp[b - cost] is _NEG:
                        continue
                    total = _add(dp[b - cost], score)
                    if total > nxt[b]:
                        nxt[b], pick[b] = total, cost
            dp = nxt
            choices.append(pick)
        batches = self._batches(inp)
        images = _image_scores(batches, n)
        best_b, best = -1, _NEG
        for b in range(n + 1):
            if dp[b] is _NEG:
                continue
            total = _add(dp[b], images[n - b])
            if total > best:
                best_b, best = b, total
        degrees: dict[str, int] = {}
        b = best_b
        for video, pick in zip(reversed(inp.videos), reversed(choices), strict=True):
            degrees[video.id] = pick[b]
            b -= pick[b]
        return RoundPlan(degrees, tuple(batches[: min(n - best_b, len(batches))]), best)

    def _solve_greedy(self, inp: RoundInput) -> RoundPlan:
        degrees = {v.id: v.degree for v in inp.videos}
        free = inp.gpus - sum(degrees.values())
        running = [v for v in inp.videos if v.degree]
        batches = self._batches(inp)
        arrival = {i.id: i.arrival for i in inp.images}
        deadline = {i.id: i.deadline for i in inp.images}

        def key(kind: int, first: str | VideoRequest) -> tuple:
            if isinstance(first, VideoRequest):
                return (first.arrival if self.order == "fcfs" else first.deadline, kind, first.id)
            return (arrival[first] if self.order == "fcfs" else deadline[first], kind, first)

        queue = [(key(0, b.ids[0]), b) for b in batches]
        queue += [(key(1, v), v) for v in inp.videos if not v.degree]
        chosen: list[ImageBatch] = []
        score = _ZERO
        for _, item in sorted(queue, key=lambda q: q[0]):
            if isinstance(item, ImageBatch):
                if free == 0 and self.preempt and item.meets:
                    victims = [v for v in running if degrees[v.id] and self._pause_slack(v, inp) >= 0]
                    if victims:
                        victim = max(victims, key=lambda v: (self._pause_slack(v, inp), v.id))
                        free += degrees[victim.id]
                        degrees[victim.id] = 0
                if free > 0:
                    chosen.append(item)
                    free -= 1
                    score = _add(score, (len(item.ids) if item.meets else 0, len(item.ids), 0.0, 0.0))
                continue
            offered = self._degrees(item, free)
            if not offered:
                continue
            meeting = [d for d in offered if item.deadline - inp.now - item.remaining_s[d] >= 0]
            degree = meeting[0] if meeting else offered[0]
            degrees[item.id] = degree
            free -= degree
        if self.sp and free:
            for v in sorted(inp.videos, key=lambda v: (v.deadline, v.id)):
                if degrees[v.id]:
                    up = [d for d in self._degrees(v, degrees[v.id] + free) if d > degrees[v.id]]
                    if up:
                        free -= up[-1] - degrees[v.id]
                        degrees[v.id] = up[-1]
        for v in inp.videos:
            if degrees[v.id]:
                laxity = v.deadline - inp.now - v.remaining_s[degrees[v.id]]
                score = _add(
                    score,
                    (1.0 if laxity >= 0 else 0.0, 0.0, v.remaining_s[1] / v.remaining_s[degrees[v.id]], 0.0),
                )
            else:
                slack = self._pause_slack(v, inp)
                score = _add(score, (1.0 if slack >= 0 else 0.0, 0.0, 0.0, slack))
        return RoundPlan(degrees, tuple(chosen), score)


ROUND_SOLVERS: dict[str, RoundSolver] = {
    p.name: p
    for p in (
        RoundSolver("genserve"),
        RoundSolver("genserve-no-preempt", preempt=False),
        RoundSolver("genserve-no-dp", dp=False),
        RoundSolver("genserve-no-sp", sp=False),
        # The second rung of the paper's ablation ladder (Fig. 14): FCFS plus preemption only.
        RoundSolver("fcfs-preempt", dp=False, sp=False, batching=False, order="fcfs"),
        RoundSolver("fcfs", dp=False, preempt=False, sp=False, batching=False, order="fcfs"),
        RoundSolver("edf", dp=False, preempt=False, sp=False, batching=False, order="edf"),
    )
}


def round_solver(name: str) -> RoundSolver:
    try:
        return ROUND_SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown job policy {name!r} (known: {', '.join(ROUND_SOLVERS)})") from None
