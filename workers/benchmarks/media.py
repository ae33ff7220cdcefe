"""``manage.py bench_media``: what a chunk costs on the wire as JPEG and as H.264, at real sizes.

Two contents, both natural and shipped with what is installed (nothing is downloaded):

- ``photo``: matplotlib's sample photograph (``grace_hopper.jpg``), panned and zoomed frame by
  frame to the requested size — camera motion over a real image, what a video codec's motion
  search is for and a JPEG sequence pays for in full every frame;
- ``demo``: the demo model's own output (a prompt's shapes moving over a background), upscaled to
  the requested size: what a user of ``make run`` watches, smoother than a photograph.

For each codec: bits per second of one stream, bytes per chunk, encode time per chunk (one core:
one encoder thread; the demo frames are generated before timing starts) and quality against the
source frames (PSNR and SSIM from scikit-image, on the decoded frames). JPEG is the platform's
chunk encoder (``encode_jpeg_frames``); H.264 is the live fragment encoder
(``workers.runtime.media``, one closed GOP per chunk).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from contracts import bench
from workers.benchmarks.content import photo_frames
from workers.runtime.encoding import encode_jpeg_frames
from workers.runtime.generate import generate_frames
from workers.runtime.media import FragmentEncoder, H264Options, decode_fragments
from workers.runtime.models import build_model

CONTENTS = ("photo", "demo")


def demo_frames(width: int, height: int, count: int, frames_per_chunk: int, *, seed: int = 0) -> np.ndarray:
    """The demo model's frames for a prompt, upscaled to the requested size."""
    import torch
    from PIL import Image

    torch.manual_seed(seed)
    model = build_model("demo", device="cpu")
    chunks = -(-count // model.frames_per_chunk)
    raw = generate_frames(model, "a red circle moving left on a blue background", seed=seed, chunks=chunks)
    resized = [
        np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BICUBIC))
        for frame in raw[:count]
    ]
    return np.stack(resized)


def _quality(source: np.ndarray, decoded: np.ndarray) -> dict[str, float]:
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    psnr = [peak_signal_noise_ratio(s, d, data_range=255) for s, d in zip(source, decoded, strict=True)]
    ssim = [
        structural_similarity(s, d, channel_axis=2, data_range=255)
        for s, d in zip(source, decoded, strict=True)
    ]
    return {"psnr_db": float(np.mean(psnr)), "ssim": float(np.mean(ssim))}


def _codec_figures(
    sizes: list[int], encode_ms: list[float], frames: int, fps: float, quality: dict[str, float]
) -> dict[str, Any]:
    seconds = frames / fps
    return {
        "bits_per_s": 8.0 * sum(sizes) / seconds,
        "bytes_per_chunk": float(np.mean(sizes)),
        "encode_ms": bench.summarize(encode_ms),
        "encode_ms_p50": bench.summarize(encode_ms)["p50"],
        "encode_ms_p99": bench.summarize(encode_ms)["p99"],
        **quality,
    }


def measure_content(
    frames: np.ndarray,
    *,
    fps: float,
    frames_per_chunk: int,
    jpeg_quality: int,
    encoder: FragmentEncoder,
    repeats: int,
) -> dict[str, Any]:
    """JPEG and H.264 figures of one content, chunk by chunk; encode times over ``repeats`` passes."""
    chunks = [frames[i : i + frames_per_chunk] for i in range(0, len(frames), frames_per_chunk)]
    chunks = [c for c in chunks if len(c) == frames_per_chunk]
    used = np.concatenate(chunks)
    from PIL import Image

    jpeg_ms, jpeg_sizes, jpeg_decoded = [], [], []
    h264_ms, h264_sizes, fragments = [], [], []
    init = b""
    for attempt in range(repeats):
        for index, chunk in enumerate(chunks):
            jpeg = encode_jpeg_frames(chunk, quality=jpeg_quality)
            fragment = encoder.encode(chunk, fps=fps, chunk_index=index, frames_per_chunk=frames_per_chunk)
            jpeg_ms.append(jpeg.encode_ms)
            h264_ms.append(fragment.encode_ms)
            if attempt == 0:
                jpeg_sizes.append(sum(len(f) for f in jpeg.frames))
                jpeg_decoded.extend(np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in jpeg.frames)
                # The init segment goes once to each viewer; it is counted with the first chunk.
                h264_sizes.append(len(fragment.data) + (0 if index else len(fragment.init)))
                fragments.append(fragment.data)
                init = fragment.init
    decoded, _pts = decode_fragments(init, fragments)
    if len(decoded) != len(used):
        raise RuntimeError(f"H.264 decoded {len(decoded)} frames of {len(used)}")
    return {
        "frames": len(used),
        "chunks": len(chunks),
        "jpeg": _codec_figures(jpeg_sizes, jpeg_ms, len(used), fps, _quality(used, np.stack(jpeg_decoded))),
        "h264": {
            **_codec_figures(h264_sizes, h264_ms, len(used), fps, _quality(used, decoded)),
            "init_bytes": len(init),
            "mime": fragment.mime,
        },
    }


