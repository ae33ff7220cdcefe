"""The live H.264 fragments: one closed GOP per chunk, one init segment per session, a continuous
timeline that a viewer may join at any chunk (workers/runtime/media.py)."""

from __future__ import annotations

import io
import logging

import av
import numpy as np
import pytest

from workers.runtime.media import (
    FragmentEncoder,
    H264Options,
    decode_fragments,
    fragment_decode_time,
    media_timescale,
    mime_type,
    select_h264_encoder,
)

FPS, PER_CHUNK = 16, 12


def moving_square(chunk: int, *, width: int = 96, height: int = 64) -> np.ndarray:
    """A chunk of frames whose index can be read back after lossy coding: the square's column."""
    frames = np.zeros((PER_CHUNK, height, width, 3), np.uint8)
    frames[..., 2] = 90
    for i in range(PER_CHUNK):
        x = ((chunk * PER_CHUNK + i) * 2) % (width - 16)
        frames[i, 20:36, x : x + 16] = (250, 250, 40)
    return frames


def square_column(frame: np.ndarray) -> int:
    yellow = (frame[..., 0] > 160) & (frame[..., 1] > 160) & (frame[..., 2] < 120)
    return int(np.flatnonzero(yellow.any(axis=0))[0])


@pytest.fixture(scope="module")
def fragments():
    encoder = FragmentEncoder("libx264", H264Options(threads=1))
    return [encoder.encode(moving_square(c), fps=FPS, chunk_index=c) for c in range(4)]


def test_every_chunk_of_a_session_has_the_same_init_segment_and_an_avc1_mime(fragments):
    assert len({f.init for f in fragments}) == 1
    assert fragments[0].init[4:8] == b"ftyp" and b"moov" in fragments[0].init
    assert mime_type(fragments[0].init).startswith('video/mp4; codecs="avc1.')
    assert all(f.data[4:8] == b"moof" and f.data.count(b"moof") == 1 for f in fragments)


def test_fragments_sit_on_one_timeline(fragments):
    ticks_per_frame = media_timescale(fragments[0].init) // FPS
    assert [fragment_decode_time(f.data) for f in fragments] == [
        c * PER_CHUNK * ticks_per_frame for c in range(4)
    ]
    frames, pts = decode_fragments(fragments[0].init, [f.data for f in fragments])
    assert pts == list(range(4 * PER_CHUNK))
    assert [square_column(f) for f in frames] == [
        square_column(f) for c in range(4) for f in moving_square(c)
    ]


@pytest.mark.parametrize("join_at", [1, 3])
def test_a_viewer_joins_at_any_chunk_and_its_first_frame_is_a_keyframe(fragments, join_at):
    joined = fragments[0].init + b"".join(f.data for f in fragments[join_at:])
    with av.open(io.BytesIO(joined), format="mp4") as container:
        decoded = list(container.decode(video=0))
    assert len(decoded) == (4 - join_at) * PER_CHUNK
    assert decoded[0].key_frame
    # One closed GOP per chunk: a keyframe opens each chunk and none sits inside one.
    assert [i for i, frame in enumerate(decoded) if frame.key_frame] == list(
        range(0, len(decoded), PER_CHUNK)
    )
    frames, pts = decode_fragments(fragments[0].init, [f.data for f in fragments[join_at:]])
    assert pts[0] == join_at * PER_CHUNK
    assert square_column(frames[0]) == square_column(moving_square(join_at)[0])


def test_a_chunk_from_another_encoder_instance_continues_the_stream(fragments):
    # As after a migration: another worker's encoder picks up at the next chunk, no state moved.
    other = FragmentEncoder("libx264", H264Options(threads=1)).encode(
        moving_square(4), fps=FPS, chunk_index=4
    )
    assert other.init == fragments[0].init
    frames, pts = decode_fragments(fragments[0].init, [*(f.data for f in fragments), other.data])
    assert pts == list(range(5 * PER_CHUNK))
    assert square_column(frames[-1]) == square_column(moving_square(4)[-1])


def test_odd_sides_are_padded_to_what_yuv420p_takes():
    fragment = FragmentEncoder("libx264").encode(
        np.full((PER_CHUNK, 35, 51, 3), 128, np.uint8), fps=FPS, chunk_index=0
    )
    frames, _ = decode_fragments(fragment.init, [fragment.data])
    assert frames.shape == (PER_CHUNK, 36, 52, 3)


def test_a_gpu_worker_without_a_usable_nvenc_falls_back_to_x264_and_says_why(caplog):
    with caplog.at_level(logging.WARNING, logger="workers.runtime.media"):
        assert select_h264_encoder(gpu=True, available={"libx264"}) == "libx264"
    assert "h264_nvenc is not in this FFmpeg build" in caplog.text
    assert select_h264_encoder(gpu=False) in ("libx264", "libopenh264")


def test_a_fragment_placed_at_another_index_is_the_one_encoded_there():
    from workers.runtime.media import FragmentEncoder, decode_fragments, fragment_placed

    # Given a chunk encoded as chunk 0
    frames = np.full((4, 32, 32, 3), 90, np.uint8)
    encoder = FragmentEncoder()
    first = encoder.encode(frames, fps=16, chunk_index=0)
    # When it is placed at chunk 5 (bench_delivery and bench_glass re-send a few encoded chunks)
    placed = fragment_placed(first, chunk_index=5, fps=16)
    # Then it is byte for byte the fragment encoded as chunk 5, and a run of them decodes in order
    assert placed == encoder.encode(frames, fps=16, chunk_index=5).data
    _, pts = decode_fragments(first.init, [fragment_placed(first, chunk_index=k, fps=16) for k in (0, 1, 2)])
    assert pts == list(range(12))
