"""Job cost profiles: the time of one denoising step per (model, resolution, frames, batch, SP degree).

A profile is a list of *measured points* ``(width, height, frames, batch, sp, step_ms)`` for one model
on one GPU type. The JSON shape (docs/traces.md, "Job costs")::

    {"model": "sd3.5-medium", "kind": "image", "gpu_type": "rtx-pro-6000",
     "token_patch": 16, "temporal_stride": 4, "default_steps": 28, "decode_fraction": 0.0,
     "points": [{"width": 768, "height": 768, "frames": 1, "batch": 1, "sp": 1, "step_ms": 30.8}, ...],
     "source": "..."}

Only ``model``, ``kind`` and ``points`` (each ``width, height, frames, batch`` and ``step_ms`` or
``step_s``, ``sp`` defaulting to 1) are required, so what ``profile_model --one-shot`` writes
(``{"model", "kind", "points": [{..., "step_s"}], "machine"}``) loads as it is.

Costing rule (docs/traces.md, "Job costs"): a job is costed from the measured *shape*
``(width, height, frames)`` nearest to it in log token count (ties: the larger shape, so an
unmeasured job is never costed from a cheaper one), scaled linearly by ``tokens / tokens_point``.
At that shape, the batch curve is piecewise linear over the measured batch sizes at SP 1
(extrapolated with the last segment's slope; with only batch 1 measured a batch of b costs b steps,
no batching gain assumed), and the SP speedup is ``step(b=1, sp=1) / step(b=1, sp=p)`` for the
measured degrees only — an unmeasured degree is not offered to the solver.

Tokens = ⌈W/patch⌉ · ⌈H/patch⌉ · ((F − 1) // temporal_stride + 1): SD3.5 has a 16-pixel token
(8× VAE, 2×2 patch), Wan2.2-5B a 32-pixel one and 4× temporal compression. These reproduce the
sequence lengths of the GenServe slides' Table 3 exactly (256/900/2304 and 1344/4725/12096 for
256², 480², 768² and 81 frames).

The built-in profiles (``BUILTIN_JOB_PROFILES``) are *derived*, not measured here: the slides give
one step time (Wan2.2-5B 720p/81 f, SP 1: 781.57 ms, Table 7), FLOPs per step for every shape
(Table 3), SP ×7.0 at 720p/SP 8 (Fig. 5) and a 20 % communication share at 256p (Fig. 6). No SD3.5
step time is given; see :func:`_derived_step_ms` for the model and its one assumed constant.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB_KINDS = ("image", "video")


class JobProfileError(ValueError):
    pass


@dataclass(frozen=True)
class MeasuredPoint:
    width: int
    height: int
    frames: int
    batch: int
    sp: int
    step_ms: float


@dataclass(frozen=True)
class JobProfile:
    model: str
    kind: str
    gpu_type: str
    token_patch: int
    temporal_stride: int
    default_steps: int
    points: tuple[MeasuredPoint, ...]
    # VAE decode after the last step, as a fraction of the SP-1 DiT time (it never runs under SP).
    decode_fraction: float = 0.0
    source: str = ""
    # Transformer blocks one step runs through: where a step can be abandoned for streams (the
    # co-simulation frees a claimed GPU within step_time / blocks). 1 (the default when a profile
    # does not say) = only at the step's end.
    blocks: int = 1

    def __post_init__(self) -> None:
        if self.kind not in JOB_KINDS:
            raise JobProfileError(f"{self.model}: kind must be one of {JOB_KINDS}, got {self.kind!r}")
        if self.token_patch < 1 or self.temporal_stride < 1 or self.default_steps < 1:
            raise JobProfileError(f"{self.model}: token_patch, temporal_stride, default_steps must be >= 1")
        if not self.points:
            raise JobProfileError(f"{self.model}: no measured points")
        shapes: dict[tuple[int, int, int], dict[tuple[int, int], float]] = {}
        for p in self.points:
            if min(p.width, p.height, p.frames, p.batch, p.sp) < 1 or not (
                p.step_ms > 0 and math.isfinite(p.step_ms)
            ):
                raise JobProfileError(f"{self.model}: bad measured point {p}")
            table = shapes.setdefault((p.width, p.height, p.frames), {})
            if (p.batch, p.sp) in table:
                raise JobProfileError(f"{self.model}: duplicate point {p}")
            table[(p.batch, p.sp)] = p.step_ms
        for shape, table in shapes.items():
            if (1, 1) not in table:
                raise JobProfileError(f"{self.model}: shape {shape} has no batch-1, SP-1 point")
        if self.blocks < 1:
            raise JobProfileError(f"{self.model}: blocks must be >= 1")
        if not 0 <= self.decode_fraction < 1:
            raise JobProfileError(f"{self.model}: decode_fraction must be in [0, 1)")
        object.__setattr__(self, "_shapes", shapes)

    # -- costing -----------------------------------------------------------------------------------
    def tokens(self, width: int, height: int, frames: int = 1) -> int:
        per_frame = math.ceil(width / self.token_patch) * math.ceil(height / self.token_patch)
        return per_frame * ((frames - 1) // self.temporal_stride + 1)

    def nearest_shape(self, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        """The measured shape nearest in log token count (ties: the larger one)."""
        target = math.log(self.tokens(width, height, frames))
        shapes: dict = self._shapes  # type: ignore[attr-defined]
        return min(
            shapes,
            key=lambda s: (abs(math.log(self.tokens(*s)) - target), -self.tokens(*s), s),
        )

    def _scale(self, width: int, height: int, frames: int) -> tuple[dict[tuple[int, int], float], float]:
        shape = self.nearest_shape(width, height, frames)
        return self._shapes[shape], self.tokens(width, height, frames) / self.tokens(*shape)  # type: ignore[attr-defined]

    def degrees(self, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """SP degrees measured at the job's nearest shape (always includes 1)."""
        table, _ = self._scale(width, height, frames)
        return tuple(sorted({sp for b, sp in table if b == 1}))

    def step_ms(self, width: int, height: int, frames: int = 1, batch: int = 1, sp: int = 1) -> float:
        """One denoising step of a batch of ``batch`` such jobs on ``sp`` GPUs (the costing rule above)."""
        table, scale = self._scale(width, height, frames)
        if (1, sp) not in table:
            raise JobProfileError(f"{self.model}: SP degree {sp} not measured near {width}x{height}x{frames}")
        batches = sorted(b for b, s in table if s == 1)
        curve = [table[(b, 1)] for b in batches]
        if len(batches) == 1:
            base = batch * curve[0]
        else:
            i = min(max(bisect.bisect_left(batches, batch), 1), len(batches) - 1)
            (b0, y0), (b1, y1) = (batches[i - 1], curve[i - 1]), (batches[i], curve[i])
            base = y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
        speedup = table[(1, 1)] / table[(1, sp)]
        return base / speedup * scale

    def speedup(self, width: int, height: int, frames: int, sp: int) -> float:
        return self.step_ms(width, height, frames) / self.step_ms(width, height, frames, sp=sp)

    def decode_ms(self, width: int, height: int, frames: int, steps: int) -> float:
        return self.decode_fraction * steps * self.step_ms(width, height, frames)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "kind": self.kind,
            "gpu_type": self.gpu_type,
            "token_patch": self.token_patch,
            "temporal_stride": self.temporal_stride,
            "default_steps": self.default_steps,
            "decode_fraction": self.decode_fraction,
            "blocks": self.blocks,
            "points": [p.__dict__ for p in self.points],
            "source": self.source,
        }