def _h264_point(
    chunks: list[np.ndarray], source: np.ndarray, *, fps: float, options: H264Options, encoder: str
):
    coder = FragmentEncoder(encoder, options)
    fragments = [coder.encode(c, fps=fps, chunk_index=i) for i, c in enumerate(chunks)]
    decoded, _ = decode_fragments(fragments[0].init, [f.data for f in fragments])
    bits = 8.0 * (len(fragments[0].init) + sum(len(f.data) for f in fragments)) / (len(source) / fps)
    return bits, _quality(source, decoded)["ssim"]


def _jpeg_point(chunks: list[np.ndarray], source: np.ndarray, *, fps: float, quality: int):
    from PIL import Image

    encoded = [f for c in chunks for f in encode_jpeg_frames(c, quality=quality).frames]
    decoded = np.stack([np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in encoded])
    return 8.0 * sum(len(f) for f in encoded) / (len(source) / fps), _quality(source, decoded)["ssim"]


def _largest_passing(low: int, high: int, passes) -> int | None:
    """The largest integer in [low, high] for which ``passes`` holds, assuming it holds below some
    threshold and fails above it (quality falls as CRF rises); None when it holds nowhere."""
    if not passes(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if passes(middle):
            low = middle
        else:
            high = middle - 1
    return low


def matched_quality(
    frames: np.ndarray,
    *,
    fps: float,
    frames_per_chunk: int,
    jpeg_quality: int,
    options: H264Options,
    encoder: str,
) -> dict[str, Any]:
    """Bits at equal quality, both ways round: H.264 at the largest CRF whose SSIM is at least the
    JPEG's, and JPEG at the smallest quality whose SSIM is at least H.264's at its CRF."""
    chunks = [frames[i : i + frames_per_chunk] for i in range(0, len(frames), frames_per_chunk)]
    chunks = [c for c in chunks if len(c) == frames_per_chunk]
    source = np.concatenate(chunks)
    jpeg_bits, jpeg_ssim = _jpeg_point(chunks, source, fps=fps, quality=jpeg_quality)
    h264_bits, h264_ssim = _h264_point(chunks, source, fps=fps, options=options, encoder=encoder)
    h264_points: dict[int, tuple[float, float]] = {}

    def h264_passes(crf: int) -> bool:
        if crf not in h264_points:
            h264_points[crf] = _h264_point(
                chunks,
                source,
                fps=fps,
                options=H264Options(options.preset, crf, options.threads),
                encoder=encoder,
            )
        return h264_points[crf][1] >= jpeg_ssim

    crf = _largest_passing(0, 51, h264_passes)
    jpeg_points: dict[int, tuple[float, float]] = {}

    def jpeg_fails(step: int) -> bool:  # step = 95 - quality: quality falls as the step rises
        quality = 95 - step
        if quality not in jpeg_points:
            jpeg_points[quality] = _jpeg_point(chunks, source, fps=fps, quality=quality)
        return jpeg_points[quality][1] >= h264_ssim

    step = _largest_passing(0, 94, jpeg_fails)
    quality = None if step is None else 95 - step
    return {
        "h264_at_jpeg_ssim": None
        if crf is None
        else {
            "jpeg_quality": jpeg_quality,
            "jpeg_ssim": jpeg_ssim,
            "jpeg_bits_per_s": jpeg_bits,
            "crf": crf,
            "ssim": h264_points[crf][1],
            "bits_per_s": h264_points[crf][0],
            "ratio_bits_jpeg_over_h264": jpeg_bits / h264_points[crf][0],
        },
        "jpeg_at_h264_ssim": None
        if quality is None
        else {
            "crf": options.crf,
            "h264_ssim": h264_ssim,
            "h264_bits_per_s": h264_bits,
            "jpeg_quality": quality,
            "ssim": jpeg_points[quality][1],
            "bits_per_s": jpeg_points[quality][0],
            "ratio_bits_jpeg_over_h264": jpeg_points[quality][0] / h264_bits,
        },
    }


def run_media_bench(
    *,
    width: int,
    height: int,
    fps: float,
    frames_per_chunk: int,
    chunks: int,
    contents: tuple[str, ...] = CONTENTS,
    jpeg_quality: int = 85,
    crf: int = 23,
    preset: str = "veryfast",
    threads: int = 1,
    encoder_name: str = "libx264",
    repeats: int = 3,
    seed: int = 0,
    match_quality: bool = True,
) -> dict[str, Any]:
    encoder = FragmentEncoder(encoder_name, H264Options(preset=preset, crf=crf, threads=threads))
    count = chunks * frames_per_chunk
    figures: dict[str, Any] = {}
    for content in contents:
        if content == "photo":
            frames = photo_frames(width, height, count)
        elif content == "demo":
            frames = demo_frames(width, height, count, frames_per_chunk, seed=seed)
        else:
            raise ValueError(f"unknown content {content!r}; choose from {', '.join(CONTENTS)}")
        figures[content] = measure_content(
            frames,
            fps=fps,
            frames_per_chunk=frames_per_chunk,
            jpeg_quality=jpeg_quality,
            encoder=encoder,
            repeats=repeats,
        )
        if match_quality:
            figures[content]["matched"] = matched_quality(
                frames,
                fps=fps,
                frames_per_chunk=frames_per_chunk,
                jpeg_quality=jpeg_quality,
                options=encoder.options,
                encoder=encoder_name,
            )
    headline = figures[contents[0]]
    return {
        "benchmark": "media",
        "settings": {
            "width": width,
            "height": height,
            "fps": fps,
            "frames_per_chunk": frames_per_chunk,
            "chunks": chunks,
            "jpeg_quality": jpeg_quality,
            "h264": {"encoder": encoder_name, "preset": preset, "crf": crf, "threads": threads},
            "repeats": repeats,
            "headline_content": contents[0],
        },
        # The headline keys are the first content's (the photograph by default).
        "jpeg": headline["jpeg"],
        "h264": headline["h264"],
        "ratio_bits_jpeg_over_h264": headline["jpeg"]["bits_per_s"] / headline["h264"]["bits_per_s"],
        "chunk_budget_ms": 1000.0 * frames_per_chunk / fps,
        "contents": figures,
    }


def format_media_bench(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"media: {s['width']}x{s['height']} at {s['fps']:g} fps, {s['frames_per_chunk']} frames per chunk, "
        f"{s['chunks']} chunks; JPEG q{s['jpeg_quality']}; H.264 {s['h264']['encoder']} "
        f"{s['h264']['preset']} CRF {s['h264']['crf']}, {s['h264']['threads']} thread(s); "
        f"chunk budget {report['chunk_budget_ms']:.0f} ms",
        f"{'content':<8} {'codec':<5} {'Mbit/s':>8} {'KiB/chunk':>10} {'enc p50 ms':>11} {'enc p99 ms':>11} "
        f"{'PSNR dB':>8} {'SSIM':>6}",
    ]
    for content, figures in report["contents"].items():
        for codec in ("jpeg", "h264"):
            f = figures[codec]
            lines.append(
                f"{content:<8} {codec:<5} {f['bits_per_s'] / 1e6:>8.2f} {f['bytes_per_chunk'] / 1024:>10.1f} "
                f"{f['encode_ms_p50']:>11.1f} {f['encode_ms_p99']:>11.1f} {f['psnr_db']:>8.2f} {f['ssim']:>6.3f}"
            )
    lines.append(
        f"JPEG / H.264 bits ({report['settings']['headline_content']}): {report['ratio_bits_jpeg_over_h264']:.2f}x"
    )
    for content, figures in report["contents"].items():
        matched = figures.get("matched") or {}
        at_jpeg, at_h264 = matched.get("h264_at_jpeg_ssim"), matched.get("jpeg_at_h264_ssim")
        if at_jpeg:
            lines.append(
                f"{content}: at JPEG q{at_jpeg['jpeg_quality']}'s SSIM {at_jpeg['jpeg_ssim']:.4f} H.264 needs "
                f"CRF {at_jpeg['crf']} (SSIM {at_jpeg['ssim']:.4f}): {at_jpeg['bits_per_s'] / 1e6:.2f} against "
                f"{at_jpeg['jpeg_bits_per_s'] / 1e6:.2f} Mbit/s, {at_jpeg['ratio_bits_jpeg_over_h264']:.2f}x fewer bits"
            )
        if at_h264:
            lines.append(
                f"{content}: at H.264 CRF {at_h264['crf']}'s SSIM {at_h264['h264_ssim']:.4f} JPEG needs "
                f"q{at_h264['jpeg_quality']} (SSIM {at_h264['ssim']:.4f}): {at_h264['bits_per_s'] / 1e6:.2f} against "
                f"{at_h264['h264_bits_per_s'] / 1e6:.2f} Mbit/s, {at_h264['ratio_bits_jpeg_over_h264']:.2f}x more bits"
            )
    return "\n".join(lines)
