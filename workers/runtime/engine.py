"""The coalesced chunk engine: one model replica, many per-session state regions (TurboServe §3.1, §6.1).

Each `step()` collects up to K sessions whose next chunk is due, runs them through the model as one
batch, writes each state back in place, and hands the decoded frames to a background thread pool for
JPEG encoding, so encoding never sits on the model's critical path. Sessions can be suspended to host
memory (pinned buffers and a side CUDA stream on a GPU), resumed, exported as a state region for the
migration transport and imported on another engine, or checkpointed to safetensors bytes.

One-shot jobs (issue 14) live in the same namespace of state regions: `add_job` creates one,
`job_step` advances a batch of jobs of one shape by one denoising step, `job_frames` decodes a
finished one. `step` never runs a job and `job_step` never runs a session, so the caller (the
daemon, with ``workers.runtime.jobs`` choosing what fits) decides how the two interleave; suspend,
resume, export/import and checkpoints serve jobs and sessions alike.

The engine is driven from one thread (the worker daemon's loop); only encoding runs elsewhere.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.runtime.accel import GpuPaths, copy_stream, pin_host_buffers
from workers.runtime.encoding import JPEG_ONLY, EncodedChunk, encode_chunk, encode_jpeg_frames
from workers.runtime.media import FragmentEncoder, select_h264_encoder
from workers.runtime.models import build_model
from workers.runtime.models.base import (
    JobStepAbandoned,
    SessionState,
    StateManifestError,
    StreamingVideoModel,
    carve_region,
    json_copy,
    manifest_layout,
    region_offsets,
    tensor_checksum,
)

RESIDENT, SUSPENDED = "resident", "suspended"


class SessionNotFound(KeyError):
    """The engine holds no session with this id."""


class SessionStateError(RuntimeError):
    """The operation does not fit the session's current lifecycle state."""


@dataclass
class ChunkResult:
    """One generated chunk. `encoded` completes when the background encoder has finished it."""

    session_id: str
    chunk_index: int
    width: int
    height: int
    fps: float
    frame_count: int
    generation_ms: float
    batch_size: int
    encoded: Future[EncodedChunk]
    rgb: torch.Tensor = field(repr=False)  # uint8 [frames, height, width, 3] on the host

    def frames(self, timeout: float | None = None) -> list[bytes]:
        """The encoded frames (blocks until encoding has finished)."""
        return self.encoded.result(timeout).frames

    def encode_ms(self, timeout: float | None = None) -> float:
        return self.encoded.result(timeout).encode_ms

    def encoding(self, timeout: float | None = None) -> EncodedChunk:
        """The chunk in every codec it was encoded in (blocks until encoding has finished)."""
        return self.encoded.result(timeout)


@dataclass
class JobStepReport:
    """One batched denoising step of one-shot jobs: each job's steps done after it."""

    steps_done: dict[str, int]
    finished: list[str]
    step_ms: float
    # The step stopped at a block boundary (`abandon`): nothing was written, `steps_done` are the
    # counts before it, and `step_ms` is the work lost.
    abandoned: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.steps_done)


@dataclass
class HostStateRecord:
    """A suspended session's state region in host memory (pinned when the device is CUDA)."""

    session_id: str
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # host tensors by name: views of `region` when it is set
    nbytes: int
    copy_ms: float
    pinned: bool
    region: torch.Tensor | None = field(default=None, repr=False)  # flat uint8 host buffer (from suspend)
    # (model, manifest) when `suspend` built this record from a live state of that model: resumed
    # into the same model with that very manifest object, it needs no second validation (on small
    # job regions that check is a good part of a resume). A replaced manifest is validated again.
    validated: tuple[StreamingVideoModel, dict[str, Any]] | None = field(default=None, repr=False)


@dataclass
class TransferReport:
    session_id: str
    nbytes: int
    copy_ms: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / (self.copy_ms / 1000.0) if self.copy_ms > 0 else float("inf")


@dataclass
class _Session:
    session_id: str
    status: str
    state: SessionState | None
    frozen: bool = False
    last_served: int = -1
    order: int = 0
    last_transfer: TransferReport | None = None
    last_meta: dict[str, Any] = field(default_factory=dict)  # meta of the state when suspended
    job: bool = False  # a one-shot job's region (never due for `step`)


