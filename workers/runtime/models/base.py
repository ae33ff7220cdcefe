"""The contract every streaming video model implements.

A streaming model generates a video chunk by chunk for many sessions at once. Everything a session
needs to continue its stream lives in its *state region* (TurboServe §6.1): named tensors plus
JSON-able metadata, kept apart from the shared weights, so the engine can offload a session to host
memory or hand it to another worker by moving only that region.

The manifest of a state region (what the migration transport sends ahead of the tensors):

    {"model": <preset name>, "version": <int>,
     "tensors": [{"name": str, "shape": [int, ...], "dtype": "float32", "checksum": int?}, ...],
     "meta": {...JSON-able scalars: seed, chunk counters, prompt schedule, options...}}

Tensors are listed in manifest order; a restore that does not match the model raises
`StateManifestError` before anything is installed.

One-shot jobs (an image, or a video of F frames, after n denoising steps: issue 14) use the same
regions. A job's region holds its latents and prompt embeddings; its meta holds ``"job": true``,
the job's kind, size, seed, step counter and step count (`job_meta`). Its noise is counter-based
(`job_noise`: a CPU generator seeded by splitmix64(seed, step)), so no RNG state needs to travel:
a job paused, offloaded or migrated at any step boundary continues bit-identically.
"""

from __future__ import annotations

import abc
import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

STATE_FORMAT_VERSION = 1
JOB_KINDS = ("image", "video")
MAX_JOB_STEPS = 200


class StateManifestError(ValueError):
    """A state region does not fit the model it is being installed into."""


class JobSpecError(ValueError):
    """A one-shot job's parameters do not fit the model; `field` names the offending parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OneShotUnsupported(NotImplementedError):
    """The model has no one-shot (image/video job) mode."""


class JobStepAbandoned(Exception):
    """A job step stopped at a block boundary because streams claimed the device (`abandon_on`).

    Nothing of the step was written: every job's region is as it was at the step boundary before,
    so running the step again later gives the bytes an uninterrupted run gives.
    """


def splitmix64(*values: int) -> int:
    """Counter-based seed mixing: a stable 63-bit seed from integers (no Python hash salt)."""
    mask = (1 << 64) - 1
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state + (value & mask) + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        state = z ^ (z >> 31)
    return state & ((1 << 63) - 1)


JOB_NOISE_STREAM = 0x10B5  # keeps a job's noise apart from any session's chunk noise of the same seed


def job_noise(seed: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The noise a job draws at `step` (its initial latents at 0): a function of (seed, step) only,
    drawn on the CPU so it is the same on every device, batch and worker."""
    generator = torch.Generator(device="cpu").manual_seed(splitmix64(int(seed), JOB_NOISE_STREAM, step))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def few_step_sample(
    denoise: Callable[[torch.Tensor, float], torch.Tensor], sigmas: Sequence[float], noise: torch.Tensor
) -> torch.Tensor:
    """The few-step flow-matching sampler of the causal video models: at each sigma predict the
    velocity (``denoise(x, sigma)``), take the clean estimate x0 = x − σ·v and re-noise it to the next
    sigma with that step's draw (``noise[step]``); the last step returns x0."""
    x = noise[0]
    for step, sigma in enumerate(sigmas):
        x = few_step_update(x, sigma * denoise(x, sigma), sigmas, step, lambda i=step + 1: noise[i])
    return x


