"""What a stage worker does with each message of a session's stream, whatever stages it hosts.

A split pipeline is a chain of workers (``E → D → C``, ``E → DC``, …) through which one stream of
`StageMessage`s flows in order. Every worker runs a `StageRunner` over the stages it hosts: a message
a hosted stage consumes is transformed (a prompt gains its embeddings, a step becomes latents,
latents become frames); anything else is passed on unchanged, so the same message stream drives any
split and the monolithic ``EDC`` worker alike.

Messages (``kind``: ``meta`` keys; tensor):
- ``open``: session, seed, prompt, start_chunk; + embeddings once encoded. Diffuse creates the
  session's diffusion state from them; decode creates its decoder cache.
- ``prompt``: session, prompt, from_chunk; + embeddings once encoded. Takes effect at chunk
  ``from_chunk`` and after (``StreamingVideoModel.set_prompt``): diffuse keeps the encodings of
  pending switches and installs the latest one due when it runs that chunk.
- ``step``: sessions (one batch). Diffuse runs it → ``latents``: sessions, chunks; tensor
  ``[B, ...]``. Decode turns latents into ``frames``: sessions, chunks; uint8 ``[B, T, H, W, 3]``.
- ``close``: session. Every stage drops the session's data and passes it on, so the driver gets
  it back from the last worker as the acknowledgement that the whole chain let go of the session.
- ``error``: worker, error, message (the kind it failed on), meta: a message a worker could not act on
  (`StageProtocolError`) is answered with this, passed on to the driver; the worker goes on.
- ``stop``: the end of the stream; every worker passes it on, then exits.

One-shot jobs (GenServe, issue 14) take the same path, split at the same places as the model's
``create_job`` / ``job_step`` / ``job_frames``:
- ``job``: job, kind, prompt, seed, width, height, frames, steps; + embeddings once encoded. Diffuse
  checks it (a bad size is an ``error`` naming the field) and creates the job's region at step 0.
- ``jobstep``: jobs (one batch of one shape, as ``job_step``). Diffuse advances each by one step;
  each job that has run all its steps leaves the diffusion worker as ``job_latents``: job, the
  job's meta; its final latents. Decode turns them into ``job_frames``: job, meta; uint8
  ``[F, H, W, 3]`` (what the job runner encodes as PNG or MP4).

The encode stage keeps an LRU cache of encodings by prompt text: in a shared encoder pool a prompt
many sessions use (or a session switching back) is encoded once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.runtime.models.base import JobSpecError, OneShotUnsupported, SessionState
from workers.runtime.stages.contract import DecoderCache, Stage, StagedModel, StageNotHosted

KINDS = (
    *("open", "prompt", "step", "latents", "frames", "close", "error", "stop"),
    *("job", "jobstep", "job_latents", "job_frames"),
)
JOB_FIELDS = ("kind", "prompt", "seed", "width", "height", "frames", "steps")


class StageProtocolError(ValueError):
    """A message a worker cannot act on (unknown session, missing embeddings, past chunk)."""


@dataclass
class StageMessage:
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensor: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StageProtocolError(f"unknown stage message kind {self.kind!r}; known: {', '.join(KINDS)}")


@dataclass
class _DiffusionSession:
    state: SessionState
    # (from_chunk, embeddings) of prompt switches not yet in force, in arrival order.
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def embeddings_for(self, chunk: int) -> torch.Tensor | None:
        """The encoding of the latest switch due at ``chunk`` (None: the prompt in force stays)."""
        due = [entry for entry in self.pending if entry[0] <= chunk]
        if not due:
            return None
        self.pending = [entry for entry in self.pending if entry[0] > chunk]
        return max(due, key=lambda entry: entry[0])[1]


class StageRunner:
    """Applies the stages a worker hosts to the message stream (see the module docstring)."""

    def __init__(self, staged: StagedModel, *, encoding_cache_size: int = 64) -> None:
        if encoding_cache_size < 0:
            raise ValueError("encoding_cache_size must be >= 0")
        self.staged = staged
        self.stages = staged.stages
        self.encoding_cache_size = encoding_cache_size
        self._encodings: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encode_hits = 0
        self.encode_misses = 0
        self._diffusion: dict[str, _DiffusionSession] = {}
        self._decoders: dict[str, DecoderCache] = {}
        self._jobs: dict[str, SessionState] = {}

    def handle(self, message: StageMessage) -> list[StageMessage]:
        """The messages to pass downstream after this worker's stages have acted on ``message``."""
        handler = getattr(self, f"_on_{message.kind}", None)
        if handler is None:
            return [message]
        try:
            return handler(message)
        except StageProtocolError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            # A missing or malformed field (no "seed", a non-integer chunk): the sender's mistake.
            raise StageProtocolError(f"malformed {message.kind} message {message.meta!r}: {exc!r}") from exc

    # -- encode ----------------------------------------------------------------------------------

    def encoding(self, prompt: str) -> torch.Tensor:
        cached = self._encodings.get(prompt)
        if cached is not None:
            self._encodings.move_to_end(prompt)
            self.encode_hits += 1
            return cached
        self.encode_misses += 1
        encoded = self.staged.encode(prompt)
        if self.encoding_cache_size:
            self._encodings[prompt] = encoded
            if len(self._encodings) > self.encoding_cache_size:
                self._encodings.popitem(last=False)
        return encoded

    def _with_embeddings(self, message: StageMessage) -> StageMessage:
        if Stage.ENCODE in self.stages:
            return StageMessage(message.kind, dict(message.meta), self.encoding(message.meta["prompt"]))
        if message.tensor is None and Stage.DIFFUSE in self.stages:
            raise StageProtocolError(
                f"{message.kind} of session {message.meta.get('session')!r} reached a diffusion worker "
                "without embeddings: no encode stage upstream"
            )
        return message

    # -- handlers ----------------------------------------------------------------------------------

    def _on_open(self, message: StageMessage) -> list[StageMessage]:
        message = self._with_embeddings(message)
        session = str(message.meta["session"])
        if Stage.DIFFUSE in self.stages:
            if session in self._diffusion:
                raise StageProtocolError(f"session {session!r} is already open")
            assert message.tensor is not None
            state = self.staged.create_diffusion_state(
                int(message.meta["seed"]), message.tensor, start_chunk=int(message.meta.get("start_chunk", 0))
            )
            self._diffusion[session] = _DiffusionSession(state)
            message = StageMessage("open", dict(message.meta))  # embeddings stop here
        if Stage.DECODE in self.stages:
            self._decoders[session] = self.staged.create_decoder_cache()
            return []
        return [message]

    def _on_prompt(self, message: StageMessage) -> list[StageMessage]:
        message = self._with_embeddings(message)
        if Stage.DIFFUSE not in self.stages:
            return [message]
        session = self._diffusion_session(message.meta["session"])
        from_chunk = int(message.meta["from_chunk"])
        if from_chunk < session.state.next_chunk:
            raise StageProtocolError(
                f"chunk {from_chunk} of session {message.meta['session']!r} was already generated "
                f"(next chunk is {session.state.next_chunk})"
            )
        assert message.tensor is not None
        # As set_prompt: a switch supersedes every switch scheduled at or after its chunk.
        session.pending = [entry for entry in session.pending if entry[0] < from_chunk]
        session.pending.append((from_chunk, message.tensor))
        return []

    def _on_step(self, message: StageMessage) -> list[StageMessage]:
        if Stage.DIFFUSE not in self.stages:
            return [message]
        sessions = [self._diffusion_session(name) for name in message.meta["sessions"]]
        chunks = [s.state.next_chunk for s in sessions]
        embeddings = [s.embeddings_for(c) for s, c in zip(sessions, chunks, strict=True)]
        latents = self.staged.diffuse([s.state for s in sessions], embeddings)
        out = StageMessage("latents", {"sessions": list(message.meta["sessions"]), "chunks": chunks}, latents)
        return self._on_latents(out) if Stage.DECODE in self.stages else [out]

    def _on_latents(self, message: StageMessage) -> list[StageMessage]:
        if Stage.DECODE not in self.stages:
            return [message]
        caches = []
        for name in message.meta["sessions"]:
            if name not in self._decoders:
                raise StageProtocolError(
                    f"latents of session {name!r}, which this decode worker never opened"
                )
            caches.append(self._decoders[name])
        assert message.tensor is not None
        frames = self.staged.decode(message.tensor.to(self.staged.device), caches)
        return [StageMessage("frames", dict(message.meta), frames)]

    def _on_close(self, message: StageMessage) -> list[StageMessage]:
        session = str(message.meta["session"])
        self._diffusion.pop(session, None)
        self._decoders.pop(session, None)
        return [message]

    # -- one-shot jobs ------------------------------------------------------------------------------

    def _on_job(self, message: StageMessage) -> list[StageMessage]:
        message = self._with_embeddings(message)
        if Stage.DIFFUSE not in self.stages:
            return [message]
        job = str(message.meta["job"])
        if job in self._jobs:
            raise StageProtocolError(f"job {job!r} is already running")
        assert message.tensor is not None
        fields = {key: message.meta[key] for key in JOB_FIELDS}
        try:
            self._jobs[job] = self.staged.create_job(message.tensor, **fields)
        except (JobSpecError, OneShotUnsupported, StageNotHosted) as exc:
            raise StageProtocolError(f"job {job!r}: {exc}") from exc
        return []

    def _on_jobstep(self, message: StageMessage) -> list[StageMessage]:
        if Stage.DIFFUSE not in self.stages:
            return [message]
        names = [str(name) for name in message.meta["jobs"]]
        unknown = [name for name in names if name not in self._jobs]
        if unknown:
            raise StageProtocolError(f"job(s) {unknown} are not running on this diffusion worker")
        states = [self._jobs[name] for name in names]
        try:
            self.staged.job_step(states)
        except ValueError as exc:  # mixed shapes, a finished job: the batch is the sender's mistake
            raise StageProtocolError(f"jobstep {names}: {exc}") from exc
        out = []
        for name, state in zip(names, states, strict=True):
            if int(state.meta["step"]) >= int(state.meta["steps"]):
                del self._jobs[name]
                meta = {"job": name, "meta": state.meta}
                done = StageMessage("job_latents", meta, state.tensors["latents"])
                out += self._on_job_latents(done) if Stage.DECODE in self.stages else [done]
        return out

    def _on_job_latents(self, message: StageMessage) -> list[StageMessage]:
        if Stage.DECODE not in self.stages:
            return [message]
        assert message.tensor is not None
        frames = self.staged.decode_job(message.tensor, message.meta["meta"])
        return [StageMessage("job_frames", dict(message.meta), frames)]

    def _diffusion_session(self, name: Any) -> _DiffusionSession:
        try:
            return self._diffusion[str(name)]
        except KeyError:
            raise StageProtocolError(f"session {name!r} is not open on this diffusion worker") from None
