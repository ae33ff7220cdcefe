"""Generating a clip from the command line (``python manage.py generate``), with the platform's semantics.

A clip is one session on a `ChunkEngine` around the preset's model, exactly as a worker runs it:
`add_session(prompt, seed)`, then one `step` per chunk; a prompt change `CHUNK:"text"` is applied
with `set_prompt(from_chunk=CHUNK)` before that chunk, as the worker does when a user types a new
prompt. The same preset, seed and prompts therefore give the same frames, byte for byte, as they do
on the platform (on the same device and torch build).

Output: an MP4 (H.264 through PyAV) when the path ends in ``.mp4``, otherwise a directory of PNG
frames ``frame_00000.png``, ``frame_00001.png``, ...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from workers.runtime.engine import ChunkEngine
from workers.runtime.models.base import StreamingVideoModel


class GenerateError(ValueError):
    """Bad input to the generator; `flag` names the command-line option at fault."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def parse_prompt_at(value: str) -> tuple[int, str]:
    """'3:a blue square moving up' (the prompt may be quoted) → (3, 'a blue square moving up')."""
    chunk, sep, prompt = value.partition(":")
    if not sep or not chunk.strip().isdigit():
        raise GenerateError(
            "--prompt-at", f'expected CHUNK:"prompt" with CHUNK a whole number, got {value!r}'
        )
    prompt = prompt.strip()
    if len(prompt) >= 2 and prompt[0] == prompt[-1] and prompt[0] in "\"'":
        prompt = prompt[1:-1].strip()
    if not prompt:
        raise GenerateError("--prompt-at", f"the prompt after {chunk.strip()}: is empty")
    return int(chunk), prompt


def prompt_schedule(prompt: str, prompt_at: list[str], chunks: int) -> dict[int, str]:
    """The prompt changes by chunk index (validated against the number of chunks)."""
    if chunks < 1:
        raise GenerateError("--chunks", f"must be at least 1, got {chunks}")
    if not prompt.strip():
        raise GenerateError("--prompt", "must not be empty")
    changes: dict[int, str] = {}
    for value in prompt_at:
        chunk, text = parse_prompt_at(value)
        if chunk >= chunks:
            raise GenerateError("--prompt-at", f"chunk {chunk} is past the last chunk ({chunks - 1})")
        if chunk in changes:
            raise GenerateError("--prompt-at", f"chunk {chunk} is given twice")
        changes[chunk] = text
    return changes


def check_output(out: str | Path) -> Path:
    """Create the output's directory (or the PNG directory) now, so a bad path fails before generating."""
    path = Path(out)
    target_dir = path.parent if path.suffix.lower() == ".mp4" else path
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GenerateError("--out", f"cannot create {target_dir}: {exc.strerror or exc}") from exc
    if not target_dir.is_dir():
        raise GenerateError("--out", f"{target_dir} is not a directory")
    probe = target_dir / ".streamserve-write-test"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise GenerateError("--out", f"cannot write into {target_dir}: {exc.strerror or exc}") from exc
    return path


def generate_frames(
    model: StreamingVideoModel,
    prompt: str,
    *,
    seed: int,
    chunks: int,
    changes: dict[int, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Frames uint8 [chunks * frames_per_chunk, H, W, 3] of one session, chunk by chunk."""
    engine = ChunkEngine(model, max_batch=1, encode_workers=1)
    try:
        engine.add_session("cli", prompt, seed)
        frames: list[torch.Tensor] = []
        for chunk in range(chunks):
            if changes and chunk in changes:
                engine.set_prompt("cli", changes[chunk], from_chunk=chunk)
            (result,) = engine.step(due=["cli"])
            result.encoded.result()  # the platform's JPEG encoding of the chunk, as a worker does
            frames.append(result.rgb)
            if progress is not None:
                progress(1)
    finally:
        engine.close()
    return torch.cat(frames).numpy()


def write_png_frames(frames: np.ndarray, directory: Path) -> list[Path]:
    from PIL import Image

    paths = []
    for i, frame in enumerate(frames):
        path = directory / f"frame_{i:05d}.png"
        Image.fromarray(frame, mode="RGB").save(path, format="PNG")
        paths.append(path)
    return paths


def write_mp4(frames: np.ndarray, path: Path, fps: float) -> None:
    """H.264 in MP4 (yuv420p, so every player shows it; sizes are rounded down to even numbers)."""
    from fractions import Fraction

    import av

    height, width = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
    # bitexact: no creation time or library version in the container (x264 output may still vary).
    with av.open(str(path), mode="w", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "18", "preset": "medium", "threads": "1"}
        stream.thread_count = 1
        for index, frame in enumerate(frames):
            video = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[:height, :width]), format="rgb24")
            video.pts = index
            for packet in stream.encode(video):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def read_mp4(path: str | Path) -> np.ndarray:
    """Decoded RGB frames of an MP4 (for checks and tests)."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def write_output(frames: np.ndarray, out: Path, fps: float) -> str:
    if out.suffix.lower() == ".mp4":
        write_mp4(frames, out, fps)
        return f"{out} ({len(frames)} frames, H.264 MP4 at {fps:g} fps)"
    write_png_frames(frames, out)
    return f"{out}/frame_*.png ({len(frames)} PNG frames at {fps:g} fps)"
