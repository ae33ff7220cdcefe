"""vLLM-Omni's streaming video output socket (``WS /v1/realtime/video``): its messages, parsed.

The protocol as vLLM-Omni documents it ("Streaming Video Output WebSocket API" and
``examples/online_serving/streaming_video_generation``): JSON text control frames; every
``video.chunk_metadata`` is followed at once by one binary frame of fragmented MP4 (``m4s``).

Client → server: ``session.start`` (``model``, ``prompt``, optional ``format``, ``width``,
``height``, ``fps``, ``num_frames``, ``seed``, ``num_inference_steps``, ``extra_params``, …),
``session.interaction`` (``interaction.event_id``, ``interaction.event.prompt``,
``interaction.transition_chunks``), ``session.stop``, ``session.ping``. Server → client:
``video.start``, ``video.chunk_metadata`` + binary, ``session.interaction.queued``,
``session.pong``, ``session.done`` and ``error`` (``message``).

This module only reads and writes those messages (no Django, no sockets): the consumer
(``sessions/realtime/consumer.py``) maps them onto an ordinary StreamServe session.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

FORMAT = "m4s"
CLIENT_TYPES = ("session.start", "session.interaction", "session.stop", "session.ping")
# A start carries a prompt (MAX_PROMPT_CHARS, JSON-escaped) and a few sampling fields; anything
# longer is refused unparsed.
MAX_MESSAGE_CHARS = 65_536
MAX_EVENT_ID_CHARS = 128
# Sampling fields a vLLM-Omni client may send that a StreamServe model fixes itself (its sampler and
# steps are part of the model): accepted, and the config we answer with says what was used.
IGNORED_START_FIELDS = frozenset(
    {"num_inference_steps", "guidance_scale", "negative_prompt", "extra_params", "image_reference"}
)
START_FIELDS = frozenset(
    {"type", "model", "prompt", "format", "width", "height", "fps", "num_frames", "seed"}
)


class ProtocolError(ValueError):
    """A client message the protocol does not accept; its text is the ``error`` frame's message."""


@dataclass(frozen=True)
class Start:
    model: str | None
    prompt: str
    width: int | None = None
    height: int | None = None
    fps: int | None = None
    num_frames: int | None = None
    seed: int | None = None
    ignored: tuple[str, ...] = ()

    @property
    def resolution(self) -> str | None:
        if self.width is None and self.height is None:
            return None
        if self.width is None or self.height is None:
            raise ProtocolError("give both width and height, or neither")
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class Interaction:
    prompt: str
    event_id: str | None = None
    transition_chunks: int | None = None


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ping:
    pass


ClientMessage = Start | Interaction | Stop | Ping


def _integer(message: dict, name: str, *, minimum: int, maximum: int | None = None) -> int | None:
    value = message.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ProtocolError(f"{name} must be {bound}")
    return value