_PROFILE_FIELDS = {"model", "kind", "points"}
# Optional, with their defaults: what ``profile_model --one-shot`` does not write. A token is then a
# pixel of a frame (tokens ∝ W·H·F), and the default step count is the built-in model's of the kind.
_PROFILE_OPTIONAL = {
    "gpu_type",
    "token_patch",
    "temporal_stride",
    "default_steps",
    "decode_fraction",
    "blocks",
    "source",
    "machine",
}
_POINT_FIELDS = {"width", "height", "frames", "batch"}
_POINT_OPTIONAL = {"sp"}  # default 1
_POINT_TIMES = {"step_ms": 1.0, "step_s": 1000.0}  # exactly one of them, in ms or s


def _point_from_json(raw: Any, index: int) -> MeasuredPoint:
    if not isinstance(raw, Mapping):
        raise JobProfileError(f"points[{index}] must be an object")
    times = [k for k in _POINT_TIMES if k in raw]
    missing = sorted(_POINT_FIELDS - raw.keys())
    unknown = sorted(raw.keys() - _POINT_FIELDS - _POINT_OPTIONAL - _POINT_TIMES.keys())
    if missing or unknown or len(times) != 1:
        raise JobProfileError(
            f"points[{index}] needs {sorted(_POINT_FIELDS)}, optionally 'sp', and one of 'step_ms'/'step_s'"
        )
    try:
        return MeasuredPoint(
            **{k: int(raw[k]) for k in _POINT_FIELDS},
            sp=int(raw.get("sp", 1)),
            step_ms=float(raw[times[0]]) * _POINT_TIMES[times[0]],
        )
    except (TypeError, ValueError) as exc:
        raise JobProfileError(f"points[{index}]: {exc}") from None