def few_step_update(
    x: torch.Tensor,
    scaled_velocity: torch.Tensor,
    sigmas: Sequence[float],
    step: int,
    next_noise: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """One step of `few_step_sample` (a job that pauses between its steps runs them one by one):
    from the sampler's state `x` at ``sigmas[step]`` and σ·v, the state at the next level (the clean
    estimate re-noised with ``next_noise()``, the next step's draw), or the clean estimate itself
    after the last step."""
    x0 = x - scaled_velocity
    if step + 1 < len(sigmas):
        nxt = sigmas[step + 1]
        return (1.0 - nxt) * x0 + nxt * next_noise()
    return x0


def is_job_meta(meta: Mapping[str, Any]) -> bool:
    return bool(meta.get("job"))


@dataclass
class SessionState:
    """One session's state region: named device tensors plus JSON-able metadata.

    `meta` holds the scalars that drive generation (seed, next chunk index, frames written into the
    KV ring, prompt schedule); the tensors hold the arrays (KV cache, prompt embeddings, latent
    history). Both travel together; nothing about a session lives anywhere else in the model.
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    # One contiguous byte buffer the named tensors are views of (TurboServe §6.1's registered
    # state memory): offload and checkpoints copy it in one piece. None when the tensors were adopted
    # from elsewhere as separate allocations (e.g. a transport's receive buffers).
    region: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        if self.region is not None:
            return self.region.numel()
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def next_chunk(self) -> int:
        return int(self.meta["next_chunk"])

    @property
    def is_job(self) -> bool:
        return is_job_meta(self.meta)


@dataclass
class GeneratedChunk:
    """Decoded RGB frames of one chunk for one session: uint8 [frames, height, width, 3]."""

    chunk_index: int
    frames: torch.Tensor


DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


REGION_ALIGNMENT = 256  # bytes; every tensor view starts aligned for any dtype and for GPU copies

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


def region_offsets(layout: Layout) -> tuple[list[int], int]:
    """Byte offset of each tensor of `layout` inside a flat region, and the region's total size."""
    offsets, cursor = [], 0
    for _, shape, dtype in layout:
        cursor = -(-cursor // REGION_ALIGNMENT) * REGION_ALIGNMENT
        offsets.append(cursor)
        cursor += math.prod(shape) * dtype.itemsize
    return offsets, cursor


def carve_region(region: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Named tensor views of a flat uint8 `region` laid out by `region_offsets(layout)`."""
    offsets, total = region_offsets(layout)
    if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() != total:
        raise StateManifestError(
            f"state region is {tuple(region.shape)}/{region.dtype}, expected ({total},)/uint8"
        )
    views = {}
    for (name, shape, dtype), offset in zip(layout, offsets, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        views[name] = region[offset : offset + nbytes].view(dtype).view(shape)
    return views


def allocate_region(
    layout: Layout, device: torch.device | str, *, pin_memory: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    _, total = region_offsets(layout)
    region = torch.empty(total, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    return region, carve_region(region, layout)


def manifest_layout(manifest: dict[str, Any]) -> Layout:
    return [(e["name"], tuple(e["shape"]), DTYPES_BY_NAME[e["dtype"]]) for e in manifest["tensors"]]


def tensor_checksum(tensor: torch.Tensor) -> int:
    """Additive checksum over the raw bytes, computed where the tensor lives (no host round-trip).

    Sums the bytes as int32 words into an int64 (plus any trailing bytes). It catches corruption and
    truncation of a transfer cheaply on a GPU; it does not detect reordered words, which a
    point-to-point copy of contiguous buffers cannot produce.
    """
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = flat.numel() // 4
    total = 0
    if words:
        total += int(flat[: words * 4].view(torch.int32).sum(dtype=torch.int64).item())
    if flat.numel() % 4:
        total += int(flat[words * 4 :].sum(dtype=torch.int64).item())
    return total


class StreamingVideoModel(abc.ABC):
    """A streaming (chunk-by-chunk) video generator serving many sessions from one replica.

    Contract:
    - `create_state` builds a fresh state region on `self.device` for (prompt, seed, options).
    - `set_prompt` schedules a prompt change taking effect at chunk `from_chunk` (and after).
    - `generate` produces the next chunk of every state in the batch in one batched call, updating
      each state in place; a state's chunk depends only on its own region (batching may change the
      result by floating-point rounding only).
    - `state_manifest`/`restore_state` expose a state as (manifest, tensors) and rebuild it,
      validating the manifest against this model.
    - `state_bytes_for` gives the size of a state region analytically, without allocating it.
    - Weights (the parameter pool, ``workers.runtime.weights``): a model whose class sets
      `transferable_weights` exposes its parameters as one flat state dict (`weights_state_dict`)
      and its `from_preset(..., weights=state_dict)` adopts exactly those tensors instead of
      loading or initialising its own, so a worker can be built from weights received from a peer.
      A model that loads from its own checkpoint directory (e.g. the Wan adapter) sets it False:
      workers then build it from that directory and it is never a pool source.
    - One-shot mode (optional; the base raises `OneShotUnsupported`): `check_job` validates a job's
      size, frames and steps (`JobSpecError` naming the field); `create_job` builds its region at
      step 0; `job_layout` is its layout from meta; `job_step` advances a batch of jobs of one
      shape (`job_shape`) by one denoising step each, in place; `job_frames` decodes a finished
      job to uint8 [F, H, W, 3]. Like `generate`, a job's result depends only on its own region.
      `sequence_parallel(devices)` (optional, `SEQUENCE_PARALLEL`): a video's step split across
      several devices inside that block, with the result of one device.
      `abandon_on(flag)`: inside that block a `job_step` calls `check_abandon` at each block
      boundary (between transformer blocks) and, once ``flag`` is set, raises `JobStepAbandoned`
      without writing anything: a job step writes its jobs' regions only at its end
      (`advance_jobs`). A model that never calls `check_abandon` runs its steps to the end.
    """

    transferable_weights: bool = True

    preset: str
    device: torch.device
    width: int
    height: int
    fps: float
    frames_per_chunk: int

    @abc.abstractmethod
    def create_state(
        self, prompt: str, seed: int, options: dict[str, Any] | None = None, *, start_chunk: int = 0
    ) -> SessionState: ...

    @abc.abstractmethod
    def generate(self, states: list[SessionState]) -> list[GeneratedChunk]: ...

    @abc.abstractmethod
    def expected_layout(self, meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every tensor of a state region with this metadata, in order."""

    @abc.abstractmethod
    def state_bytes_for(self, options: dict[str, Any] | None = None) -> int: ...

    def step_ready(self, state: SessionState) -> bool:
        """Whether `generate` can run this state now. Always, for a model that holds every stage; a
        stage worker waiting for the embeddings of the prompt due at the state's next chunk (issue
        15, ``workers.runtime.stages.serving``) says no until they arrive."""
        return True

    # -- one-shot jobs (issue 14) ---------------------------------------------------------------

    def check_job(self, *, kind: str, width: int, height: int, frames: int, steps: int) -> None:
        """Raise `JobSpecError` unless this model can run a job of that shape."""
        raise OneShotUnsupported(f"{type(self).__name__} ({self.preset}) has no one-shot mode")

    def create_job(
        self, *, kind: str, prompt: str, seed: int, width: int, height: int, frames: int, steps: int
    ) -> SessionState:
        raise OneShotUnsupported(f"{type(self).__name__} ({self.preset}) has no one-shot mode")

    def job_steps_for(self, *, kind: str, frames: int, steps: int) -> int:
        """The step count a job of ``kind`` and ``frames`` takes when about ``steps`` are wanted:
        ``steps`` itself for a model whose sampler takes any count; one whose count follows from the
        job (the Wan rollout: chunks × steps per chunk) returns that."""
        return steps

    def job_layout(self, meta: dict[str, Any]) -> Layout:
        raise OneShotUnsupported(f"{type(self).__name__} ({self.preset}) has no one-shot mode")

    def job_step(self, states: list[SessionState]) -> None:
        raise OneShotUnsupported(f"{type(self).__name__} ({self.preset}) has no one-shot mode")

    def job_frames(self, state: SessionState) -> torch.Tensor:
        raise OneShotUnsupported(f"{type(self).__name__} ({self.preset}) has no one-shot mode")

    # Elastic sequence parallelism (GenServe's SP degree of a video): how many devices a model
    # can split one video job's step across; 1 = it cannot (the default).
    SEQUENCE_PARALLEL = False

    # Set by `abandon_on` around a job step; read by `check_abandon` between blocks.
    _abandon_flag: threading.Event | None = None

    @contextlib.contextmanager
    def abandon_on(self, flag: threading.Event | None) -> Iterator[None]:
        """Inside the block, a `job_step` stops at its next block boundary once ``flag`` is set."""
        previous = self._abandon_flag
        self._abandon_flag = flag
        try:
            yield
        finally:
            self._abandon_flag = previous

    def check_abandon(self) -> None:
        """A job step's block boundary: raise `JobStepAbandoned` if the daemon's flag is set."""
        flag = self._abandon_flag
        if flag is None:
            return
        if self.device.type == "cuda":
            # Kernels run behind their launch: without waiting here, every block of the step would
            # be queued before the flag is seen, and the GPU would not be free at the boundary.
            torch.cuda.current_stream(self.device).synchronize()
        if flag.is_set():
            raise JobStepAbandoned("streams claimed the device")

    @contextlib.contextmanager
    def sequence_parallel(self, devices: Sequence[torch.device | str]) -> Iterator[None]:
        """Inside the block, a video `job_step` splits its token sequence across ``devices`` (the
        first is the model's own; a device may repeat, e.g. ``["cpu", "cpu"]``) where the model
        supports it (`SEQUENCE_PARALLEL`); the result is the same as on one device. The default
        runs every step on the model's device."""
        yield

    @staticmethod
    def job_meta(
        *, kind: str, prompt: str, seed: int, width: int, height: int, frames: int, steps: int
    ) -> dict[str, Any]:
        return {
            "job": True,
            "kind": kind,
            "prompt": prompt,
            "seed": int(seed),
            "width": int(width),
            "height": int(height),
            "frames": int(frames),
            "steps": int(steps),
            "step": 0,
        }

    @staticmethod
    def job_shape(meta: Mapping[str, Any]) -> tuple[str, int, int, int]:
        """(kind, width, height, frames): jobs of one shape can share a batched step."""
        return (str(meta["kind"]), int(meta["width"]), int(meta["height"]), int(meta["frames"]))

    @staticmethod
    def check_job_common(*, kind: str, width: int, height: int, frames: int, steps: int) -> None:
        """The checks every one-shot model shares (kinds, image = 1 frame, step count)."""
        if kind not in JOB_KINDS:
            raise JobSpecError("kind", f"must be one of {', '.join(JOB_KINDS)}, not {kind!r}")
        if kind == "image" and frames != 1:
            raise JobSpecError("frames", f"an image has 1 frame, not {frames}")
        if kind == "video" and frames < 2:
            raise JobSpecError("frames", f"a video needs at least 2 frames, not {frames}")
        if not 1 <= steps <= MAX_JOB_STEPS:
            raise JobSpecError("steps", f"must be between 1 and {MAX_JOB_STEPS}, not {steps}")
        if width < 1 or height < 1:
            raise JobSpecError("width" if width < 1 else "height", "must be positive")

    def check_job_batch(self, states: list[SessionState]) -> None:
        """A batched job step takes unfinished jobs of one shape (`job_shape`)."""
        shapes = {self.job_shape(s.meta) for s in states}
        if len(shapes) != 1:
            raise ValueError(f"a job step batches jobs of one shape, got {sorted(shapes)}")
        if any(int(s.meta["step"]) >= int(s.meta["steps"]) for s in states):
            raise ValueError("a job in the batch has already run all its steps")

    def advance_jobs(self, states: list[SessionState], clean: torch.Tensor) -> None:
        """One flow-matching step of each job from its predicted clean latents `clean` [B, ...].

        Step k runs at noise level sigma_k = 1 - k/n; the next state re-noises the prediction with
        fresh counter-based noise at sigma_{k+1} (Self-Forcing's few-step sampler); the last step
        keeps the prediction itself.
        """
        updates = []
        for i, state in enumerate(states):
            step, steps = int(state.meta["step"]) + 1, int(state.meta["steps"])
            latents = state.tensors["latents"]
            if step < steps:
                sigma = 1.0 - step / steps
                noise = job_noise(state.meta["seed"], step, tuple(latents.shape)).to(latents.device)
                updates.append((step, (1.0 - sigma) * clean[i] + sigma * noise))
            else:
                updates.append((step, clean[i]))
        # The noise is drawn: the last block boundary, before anything of the step is written.
        self.check_abandon()
        for state, (step, latents) in zip(states, updates, strict=True):
            state.tensors["latents"].copy_(latents)
            state.meta["step"] = step

    @staticmethod
    def job_sigmas(states: list[SessionState], device: torch.device) -> torch.Tensor:
        """Each job's current noise level sigma_k = 1 - k/n, as a [B] tensor."""
        return torch.tensor([1.0 - int(s.meta["step"]) / int(s.meta["steps"]) for s in states], device=device)

    def region_layout(self, meta: dict[str, Any]) -> Layout:
        """The layout of a session's or a job's region, from its meta."""
        if is_job_meta(meta):
            for key in ("kind", "seed", "width", "height", "frames", "steps", "step"):
                if key not in meta:
                    raise KeyError(f"job meta lacks {key!r}")
            if not 0 <= int(meta["step"]) <= int(meta["steps"]):
                raise ValueError("the job's step counter is out of range")
            return self.job_layout(meta)
        return self.expected_layout(meta)

    # -- shared implementation -----------------------------------------------------------------

    @staticmethod
    def session_meta(
        prompt: str,
        seed: int,
        options: dict[str, Any] | None,
        start_chunk: int,
        counters: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """The metadata of a fresh session's state region: seed, chunk counter, any model-specific
        counters (e.g. ``frames_written``), the prompt schedule and the prompt its tensors hold."""
        return {
            "seed": int(seed),
            "next_chunk": int(start_chunk),
            **(counters or {}),
            "prompt_schedule": [[int(start_chunk), prompt]],
            "active_prompt": prompt,
            "options": dict(options or {}),
        }

    def set_prompt(self, state: SessionState, prompt: str, from_chunk: int) -> None:
        """Schedule `prompt` from chunk `from_chunk` on; `generate` switches when it gets there."""
        next_chunk = state.next_chunk
        if from_chunk < next_chunk:
            raise ValueError(f"chunk {from_chunk} was already generated (next chunk is {next_chunk})")
        schedule = [entry for entry in state.meta["prompt_schedule"] if entry[0] < from_chunk]
        # Entries that can no longer take effect (superseded before the next chunk) are dropped.
        while len(schedule) > 1 and schedule[1][0] <= next_chunk:
            schedule.pop(0)
        schedule.append([int(from_chunk), prompt])
        state.meta["prompt_schedule"] = schedule

    @staticmethod
    def prompt_for_chunk(state: SessionState, chunk_index: int) -> str:
        """The prompt in force at `chunk_index` under the state's prompt schedule."""
        prompt = state.meta["prompt_schedule"][0][1]
        for start, text in state.meta["prompt_schedule"]:
            if start <= chunk_index:
                prompt = text
        return prompt

    def weights_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters as one flat state dict (the blocks the parameter pool moves)."""
        net = getattr(self, "net", None)
        if not self.transferable_weights or not isinstance(net, torch.nn.Module):
            raise NotImplementedError(f"{type(self).__name__} does not expose transferable weights")
        return net.state_dict()

    def adopt_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Use ``weights`` (every parameter, same names and shapes) as the model's own, without a copy."""
        net = getattr(self, "net", None)
        if not self.transferable_weights or not isinstance(net, torch.nn.Module):
            raise NotImplementedError(f"{type(self).__name__} does not adopt transferred weights")
        net.load_state_dict(weights, strict=True, assign=True)

    def state_bytes(self, state: SessionState) -> int:
        return state.nbytes

    def state_manifest(self, state: SessionState, *, checksums: bool = False) -> dict[str, Any]:
        entries = []
        for name, tensor in state.tensors.items():
            entry: dict[str, Any] = {
                "name": name,
                "shape": list(tensor.shape),
                "dtype": dtype_name(tensor.dtype),
            }
            if checksums:
                entry["checksum"] = tensor_checksum(tensor)
            entries.append(entry)
        return {
            "model": self.preset,
            "version": STATE_FORMAT_VERSION,
            "tensors": entries,
            "meta": json_copy(state.meta),
        }

    def validate_manifest(self, manifest: dict[str, Any]) -> None:
        """Raise `StateManifestError` unless `manifest` describes a state region of this model."""
        if not isinstance(manifest, dict):
            raise StateManifestError("state manifest must be a dict")
        for key in ("model", "version", "tensors", "meta"):
            if key not in manifest:
                raise StateManifestError(f"state manifest lacks {key!r}")
        if manifest["model"] != self.preset:
            raise StateManifestError(
                f"state manifest is for model {manifest['model']!r}, this worker runs {self.preset!r}"
            )
        if manifest["version"] != STATE_FORMAT_VERSION:
            raise StateManifestError(
                f"state format version {manifest['version']} is not supported "
                f"(expected {STATE_FORMAT_VERSION})"
            )
        try:
            expected = self.region_layout(manifest["meta"])
        except (KeyError, TypeError, ValueError, NotImplementedError) as exc:
            raise StateManifestError(f"state manifest meta is invalid: {exc}") from exc
        got = [(e.get("name"), tuple(e.get("shape", ())), e.get("dtype")) for e in manifest["tensors"]]
        want = [(name, shape, dtype_name(dtype)) for name, shape, dtype in expected]
        if got != want:
            raise StateManifestError(
                f"state manifest tensors do not match model {self.preset!r}: got {got}, expected {want}"
            )

    def restore_state(
        self,
        manifest: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        *,
        verify_checksums: bool = True,
        copy: bool = True,
    ) -> SessionState:
        """Rebuild a state region from (manifest, tensors), moving tensors to `self.device`.

        Validates the manifest, then every tensor's name, shape, dtype and (when the manifest carries
        one and `verify_checksums`) checksum; raises `StateManifestError` on any mismatch. With
        `copy=False` tensors already on the device are adopted as they are (a transport that
        allocated fresh receive buffers saves a device copy); otherwise the state never aliases the
        caller's tensors.
        """
        self.validate_manifest(manifest)
        names = [e["name"] for e in manifest["tensors"]]
        if list(tensors) != names and sorted(tensors) != sorted(names):
            raise StateManifestError(f"state tensors {sorted(tensors)} do not match manifest {names}")
        for entry in manifest["tensors"]:
            tensor = tensors[entry["name"]]
            if tuple(tensor.shape) != tuple(entry["shape"]) or dtype_name(tensor.dtype) != entry["dtype"]:
                raise StateManifestError(
                    f"state tensor {entry['name']!r} is {tuple(tensor.shape)}/{dtype_name(tensor.dtype)}, "
                    f"manifest says {tuple(entry['shape'])}/{entry['dtype']}"
                )
            if verify_checksums and "checksum" in entry:
                actual = tensor_checksum(tensor)
                if actual != entry["checksum"]:
                    raise StateManifestError(
                        f"state tensor {entry['name']!r} checksum {actual} != manifest {entry['checksum']}"
                    )
        if not copy and all(t.device == self.device for t in tensors.values()):
            restored = {e["name"]: tensors[e["name"]] for e in manifest["tensors"]}
            return SessionState(tensors=restored, meta=json_copy(manifest["meta"]))
        region, restored = allocate_region(manifest_layout(manifest), self.device)
        for name, view in restored.items():
            view.copy_(tensors[name])
        return SessionState(tensors=restored, meta=json_copy(manifest["meta"]), region=region)


def json_copy(value: Any) -> Any:
    """Deep copy of JSON-able metadata (lists/dicts/scalars), so states never share meta objects."""
    if isinstance(value, dict):
        return {str(k): json_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_copy(v) for v in value]
    return value


class StagewiseModel(StreamingVideoModel):
    """A streaming model whose `generate` is its three stages in a row (issue 15): encode, diffuse,
    decode, the very methods a stage worker calls (``workers.runtime.stages``), so a split pipeline
    and the monolithic model run one copy of each stage's code.

    - encode: `encode_prompt` (one prompt, alone); `scheduled_embeddings` encodes, for a batch, the
      prompts whose schedule changes at the session's next chunk.
    - diffuse: `diffuse(states, embeddings)` → the chunk's latents (the hand-off to decode); it
      writes ``embeddings[i]`` (when not None) into the session's state and advances its counters.
    - decode: `decode(latents, caches)` → uint8 frames ``[B, T, H, W, 3]``, updating each session's
      decoder cache (its tensors named in `DECODER_CACHE`, empty for a stateless decoder) in place.

    One-shot jobs split the same way: `create_job` is `encode_prompt` then `create_job_region`
    (diffuse, with `job_step`), and `job_frames` reads only the job's latents and meta, so a decode
    worker runs it on latents received alone (`decode_job`).
    """

    # State tensors that belong to the decoder (its per-session cache), not to diffusion.
    DECODER_CACHE: tuple[str, ...] = ()

    @abc.abstractmethod
    def encode_prompt(self, prompt: str) -> torch.Tensor: ...

    @abc.abstractmethod
    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor: ...

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor, caches: list[dict[str, torch.Tensor]]) -> torch.Tensor: ...

    def scheduled_embeddings(self, states: list[SessionState]) -> list[torch.Tensor | None]:
        """Per session, the encoding of the prompt taking effect at its next chunk, or None when
        that prompt is already the active one (which it becomes)."""
        embeddings: list[torch.Tensor | None] = []
        for state in states:
            prompt = self.prompt_for_chunk(state, state.next_chunk)
            if prompt == state.meta["active_prompt"]:
                embeddings.append(None)
            else:
                embeddings.append(self.encode_prompt(prompt))
                state.meta["active_prompt"] = prompt
        return embeddings

    def decoder_cache(self, state: SessionState) -> dict[str, torch.Tensor]:
        """The session's decoder cache: views of its state tensors named in `DECODER_CACHE`."""
        return {name: state.tensors[name] for name in self.DECODER_CACHE}

    def create_job(
        self, *, kind: str, prompt: str, seed: int, width: int, height: int, frames: int, steps: int
    ) -> SessionState:
        """A new job: the prompt encoded once (the encode stage), then its region at step 0
        (`create_job_region`). `check_job` refuses models with no one-shot mode, and bad sizes,
        before anything is encoded or allocated."""
        self.check_job(kind=kind, width=width, height=height, frames=frames, steps=steps)
        meta = self.job_meta(
            kind=kind, prompt=prompt, seed=seed, width=width, height=height, frames=frames, steps=steps
        )
        return self.create_job_region(meta, self.encode_prompt(prompt))

    def create_job_region(self, meta: dict[str, Any], embeddings: torch.Tensor) -> SessionState:
        """The diffuse stage's half of `create_job`: a checked job's region (`job_layout`) with
        counter-based noise as latents (step 0) and its prompt's encoding stored by `init_job`."""
        region, tensors = allocate_region(self.job_layout(meta), self.device)
        latents = tensors["latents"]
        latents.copy_(job_noise(int(meta["seed"]), 0, tuple(latents.shape)))
        self.init_job(tensors, int(meta["seed"]), embeddings)
        return SessionState(tensors=tensors, meta=meta, region=region)

    def decode_job(self, latents: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
        """The decode stage's half of a job: `job_frames` of a finished job from its latents and
        meta alone (a model's `job_frames` reads nothing else of the region)."""
        return self.job_frames(SessionState(tensors={"latents": latents}, meta=dict(meta)))

    def init_job(self, tensors: dict[str, torch.Tensor], seed: int, embeddings: torch.Tensor) -> None:
        """Fill a new job's tensors other than its latents from its seed and prompt encoding."""
        raise OneShotUnsupported(f"{type(self).__name__} ({self.preset}) has no one-shot mode")

    @torch.inference_mode()
    def generate(self, states: list[SessionState]) -> list[GeneratedChunk]:
        if not states:
            return []
        chunk_indices = [s.next_chunk for s in states]
        latents = self.diffuse(states, self.scheduled_embeddings(states))
        frames = self.decode(latents, [self.decoder_cache(s) for s in states])
        return [GeneratedChunk(chunk_index=c, frames=frames[i]) for i, c in enumerate(chunk_indices)]