def parse(text: str | None) -> ClientMessage:
    """One client frame as a message; :class:`ProtocolError` with the reason otherwise."""
    if text is None:
        raise ProtocolError("control messages are JSON text frames; the client sends no binary frames")
    if len(text) > MAX_MESSAGE_CHARS:
        raise ProtocolError(f"messages are at most {MAX_MESSAGE_CHARS} characters")
    try:
        message = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise ProtocolError("invalid JSON: nested too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("a message is a JSON object with a 'type'")
    kind = message.get("type")
    if kind == "session.start":
        return _start(message)
    if kind == "session.interaction":
        return _interaction(message)
    if kind == "session.stop":
        return Stop()
    if kind == "session.ping":
        return Ping()
    raise ProtocolError(f"unknown message type {kind!r}; expected one of {', '.join(CLIENT_TYPES)}")


def _start(message: dict) -> Start:
    prompt = message.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ProtocolError("session.start needs a non-empty 'prompt' string")
    model = message.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("model must be a string")
    fmt = message.get("format", FORMAT)
    if fmt != FORMAT:
        raise ProtocolError(f"unsupported format {fmt!r}; supported: {FORMAT}")
    start = Start(
        model=model,
        prompt=prompt,
        width=_integer(message, "width", minimum=1),
        height=_integer(message, "height", minimum=1),
        fps=_integer(message, "fps", minimum=1),
        num_frames=_integer(message, "num_frames", minimum=1),
        seed=_integer(message, "seed", minimum=0, maximum=2**63 - 1),
        ignored=tuple(sorted(set(message) - START_FIELDS)),
    )
    start.resolution  # noqa: B018  (both or neither: raises now, before anything is created)
    return start


def _interaction(message: dict) -> Interaction:
    interaction = message.get("interaction")
    if not isinstance(interaction, dict):
        raise ProtocolError("session.interaction needs an 'interaction' object")
    event = interaction.get("event")
    if not isinstance(event, dict):
        raise ProtocolError("interaction.event must be an object")
    prompt = event.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        # vLLM-Omni also takes camera updates (event.multi_modal_data.camera); no model served here
        # registers a camera modality.
        raise ProtocolError(
            "interaction.event.prompt must be a non-empty string (camera updates are not supported)"
        )
    event_id = interaction.get("event_id")
    if event_id is not None and (
        not isinstance(event_id, str) or not 0 < len(event_id) <= MAX_EVENT_ID_CHARS
    ):
        raise ProtocolError(f"interaction.event_id must be a string of 1 to {MAX_EVENT_ID_CHARS} characters")
    transition = _integer(interaction, "transition_chunks", minimum=0)
    return Interaction(prompt=prompt, event_id=event_id, transition_chunks=transition)


def chunks_for(num_frames: int | None, frames_per_chunk: int) -> int | None:
    """Whole chunks covering ``num_frames`` (rounded up); None: until stopped."""
    if num_frames is None:
        return None
    return math.ceil(num_frames / frames_per_chunk)


# --- server → client ------------------------------------------------------------------------


def video_start(request_id: str, config: dict[str, Any]) -> str:
    return json.dumps({"type": "video.start", "request_id": request_id, "format": FORMAT, "config": config})


@dataclass
class EventLedger:
    """Which interaction events a chunk starts, carries and completes.

    A prompt applies from the chunk index the platform gave it (``from_chunk``) and takes effect
    at once (no model served here blends prompts over several chunks, so ``transition_chunks`` is
    reported as 0): the event is started, active and completed in that chunk's metadata.
    """

    pending: list[tuple[int, str]] = field(default_factory=list)

    def queue(self, event_id: str, from_chunk: int) -> None:
        self.pending.append((from_chunk, event_id))

    def at(self, generation_index: int) -> list[str]:
        due = [event_id for from_chunk, event_id in self.pending if from_chunk <= generation_index]
        self.pending = [(c, e) for c, e in self.pending if c > generation_index]
        return due


def chunk_metadata(
    request_id: str,
    *,
    transport_index: int,
    generation_index: int,
    num_frames: int,
    byte_length: int,
    events: list[str],
) -> str:
    return json.dumps(
        {
            "type": "video.chunk_metadata",
            "request_id": request_id,
            "kind": "media",
            "transport_chunk_index": transport_index,
            "generation_chunk_index": generation_index,
            "num_frames": num_frames,
            "byte_length": byte_length,
            "started_event_ids": events,
            "active_event_ids": events,
            "completed_event_ids": events,
        }
    )


def interaction_queued(request_id: str, event_id: str) -> str:
    return json.dumps({"type": "session.interaction.queued", "request_id": request_id, "event_id": event_id})


def done(request_id: str, *, chunks: int, stopped: bool) -> str:
    return json.dumps(
        {"type": "session.done", "request_id": request_id, "chunks": chunks, "stopped": stopped}
    )


def pong() -> str:
    return json.dumps({"type": "session.pong"})


def error(message: str) -> str:
    return json.dumps({"type": "error", "message": message})
