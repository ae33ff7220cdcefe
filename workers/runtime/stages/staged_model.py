"""The engine model of a worker of a split role (issue 15): a ``DC``, ``D``, ``ED``, ``E`` or ``C``
worker's `ChunkEngine` holds a `StagedStreamingModel`, a `StreamingVideoModel` over a `StagedModel`
(only the role's stages) whose session state is built from prompt *embeddings*
(``init_diffusion_state`` on a zeroed region) and whose step is diffuse → decode. The embeddings
come from an encoder worker through `PromptEncodings` (``stages.clients``).

The split state. A ``DC`` session's region holds its diffusion state *and* its decoder cache, laid
out as the monolithic model's state region (``StagedModel.state_layout``; the decoder cache is the
tensors named in ``DECODER_CACHE``, empty for a stateless decoder) with the same metadata (prompt
schedule, active prompt, counters). Offload, migration and checkpoints therefore move both parts in
one copy, exactly as they move a monolithic state, and a session moves between an ``EDC`` and a
``DC`` worker (or a worker changes role under it) without conversion. A prompt switch stays text in
the schedule; the diffusion worker asks the encoder for its embeddings when the switch is set
(`StagedStreamingModel.set_prompt` prefetches) and the engine runs a session only once the encoding
of the prompt due at its next chunk is at hand (`step_ready`), so a slow or lost encoder delays that
session and never corrupts it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from workers.runtime.models.base import Layout, SessionState, StagewiseModel, allocate_region
from workers.runtime.stages.clients import Decoders, DecoderUnavailable, PromptEncodings
from workers.runtime.stages.contract import Stage, StagedModel, parse_role, role_name, staged_class
from workers.runtime.stages.link import DEFAULT_TIMEOUT_S


def daemon_role(role: str) -> str:
    """The canonical role for the worker daemon (every role: ``D`` and ``ED`` run one-shot jobs only,
    ``E`` and ``C`` serve requests); `RoleError` (a `ValueError`) names the valid roles."""
    return role_name(parse_role(role))


class StagedStreamingModel(StagewiseModel):
    """The model of a ``DC`` worker's `ChunkEngine` (module docstring): the `StagedModel`'s diffuse
    and decode, the prompt embeddings from `PromptEncodings`; generation is `StagewiseModel.generate`
    (scheduled embeddings → diffuse → decode), the same code as the monolithic model's, so a ``DC``
    worker's chunks are bit-identical to an ``EDC`` worker's."""

    def __init__(
        self, staged: StagedModel, encodings: PromptEncodings, decoders: Decoders | None = None
    ) -> None:
        inner = staged.model
        self.staged = staged
        self.inner = inner
        self.encodings = encodings
        # A D or ED worker's decoder workers: a finished job's latents are decoded there.
        self.decoders = decoders or Decoders(device=inner.device, timeout_s=encodings.timeout_s)
        self.preset = inner.preset
        self.device = inner.device
        self.width, self.height, self.fps = inner.width, inner.height, inner.fps
        self.frames_per_chunk = inner.frames_per_chunk
        self.DECODER_CACHE = inner.DECODER_CACHE
        self.net = inner.net  # type: ignore[attr-defined]
        self.transferable_weights = False  # a partial network is no parameter-pool source

    @property
    def stages(self) -> frozenset[Stage]:
        return self.staged.stages

    # -- sessions --------------------------------------------------------------------------------

    def create_state(
        self, prompt: str, seed: int, options: dict[str, Any] | None = None, *, start_chunk: int = 0
    ) -> SessionState:
        """The diffusion state and the decoder cache, zeroed and filled from the prompt's
        embeddings (``init_diffusion_state``), in the monolithic state region's layout."""
        self.staged.require(Stage.DIFFUSE)
        self.staged.require(Stage.DECODE)
        self.inner.state_bytes_for(options)  # refuses options the model does not take
        embeddings = self.encodings.get(prompt)
        region, tensors = allocate_region(self.staged.state_layout(), self.device)
        region.zero_()
        state = SessionState(tensors=tensors, meta={}, region=region)
        self.staged.init_diffusion_state(state, seed, embeddings)
        counters = {k: v for k, v in state.meta.items()}
        state.meta = self.session_meta(prompt, seed, options, start_chunk, counters)
        return state

    def set_prompt(self, state: SessionState, prompt: str, from_chunk: int) -> None:
        super().set_prompt(state, prompt, from_chunk)
        if prompt != state.meta["active_prompt"] and self.encodings.known:
            self.encodings.prefetch(prompt)  # the round trip overlaps the chunks before the switch

    def step_ready(self, state: SessionState) -> bool:
        prompt = self.prompt_for_chunk(state, state.next_chunk)
        return prompt == state.meta["active_prompt"] or self.encodings.ready(prompt)

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        return self.encodings.get(prompt)

    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor:
        return self.staged.diffuse(states, embeddings)

    def decode(self, latents: torch.Tensor, caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return self.staged.decode(latents, caches)

    def expected_layout(self, meta: dict[str, Any]) -> Layout:
        return self.inner.expected_layout(meta)

    # -- one-shot jobs: the model's own split at its encode (`StagedModel.create_job`) ------------

    def check_job(self, *, kind: str, width: int, height: int, frames: int, steps: int) -> None:
        self.staged.require_job_step()
        if Stage.DECODE not in self.stages and not self.decoders.known:
            raise DecoderUnavailable(
                f"a {role_name(self.stages)} worker decodes jobs on a decoder worker; none is known"
            )
        self.inner.check_job(kind=kind, width=width, height=height, frames=frames, steps=steps)

    def create_job(
        self, *, kind: str, prompt: str, seed: int, width: int, height: int, frames: int, steps: int
    ) -> SessionState:
        """The job's region at step 0 from its prompt's embeddings, fetched from the encoder worker
        (one round trip; `EncoderUnavailable` when none answers). Checked before anything is asked."""
        self.check_job(kind=kind, width=width, height=height, frames=frames, steps=steps)
        # An ED worker encodes its own prompt; a DC or D worker asks its encoder worker.
        local = Stage.ENCODE in self.stages
        embeddings = self.staged.encode(prompt) if local else self.encodings.get(prompt)
        return self.staged.create_job(
            embeddings,
            kind=kind,
            prompt=prompt,
            seed=seed,
            width=width,
            height=height,
            frames=frames,
            steps=steps,
        )

    def job_layout(self, meta: dict[str, Any]) -> Layout:
        return self.inner.job_layout(meta)

    @contextlib.contextmanager
    def abandon_on(self, flag: threading.Event | None) -> Iterator[None]:
        """The flag is the wrapped model's too: its `job_step` (run through the `StagedModel`) checks
        it at the same block boundaries as on an ``EDC`` worker (``check_abandon``)."""
        with super().abandon_on(flag), self.inner.abandon_on(flag):
            yield

    def job_step(self, states: list[SessionState]) -> None:
        self.staged.job_step(states)

    def job_frames(self, state: SessionState) -> torch.Tensor:
        """A finished job's frames: decoded here (``DC``), or on the decoder worker in use (``D``,
        ``ED``: one round trip of its final latents and meta, `DecoderUnavailable` when none
        answers) by the same `decode_job` call, so the frames are the same bytes."""
        if Stage.DECODE in self.stages:
            return self.inner.job_frames(state)
        return self.decoders.decode_job(state.tensors["latents"], state.meta)

    def state_bytes_for(self, options: dict[str, Any] | None = None) -> int:
        return self.inner.state_bytes_for(options)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "stage_role": role_name(self.staged.stages)}  # type: ignore[attr-defined]


def staged_engine_model(
    preset: str,
    role: str,
    *,
    device: torch.device | str = "cpu",
    weights_path: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> StagedStreamingModel:
    """The engine model of a worker of a split role (``ED``, ``DC``, ``D``, ``E``, ``C``), with
    only its stages' weights loaded."""
    name = daemon_role(role)
    if name == "EDC":
        raise ValueError("an EDC worker runs the monolithic model")
    kwargs: dict[str, Any] = {"stages": parse_role(name), "device": device}
    if weights_path is not None:
        kwargs["weights_path"] = weights_path
    staged = staged_class(preset).from_preset(preset, **kwargs)
    return StagedStreamingModel(
        staged,
        PromptEncodings(device=staged.device, timeout_s=timeout_s),
        Decoders(device=staged.device, timeout_s=timeout_s),
    )