def encode_jpeg(rgb: torch.Tensor, quality: int = 85) -> list[bytes]:
    """JPEG-encode uint8 frames [T, H, W, 3] held in a host tensor."""
    return encode_jpeg_frames(rgb.numpy(), quality).frames


class HostBufferPool:
    """Reuses state-sized buffers across suspends and resumes.

    Pinning gigabytes of host memory costs far more than copying them, and on a CPU worker fresh
    allocations of state-sized buffers cost as much as the copy itself; freed buffers are kept (up
    to `max_bytes`) and handed out again for the same (shape, dtype).
    """

    def __init__(self, *, pin: bool, device: str | torch.device = "cpu", max_bytes: int = 16 << 30) -> None:
        self.pin = pin
        self.device = torch.device(device)
        self.max_bytes = max_bytes
        self.pooled_bytes = 0
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((shape, dtype))
        if free:
            tensor = free.pop()
            self.pooled_bytes -= tensor.numel() * tensor.element_size()
            return tensor
        return torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self.pin)

    def give(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pooled_bytes + nbytes <= self.max_bytes:
            self._free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)
            self.pooled_bytes += nbytes

    def clear(self) -> None:
        self._free.clear()
        self.pooled_bytes = 0


class ChunkEngine:
    """Coalesced chunk execution over per-session state regions.

    Public API (the worker daemon is written against it):
    - `add_session(session_id, prompt, seed, options=None, start_chunk=0)`
    - `set_prompt(session_id, prompt, from_chunk)`
    - `step(max_batch=None, due=None) -> list[ChunkResult]`
    - `suspend(session_id) -> HostStateRecord`, `resume(session_id, record) -> TransferReport`
    - `export_state(session_id) -> (manifest, tensors)` (freezes the session), `thaw(session_id)`,
      `import_state(session_id, manifest, tensors, copy=True)`
    - `state_to_bytes(session_id) -> bytes`, `state_from_bytes(session_id, data)`
    - `remove(session_id)`, `state_bytes(session_id)`, `sessions()`, `status(session_id)`,
      `next_chunk(session_id)`, `meta(session_id)`, `close()`
    - one-shot jobs: `add_job(job_id, kind=..., prompt=..., seed=..., width=..., height=...,
      frames=..., steps=...)`, `job_step(job_ids) -> JobStepReport`, `job_progress(job_id)`,
      `job_shape(job_id)`, `job_frames(job_id)`, `is_job(id)`; the offload and migration calls
      above take a job id as they take a session id.
    """

    def __init__(
        self,
        model: StreamingVideoModel,
        *,
        max_batch: int = 8,
        encode_workers: int = 2,
        encode_in_processes: bool = False,
        jpeg_quality: int = 85,
        on_chunk: Callable[[ChunkResult, EncodedChunk], None] | None = None,
        gpu_paths: GpuPaths | None = None,
    ) -> None:
        """``gpu_paths``: the offload copies' settings (side stream, pinned host buffers; default:
        the environment's, ``workers.runtime.accel``); they matter on CUDA only."""
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.model = model
        self.device = model.device
        self.max_batch = max_batch
        self.jpeg_quality = jpeg_quality
        self.on_chunk = on_chunk
        self._sessions: dict[str, _Session] = {}
        self._steps = 0
        self._served = 0
        self._added = 0
        # Threads are cheap to start; processes keep JPEG encoding's Python-level work from contending
        # with the step loop for the GIL (worth it on a loaded host; children import no torch).
        self._encoder: Executor
        if encode_in_processes:
            self._encoder = ProcessPoolExecutor(
                max_workers=encode_workers, mp_context=multiprocessing.get_context("spawn")
            )
        else:
            self._encoder = ThreadPoolExecutor(max_workers=encode_workers, thread_name_prefix="chunk-encode")
        self._cuda = self.device.type == "cuda"
        self.gpu_paths = gpu_paths if gpu_paths is not None else GpuPaths.from_env()
        # Host buffers for suspended states (pinned on CUDA unless the setting says otherwise). On a
        # CPU worker the "device" copies are host memory too, so freed state regions are pooled for
        # the next resume; on CUDA the caching allocator already does that.
        self._pool = HostBufferPool(pin=pin_host_buffers(self.device, self.gpu_paths))
        self._device_pool = None if self._cuda else HostBufferPool(pin=False, device=self.device)
        self._side_stream = copy_stream(self.device, self.gpu_paths)
        self._fragment_encoder: FragmentEncoder | None = None

    @property
    def fragment_encoder(self) -> FragmentEncoder:
        """The H.264 encoder of this worker's chunks, chosen on first use: NVENC on a CUDA worker
        when the FFmpeg build has it and it opens, else libx264 (``select_h264_encoder`` logs why)."""
        if self._fragment_encoder is None:
            self._fragment_encoder = FragmentEncoder(select_h264_encoder(gpu=self._cuda))
        return self._fragment_encoder

    @classmethod
    def from_preset(cls, preset: str, *, device: str = "cpu", **engine_kwargs: Any) -> ChunkEngine:
        return cls(build_model(preset, device=device), **engine_kwargs)

    def close(self) -> None:
        self._encoder.shutdown(wait=True)
        self._pool.clear()
        if self._device_pool is not None:
            self._device_pool.clear()

    # -- lifecycle -----------------------------------------------------------------------------

    def add_session(
        self,
        session_id: str,
        prompt: str,
        seed: int,
        options: dict[str, Any] | None = None,
        start_chunk: int = 0,
    ) -> None:
        if session_id in self._sessions:
            raise SessionStateError(f"session {session_id!r} is already on this engine")
        state = self.model.create_state(prompt, seed, options, start_chunk=start_chunk)
        self._install(session_id, state)

    def add_job(
        self,
        job_id: str,
        *,
        kind: str,
        prompt: str,
        seed: int,
        width: int,
        height: int,
        frames: int,
        steps: int,
    ) -> None:
        """A one-shot job at step 0 (raises `JobSpecError` naming the field the model refuses)."""
        if job_id in self._sessions:
            raise SessionStateError(f"job {job_id!r} is already on this engine")
        state = self.model.create_job(
            kind=kind, prompt=prompt, seed=seed, width=width, height=height, frames=frames, steps=steps
        )
        self._install(job_id, state)

    def set_prompt(self, session_id: str, prompt: str, from_chunk: int) -> None:
        session = self._get(session_id)
        if session.state is None:
            raise SessionStateError(f"session {session_id!r} is suspended; resume it first")
        self.model.set_prompt(session.state, prompt, from_chunk)

    def remove(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise SessionNotFound(session_id)
        session.state = None

    def sessions(self) -> dict[str, str]:
        """session id → "resident" | "suspended" (frozen sessions are resident)."""
        return {sid: s.status for sid, s in self._sessions.items()}

    def status(self, session_id: str) -> str:
        return self._get(session_id).status

    def is_frozen(self, session_id: str) -> bool:
        return self._get(session_id).frozen

    def next_chunk(self, session_id: str) -> int:
        session = self._get(session_id)
        if session.state is not None:
            return session.state.next_chunk
        return int(session.last_meta["next_chunk"])

    def state_bytes(self, session_id: str) -> int:
        session = self._get(session_id)
        if session.state is None and session.job:
            return region_offsets(self.model.region_layout(session.last_meta))[1]
        if session.state is None:
            return self.model.state_bytes_for(session.last_meta.get("options"))
        return self.model.state_bytes(session.state)

    def resident_bytes(self) -> int:
        return sum(s.state.nbytes for s in self._sessions.values() if s.state is not None)

    # -- coalesced execution -------------------------------------------------------------------

    def due_sessions(self, max_batch: int | None = None, due: Iterable[str] | None = None) -> list[str]:
        """The sessions the next step would run: resident, not frozen, ready (`step_ready`: a stage
        worker's session waits for its prompt's embeddings), least recently served first."""
        limit = self.max_batch if max_batch is None else max_batch
        allowed = set(due) if due is not None else None
        ready = [
            s
            for s in self._sessions.values()
            if s.status == RESIDENT
            and not s.frozen
            and not s.job
            and (allowed is None or s.session_id in allowed)
            and self.model.step_ready(s.state)  # type: ignore[arg-type]
        ]
        ready.sort(key=lambda s: (s.last_served, s.order))
        return [s.session_id for s in ready[:limit]]

    def step(
        self,
        max_batch: int | None = None,
        due: Iterable[str] | None = None,
        codecs: Mapping[str, frozenset[str]] | None = None,
    ) -> list[ChunkResult]:
        """Generate the next chunk of up to `max_batch` due sessions in one batched forward.

        `due` restricts the step to those session ids (the daemon's pacing); by default every
        resident, unfrozen session is due. `codecs` says what each session's viewers read ("jpeg",
        "h264"; JPEG for a session it does not name): each chunk is encoded once per codec, never
        per viewer. Returns at once after generation; frames are encoded in the background
        (`ChunkResult.encoded`, and `on_chunk` when set).
        """
        limit = self.max_batch if max_batch is None else max_batch
        if limit < 1:
            raise ValueError("max_batch must be at least 1")
        chosen = [self._sessions[sid] for sid in self.due_sessions(limit, due)]
        if not chosen:
            return []
        states = [s.state for s in chosen]
        started = time.perf_counter()
        chunks = self.model.generate(states)  # type: ignore[arg-type]
        # Frames come to the host here; on CUDA this waits for the batch, so generation_ms covers it.
        rgb = torch.stack([c.frames for c in chunks]).to("cpu")
        generation_ms = (time.perf_counter() - started) * 1000.0
        self._steps += 1
        results = []
        for i, (session, chunk) in enumerate(zip(chosen, chunks, strict=True)):
            # A per-session sequence number (not the step number), so that ties never favour
            # the sessions added first: round-robin when more than K are due.
            self._served += 1
            session.last_served = self._served
            results.append(
                ChunkResult(
                    session_id=session.session_id,
                    chunk_index=chunk.chunk_index,
                    width=self.model.width,
                    height=self.model.height,
                    fps=self.model.fps,
                    frame_count=int(rgb.shape[1]),
                    generation_ms=generation_ms,
                    batch_size=len(chosen),
                    encoded=Future(),
                    rgb=rgb[i],
                )
            )
        # Encoding starts last: a busy encoder thread would otherwise contend for the GIL with the
        # bookkeeping above (up to a 5 ms switch interval per hand-over).
        for result in results:
            wanted = (codecs or {}).get(result.session_id, JPEG_ONLY)
            result.encoded = self._encoder.submit(
                encode_chunk,
                result.rgb.numpy(),
                codecs=wanted,
                quality=self.jpeg_quality,
                fps=result.fps,
                chunk_index=result.chunk_index,
                fragment_encoder=self.fragment_encoder if "h264" in wanted else None,
            )
            if self.on_chunk is not None:
                callback = self.on_chunk
                result.encoded.add_done_callback(
                    lambda fut, r=result, cb=callback: (
                        cb(r, fut.result()) if fut.exception() is None else None
                    )
                )
        return results

    # -- one-shot jobs (issue 14) ---------------------------------------------------------------

    def is_job(self, job_id: str) -> bool:
        return self._get(job_id).job

    def _meta(self, session: _Session) -> dict[str, Any]:
        return session.state.meta if session.state is not None else session.last_meta

    def job_progress(self, job_id: str) -> tuple[int, int]:
        """(steps done, steps in all) of a resident or suspended job."""
        meta = self._meta(self._job(job_id))
        return int(meta["step"]), int(meta["steps"])

    def job_shape(self, job_id: str) -> tuple[str, int, int, int]:
        return self.model.job_shape(self._meta(self._job(job_id)))

    def job_step(self, job_ids: list[str], *, abandon: threading.Event | None = None) -> JobStepReport:
        """One denoising step of each job in `job_ids` (resident, unfrozen, unfinished, one shape),
        as one batched call. The step is the unit of preemption: between two calls any of them can
        be suspended, exported or removed. Once ``abandon`` is set the step stops at the model's
        next block boundary (``StreamingVideoModel.abandon_on``) with the jobs as they were before
        it; the report says so (`JobStepReport.abandoned`)."""
        states: dict[str, SessionState] = {}
        for job in (self._job(job_id) for job_id in job_ids):
            if job.state is None or job.frozen:
                raise SessionStateError(f"job {job.session_id!r} is suspended or frozen")
            states[job.session_id] = job.state
        started = time.perf_counter()
        abandoned = False
        try:
            with self.model.abandon_on(abandon):
                self.model.job_step(list(states.values()))
        except JobStepAbandoned:
            abandoned = True
        if self._cuda:
            torch.cuda.synchronize(self.device)  # step_ms covers the work, not its launch
        step_ms = (time.perf_counter() - started) * 1000.0
        done = {job_id: int(state.meta["step"]) for job_id, state in states.items()}
        if abandoned:
            return JobStepReport(steps_done=done, finished=[], step_ms=step_ms, abandoned=True)
        finished = [job_id for job_id, state in states.items() if done[job_id] >= int(state.meta["steps"])]
        return JobStepReport(steps_done=done, finished=finished, step_ms=step_ms)

    def job_frames(self, job_id: str) -> torch.Tensor:
        """A finished job's frames, uint8 [F, H, W, 3] on the host."""
        job = self._job(job_id)
        if job.state is None:
            raise SessionStateError(f"job {job_id!r} is suspended; resume it first")
        step, steps = self.job_progress(job_id)
        if step < steps:
            raise SessionStateError(f"job {job_id!r} has run {step} of its {steps} steps")
        return self.model.job_frames(job.state).to("cpu")

    def _job(self, job_id: str) -> _Session:
        job = self._get(job_id)
        if not job.job:
            raise SessionStateError(f"{job_id!r} is a session, not a job")
        return job

    # -- offload (TurboServe §3.1) -------------------------------------------------------------

    def suspend(self, session_id: str) -> HostStateRecord:
        """Copy the state region to host memory and free the device copy.

        A state region is one contiguous buffer (see `models.base.allocate_region`), so this is one
        copy into a pooled host buffer (pinned, on a side stream, on CUDA).
        """
        session = self._get(session_id)
        if session.state is None:
            raise SessionStateError(f"session {session_id!r} is already suspended")
        if session.frozen:
            raise SessionStateError(f"session {session_id!r} is frozen for migration")
        state = session.state
        manifest = self.model.state_manifest(state)
        layout = manifest_layout(manifest)
        _, total = region_offsets(layout)
        started = time.perf_counter()
        host_region = self._pool.take((total,), torch.uint8)
        host_views = carve_region(host_region, layout)
        if state.region is not None:
            self._copy_all({"region": host_region}, {"region": state.region})
        else:  # tensors adopted from a transport: copy them one by one into the flat host region
            self._copy_all(host_views, state.tensors)
        copy_ms = (time.perf_counter() - started) * 1000.0
        nbytes = state.nbytes
        if self._device_pool is not None and state.region is not None:
            self._device_pool.give(state.region)
        state.tensors, state.region = {}, None
        session.state = None
        session.status = SUSPENDED
        session.last_meta = manifest["meta"]
        session.last_transfer = TransferReport(session_id, nbytes, copy_ms)
        return HostStateRecord(
            session_id,
            manifest,
            host_views,
            nbytes,
            copy_ms,
            pinned=self._pool.pin,
            region=host_region,
            validated=(self.model, manifest),
        )

    def resume(self, session_id: str, record: HostStateRecord) -> TransferReport:
        """Copy a suspended state region back to the device; the session is due again.

        Works for a session suspended on this engine or one this engine has never seen (a record
        handed over from elsewhere). The record is validated before anything is installed.
        """
        session = self._sessions.get(session_id)
        if session is not None and session.state is not None:
            raise SessionStateError(f"session {session_id!r} is already resident")
        if (
            record.validated is None
            or record.validated[0] is not self.model
            or record.validated[1] is not record.manifest
        ):
            self.model.validate_manifest(record.manifest)
        layout = manifest_layout(record.manifest)
        _, total = region_offsets(layout)
        region = record.region
        if region is not None:
            if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() != total:
                raise StateManifestError(f"record region {tuple(region.shape)} does not hold {total} bytes")
        else:  # a record built from separate host tensors (e.g. a parked incoming migration)
            for name, shape, dtype in layout:
                tensor = record.tensors.get(name)
                if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise StateManifestError(
                        f"record tensor {name!r} does not match its manifest (already resumed?)"
                    )
        started = time.perf_counter()
        device_region = self._take_device((total,))
        device_views = carve_region(device_region, layout)
        if region is not None:
            self._copy_all({"region": device_region}, {"region": region})
        else:
            self._copy_all(device_views, record.tensors)
        copy_ms = (time.perf_counter() - started) * 1000.0
        # Validated above; no second pass through restore_state (its checks would repeat these).
        # The record is spent (its tensors are dropped below), so its meta is adopted, not copied.
        state = SessionState(tensors=device_views, meta=record.manifest["meta"], region=device_region)
        if region is not None:
            self._pool.give(region)
        record.tensors, record.region = {}, None
        if session is None:
            self._install(session_id, state)
            session = self._sessions[session_id]
        else:
            session.state, session.status = state, RESIDENT
        report = TransferReport(session_id, record.nbytes, copy_ms)
        session.last_transfer = report
        return report

    def _take_device(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self._device_pool is not None:
            return self._device_pool.take(shape, torch.uint8)
        return torch.empty(shape, dtype=torch.uint8, device=self.device)

    def _copy_all(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
        if self._side_stream is None:
            # A CPU worker, or CUDA with the side stream off: synchronous copies on this stream.
            for name, tensor in src.items():
                dst[name].copy_(tensor)
            return
        # Side stream: the copy waits for the work that produced the state, then runs beside
        # whatever the default stream does next; the event makes the copy visible before we return.
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for name, tensor in src.items():
                dst[name].copy_(tensor, non_blocking=True)
                if tensor.is_cuda:
                    # The caching allocator must not hand this memory out until the copy is done.
                    tensor.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()

    # -- state regions for migration and checkpoints (§6.1) -------------------------------------

    def export_state(self, session_id: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Freeze the session (no more steps) and return its state region: (manifest, tensors).

        The tensors are the live region on the engine's device (not copies); the manifest carries a
        checksum per tensor for the receiver to verify. Step (i) of the §6.1 migration protocol: after
        the target has installed and verified the region, the source calls `remove`; if the transfer
        fails, `thaw` returns the session to service untouched.
        """
        session = self._get(session_id)
        if session.state is None:
            raise SessionStateError(f"session {session_id!r} is suspended; resume it or send its record")
        session.frozen = True
        manifest = self.model.state_manifest(session.state, checksums=True)
        return manifest, dict(session.state.tensors)

    def meta(self, session_id: str) -> dict[str, Any]:
        """A copy of a resident or suspended session's (or job's) state meta (counters, prompts)."""
        return json_copy(self._meta(self._get(session_id)))

    def thaw(self, session_id: str) -> None:
        self._get(session_id).frozen = False

    def import_state(
        self,
        session_id: str,
        manifest: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        *,
        copy: bool = True,
    ) -> int:
        """Install a state region received from elsewhere; returns its size in bytes.

        Verifies model, version, names, shapes, dtypes and checksums first; on any mismatch raises
        `StateManifestError` and installs nothing. `copy=False` adopts device tensors as they are.
        """
        if session_id in self._sessions:
            raise SessionStateError(f"session {session_id!r} is already on this engine")
        state = self.model.restore_state(manifest, tensors, verify_checksums=True, copy=copy)
        self._install(session_id, state)
        return state.nbytes

    def state_to_bytes(self, session_id: str) -> bytes:
        """Checkpoint a resident session's state region as safetensors bytes (manifest in metadata)."""
        session = self._get(session_id)
        if session.state is None:
            raise SessionStateError(f"session {session_id!r} is suspended")
        manifest = self.model.state_manifest(session.state, checksums=True)
        return region_to_bytes(manifest, session.state.tensors)

    def state_from_bytes(self, session_id: str, data: bytes) -> int:
        manifest, tensors = region_from_bytes(data)
        # Copied into one flat region on the device (checkpoints are rare; offload then moves it whole).
        return self.import_state(session_id, manifest, tensors, copy=True)

    # -- internals -----------------------------------------------------------------------------

    def _install(self, session_id: str, state: SessionState) -> None:
        self._added += 1
        self._sessions[session_id] = _Session(
            session_id, RESIDENT, state, order=self._added, job=state.is_job
        )

    def _get(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionNotFound(session_id) from None


def region_to_bytes(manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    host = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    return save(host, metadata={"manifest": json.dumps(manifest)})


def region_from_bytes(data: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Inverse of `region_to_bytes`: (manifest, tensors in manifest order) on the host."""
    from safetensors.torch import load

    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    if "manifest" not in metadata:
        raise StateManifestError("safetensors checkpoint carries no state manifest")
    manifest = json.loads(metadata["manifest"])
    tensors = load(data)
    names = [e["name"] for e in manifest.get("tensors", [])]
    if sorted(names) != sorted(tensors):
        raise StateManifestError(f"checkpoint tensors {sorted(tensors)} do not match its manifest {names}")
    return manifest, {name: tensors[name] for name in names}


__all__ = [
    "ChunkEngine",
    "ChunkResult",
    "EncodedChunk",
    "HostBufferPool",
    "HostStateRecord",
    "JobStepReport",
    "SessionNotFound",
    "SessionStateError",
    "StateManifestError",
    "TransferReport",
    "encode_jpeg",
    "region_from_bytes",
    "region_to_bytes",
    "tensor_checksum",
]