def job_profile_from_json(data: Mapping[str, Any]) -> JobProfile:
    """Build a profile from the documented JSON object; ``profile_model --one-shot`` output loads as is."""
    if not isinstance(data, Mapping):
        raise JobProfileError("a job profile must be a JSON object")
    missing = sorted(_PROFILE_FIELDS - data.keys())
    if missing:
        raise JobProfileError(f"job profile is missing {', '.join(missing)}")
    unknown = sorted(data.keys() - _PROFILE_FIELDS - _PROFILE_OPTIONAL)
    if unknown:
        raise JobProfileError(f"job profile has unknown field(s) {', '.join(unknown)}")
    if not isinstance(data["points"], list):
        raise JobProfileError("points must be a list of objects")
    points = tuple(_point_from_json(raw, i) for i, raw in enumerate(data["points"]))
    kind = str(data["kind"])
    default_steps = data.get("default_steps")
    if default_steps is None and kind in DEFAULT_MODELS:
        default_steps = BUILTIN_JOB_PROFILES[DEFAULT_MODELS[kind]].default_steps
    try:
        return JobProfile(
            model=str(data["model"]),
            kind=kind,
            gpu_type=str(data.get("gpu_type", data.get("machine", ""))),
            token_patch=int(data.get("token_patch", 1)),
            temporal_stride=int(data.get("temporal_stride", 1)),
            default_steps=int(default_steps or 1),
            points=points,
            decode_fraction=float(data.get("decode_fraction", 0.0)),
            source=str(data.get("source", data.get("machine", ""))),
            blocks=int(data.get("blocks", 1)),
        )
    except (TypeError, ValueError) as exc:
        raise JobProfileError(str(exc)) from None


# -- the built-in profiles, derived from the GenServe slides ----------------------------------------

# Table 7: Wan2.2-5B, 720p (768²), 81 frames, SP 1 on RTX PRO 6000 — the one step time given.
_WAN_720P_STEP_MS = 781.57
# ASSUMED (the slides give none): per-step time that does not scale with FLOPs or SP (kernel
# launches, norms, the scheduler update). It is what makes small images compute-underutilised, as
# the slides' Fig. 3 reports (batching saves time at low resolution), and SP flatten at 256p (Fig. 5).
_FIXED_STEP_MS = 10.0
# Table 3: FLOPs per step (T) by shape.
_SD35_TFLOPS = {256: 0.36, 480: 1.34, 768: 3.91}
_WAN_TFLOPS = {256: 10.81, 480: 43.90, 768: 145.26}
# Achieved rate implied by the one measured step (TFLOP/s), used for every other shape.
_RATE_TFLOPS = _WAN_TFLOPS[768] / ((_WAN_720P_STEP_MS - _FIXED_STEP_MS) / 1000.0)
# Communication share of a step at SP 8: 20 % at 256p (Fig. 6); at 720p the share that gives the
# ×7.0 of Fig. 5 under the model below; 480p (not given) interpolated in log tokens.
_SP_DEGREES = (1, 2, 4, 8)
_IMAGE_BATCHES = (1, 2, 4, 8)


def _derived_step_ms(tflops: float, batch: int = 1, sp: int = 1, comm8: float = 0.0) -> float:
    """step = (fixed + batch · FLOPs / rate / sp) / (1 − comm(sp)), comm(sp) = comm8 · log2(sp) / 3."""
    compute_ms = batch * tflops / _RATE_TFLOPS * 1000.0
    comm = comm8 * math.log2(sp) / 3.0
    return (_FIXED_STEP_MS + compute_ms / sp) / (1.0 - comm)


def _comm8_for_speedup(tflops: float, speedup8: float) -> float:
    return 1.0 - speedup8 * (_FIXED_STEP_MS + tflops / _RATE_TFLOPS * 1000.0 / 8) / _derived_step_ms(tflops)


def _wan_comm8() -> dict[int, float]:
    lo, hi = 0.20, _comm8_for_speedup(_WAN_TFLOPS[768], 7.0)
    t = {side: math.log(tokens) for side, tokens in ((256, 1344), (480, 4725), (768, 12096))}
    frac = (t[480] - t[256]) / (t[768] - t[256])
    return {256: lo, 480: lo + (hi - lo) * frac, 768: hi}


def _round(x: float) -> float:
    return round(x, 3)


def _sd35() -> JobProfile:
    points = tuple(
        MeasuredPoint(side, side, 1, b, 1, _round(_derived_step_ms(tf, batch=b)))
        for side, tf in _SD35_TFLOPS.items()
        for b in _IMAGE_BATCHES
    )
    return JobProfile(
        model="sd3.5-medium",
        kind="image",
        gpu_type="rtx-pro-6000",
        token_patch=16,
        temporal_stride=1,
        default_steps=28,
        points=points,
        blocks=24,  # SD3.5-Medium: 24 MMDiT blocks (model card)
        source=(
            "derived: GenServe slides Table 3 FLOPs/step at the rate implied by Table 7's Wan2.2 step "
            f"({_RATE_TFLOPS:.1f} TFLOP/s) plus an assumed {_FIXED_STEP_MS:g} ms fixed per step; "
            "no SD3.5 step time is given in the slides"
        ),
    )


def _wan22() -> JobProfile:
    comm8 = _wan_comm8()
    points = tuple(
        MeasuredPoint(side, side, 81, 1, sp, _round(_derived_step_ms(tf, sp=sp, comm8=comm8[side])))
        for side, tf in _WAN_TFLOPS.items()
        for sp in _SP_DEGREES
    )
    return JobProfile(
        model="wan2.2-5b",
        kind="video",
        gpu_type="rtx-pro-6000",
        token_patch=32,
        temporal_stride=4,
        default_steps=50,
        points=points,
        # Slides: DiT is 95 % of a T2V request, the VAE decode the rest, on one GPU.
        decode_fraction=0.05 / 0.95,
        blocks=30,  # Wan2.2-TI2V-5B: 30 DiT blocks (its config.json, num_layers)
        source=(
            "derived: 768²/81 f SP 1 = 781.57 ms (slides Table 7); other shapes by Table 3 FLOPs at the "
            "same rate plus an assumed fixed 10 ms; SP: ×7.0 at 768²/SP 8 (Fig. 5), 20 % communication "
            "at 256²/SP 8 (Fig. 6), 480² interpolated; decode 5 % of the request (DiT 95 %)"
        ),
    )


BUILTIN_JOB_PROFILES: dict[str, JobProfile] = {p.model: p for p in (_sd35(), _wan22())}
DEFAULT_MODELS = {"image": "sd3.5-medium", "video": "wan2.2-5b"}


@dataclass(frozen=True)
class JobCatalog:
    """The profiles a simulation costs jobs with, and the default model per kind."""

    profiles: Mapping[str, JobProfile]
    defaults: Mapping[str, str]

    def profile(self, kind: str, model: str | None) -> JobProfile:
        name = model if model is not None else self.defaults.get(kind)
        if name is None or name not in self.profiles:
            raise JobProfileError(
                f"no job profile for model {name!r} (known: {', '.join(sorted(self.profiles))})"
            )
        profile = self.profiles[name]
        if profile.kind != kind:
            raise JobProfileError(f"model {name!r} is a {profile.kind} model, not {kind}")
        return profile


def load_job_profile(name_or_path: str) -> JobProfile:
    if name_or_path in BUILTIN_JOB_PROFILES:
        return BUILTIN_JOB_PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise JobProfileError(
            f"unknown job profile {name_or_path!r} (built-in: {', '.join(sorted(BUILTIN_JOB_PROFILES))})"
        )
    try:
        return job_profile_from_json(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise JobProfileError(f"{path}: not valid JSON ({exc})") from None


def load_job_catalog(specs: Iterable[str] = ()) -> JobCatalog:
    """The built-in profiles plus the given names/paths; a loaded profile becomes its kind's default."""
    profiles = dict(BUILTIN_JOB_PROFILES)
    defaults = dict(DEFAULT_MODELS)
    for spec in specs:
        profile = load_job_profile(spec)
        profiles[profile.model] = profile
        defaults[profile.kind] = profile.model
    return JobCatalog(profiles, defaults)
