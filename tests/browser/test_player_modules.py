"""The pages' pure parts, run in Chromium: the player's wire format against the server's encoder, rate
matching; money and chart-axis formatting."""

from __future__ import annotations

import base64

import pytest

from contracts.wire.frames import encode_chunk_frame
from tests.browser.conftest import jpeg_frames

pytestmark = pytest.mark.browser


@pytest.fixture
def module_page(browser, asgi_server):
    context = browser.new_context(base_url=asgi_server)
    page = context.new_page()
    page.goto("/accounts/login/")  # any page of the app: modules load from its origin
    yield page
    context.close()


def test_the_browser_parses_what_the_server_encodes(module_page):
    frames = jpeg_frames(64, 48, 3, hue=1)
    header = {
        "session": "s-1",
        "index": 7,
        "generation_ms": 123.5,
        "worker": "gpu-a",
        "width": 64,
        "height": 48,
    }
    wire = base64.b64encode(encode_chunk_frame(header, frames)).decode()

    parsed = module_page.evaluate(
        """async (wire) => {
            const { parseChunkFrame } = await import('/static/js/protocol.js');
            const bytes = Uint8Array.from(atob(wire), (c) => c.charCodeAt(0));
            const { header, frames } = parseChunkFrame(bytes.buffer);
            const bitmaps = await Promise.all(frames.map((f) => createImageBitmap(new Blob([f], { type: 'image/jpeg' }))));
            return { header, lengths: frames.map((f) => f.length), sizes: bitmaps.map((b) => [b.width, b.height]) };
        }""",
        wire,
    )

    assert parsed["header"]["index"] == 7 and parsed["header"]["worker"] == "gpu-a"
    assert parsed["lengths"] == [len(f) for f in frames]
    assert parsed["sizes"] == [[64, 48]] * 3


def test_the_browser_parses_an_h264_chunk_with_its_init_segment(module_page):
    # Given an H.264 chunk as the session socket sends it to an H.264 viewer (init segment first)
    mime, init, fragments = _fragments([3])
    init_bytes, fragment_bytes = base64.b64decode(init), base64.b64decode(fragments[3])
    header = {"session": "s-1", "index": 3, "codec": "h264", "mime": mime, "init": True, "epoch": 2}
    wire = base64.b64encode(encode_chunk_frame(header, [init_bytes, fragment_bytes])).decode()

    # When the page parses it
    parsed = module_page.evaluate(
        """async (wire) => {
            const { parseChunkFrame } = await import('/static/js/protocol.js');
            const bytes = Uint8Array.from(atob(wire), (c) => c.charCodeAt(0));
            const { header, frames } = parseChunkFrame(bytes.buffer);
            const box = (f) => String.fromCharCode(...f.slice(4, 8));
            return { header, lengths: frames.map((f) => f.length), boxes: frames.map(box) };
        }""",
        wire,
    )

    # Then the new header fields come through and the payloads are the init segment and the fragment
    assert parsed["header"]["codec"] == "h264" and parsed["header"]["init"] is True
    assert parsed["header"]["mime"] == mime and mime.startswith('video/mp4; codecs="avc1.')
    assert parsed["lengths"] == [len(init_bytes), len(fragment_bytes)]
    assert parsed["boxes"] == ["ftyp", "moof"]


def test_truncated_frames_are_refused_with_a_reason(module_page):
    wire = encode_chunk_frame({"index": 1}, jpeg_frames(16, 16, 2, hue=0))
    truncated = base64.b64encode(wire[:-10]).decode()

    message = module_page.evaluate(
        """async (wire) => {
            const { parseChunkFrame } = await import('/static/js/protocol.js');
            const bytes = Uint8Array.from(atob(wire), (c) => c.charCodeAt(0));
            try { parseChunkFrame(bytes.buffer); return null; } catch (err) { return err.message; }
        }""",
        truncated,
    )

    assert message == "frame lengths do not match the frame's size"


def test_rate_matching_slows_down_only_for_a_slow_producer(module_page):
    rates = module_page.evaluate(
        """async () => {
            const { playbackRate, smoothArrival } = await import('/static/js/player.js');
            const chunkMs = 500;
            return {
                realtime: playbackRate({ arrivalMs: 500, chunkMs, bufferedChunks: 0.5 }),
                slow: playbackRate({ arrivalMs: 600, chunkMs, bufferedChunks: 0.5 }),
                verySlow: playbackRate({ arrivalMs: 5000, chunkMs, bufferedChunks: 0.5 }),
                slowButBuffered: playbackRate({ arrivalMs: 600, chunkMs, bufferedChunks: 2 }),
                unknown: playbackRate({ arrivalMs: 0, chunkMs, bufferedChunks: 0 }),
                smoothed: smoothArrival(500, 600, chunkMs),
                pauseIgnored: smoothArrival(500, 30000, chunkMs),
                first: smoothArrival(0, 450, chunkMs),
            };
        }"""
    )

    assert rates["realtime"] == 1 and rates["unknown"] == 1 and rates["slowButBuffered"] == 1
    assert rates["slow"] == pytest.approx(1.2)
    assert rates["verySlow"] == 1.5  # never slower than 1/1.5 of real time
    assert rates["smoothed"] == pytest.approx(530)
    assert rates["pauseIgnored"] == 500 and rates["first"] == 450


def test_money_keeps_the_digits_its_size_needs(module_page):
    shown = module_page.evaluate(
        """async () => {
            const { formatUsd } = await import('/static/js/common.js');
            return [0.002, "0.002000", 0.0123, 0.0199999, 0.5, 0.12345, 0, 12.345, 999.5, 1234.4, -0.002, null]
                .map(formatUsd);
        }"""
    )

    assert shown == [
        "$0.002",  # a tenth of a cent is not $0.00
        "$0.002",  # the API's decimal strings
        "$0.0123",
        "$0.02",
        "$0.50",
        "$0.123",
        "$0.00",
        "$12.35",
        "$999.50",
        "$1,234",
        "-$0.002",
        "–",
    ]


def test_axis_ticks_take_their_decimals_from_the_step(module_page):
    ticks = module_page.evaluate(
        """async () => {
            const { tickLabels } = await import('/static/js/charts.js');
            return {
                tiny: tickLabels([0, 0.0005, 0.001, 0.0015, 0.002], 0.0005),
                quarter: tickLabels([0, 0.25, 0.5, 0.75], 0.25),
                large: tickLabels([0, 500, 1000, 1500], 500),
            };
        }"""
    )

    assert ticks["tiny"] == ["0.0000", "0.0005", "0.0010", "0.0015", "0.0020"]
    assert len(set(ticks["tiny"])) == len(ticks["tiny"])
    assert ticks["quarter"] == ["0.00", "0.25", "0.50", "0.75"]
    assert ticks["large"] == ["0", "500", "1,000", "1,500"]


def _fragments(indices, *, size=(48, 64), frames_per_chunk=4, fps=8):
    """Real H.264 fragments (what a worker sends) for chunks ``indices``: (mime, init, {index: fragment}),
    base64. Each chunk is a flat colour that changes with its index."""
    import numpy as np

    from workers.runtime.media import FragmentEncoder

    encoder, fragments, init, mime = FragmentEncoder(), {}, None, None
    height, width = size
    for index in indices:
        frames = np.zeros((frames_per_chunk, height, width, 3), dtype=np.uint8)
        frames[..., index % 3] = 200
        fragment = encoder.encode(frames, fps=fps, chunk_index=index)
        init, mime = fragment.init, fragment.mime
        fragments[index] = base64.b64encode(fragment.data).decode()
    return mime, base64.b64encode(init).decode(), fragments


MSE_PLAY = """async ({ mime, init, fragments, order, fps, framesPerChunk, until, options }) => {
    const { MsePlayer } = await import('/static/js/player.js');
    const bytes = (b64) => Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const video = document.createElement('video');
    document.body.append(video);
    let last = null;
    const errors = [];
    const player = new MsePlayer(video, { ...options, onState: (s) => { last = s; }, onError: (e) => errors.push(e) });
    player.configure({ fps, framesPerChunk });
    let first = true;
    for (const index of order) {
        const header = { type: 'chunk', index, fps, codec: 'h264', mime, init: first };
        const frames = first ? [bytes(init), bytes(fragments[index])] : [bytes(fragments[index])];
        first = false;
        await player.pushChunk(header, frames);
    }
    const rangesOf = (b) => Array.from({ length: b.length }, (_, i) => [b.start(i), b.end(i)]);
    const appended = rangesOf(video.buffered);
    const deadline = performance.now() + 8000;
    while (video.currentTime < until && performance.now() < deadline && !errors.length) {
        await new Promise((r) => setTimeout(r, 50));
    }
    const result = { currentTime: video.currentTime, appended, ranges: rangesOf(video.buffered), errors, stats: last };
    player.destroy();
    video.remove();
    return result;
}"""


def test_mse_player_plays_fragments_and_jumps_over_a_skipped_chunk(module_page):
    # Given chunks 0, 1, 3, 4 of a session (chunk 2 skipped for a slow client), 4 frames at 8 fps
    mime, init, fragments = _fragments([0, 1, 3, 4])
    chunk_s = 0.5

    # When they are played in order
    played = module_page.evaluate(
        MSE_PLAY,
        {
            "mime": mime,
            "init": init,
            "fragments": {str(k): v for k, v in fragments.items()},
            "order": [0, 1, 3, 4],
            "fps": 8,
            "framesPerChunk": 4,
            "until": 4 * chunk_s + 0.2,
            # Latency is not bounded here: it would seek past the hole before playback reaches it.
            "options": {"maxBehindChunks": 10},
        },
    )

    # Then the hole at chunk 2 is jumped over and playback reaches chunk 4, frames decoded and shown
    assert played["errors"] == [], played
    assert played["appended"] == [
        [pytest.approx(0, abs=0.01), pytest.approx(2 * chunk_s, abs=0.01)],
        [pytest.approx(3 * chunk_s, abs=0.01), pytest.approx(5 * chunk_s, abs=0.01)],
    ], played
    assert played["currentTime"] > 4 * chunk_s, played
    stats = played["stats"]
    assert stats["decodedFrames"] > 0 and stats["framesShown"] > 0, stats
    assert stats["chunksDecoded"] == 4 and stats["decodeErrors"] == 0, stats
    assert stats["seeks"] == 1 and stats["stalls"] <= 1, stats  # the jump over the hole


def test_mse_player_starts_a_late_viewer_at_its_first_chunk(module_page):
    # Given a viewer that joins at chunk 6 of a session
    mime, init, fragments = _fragments([6, 7])

    # When its first fragments are played
    played = module_page.evaluate(
        MSE_PLAY,
        {
            "mime": mime,
            "init": init,
            "fragments": {str(k): v for k, v in fragments.items()},
            "order": [6, 7],
            "fps": 8,
            "framesPerChunk": 4,
            "until": 6 * 0.5 + 0.3,
            "options": {},
        },
    )

    # Then playback starts at chunk 6's time, not at 0 (waiting for media that will never come)
    assert played["errors"] == [], played
    assert played["appended"][0][0] == pytest.approx(3.0, abs=0.01), played
    assert played["currentTime"] > 3.3, played
    assert played["stats"]["shownChunkIndex"] in (6, 7), played


def test_mse_player_reports_a_fragment_the_browser_refuses(module_page):
    # Given a valid init segment followed by bytes that are no fragment
    mime, init, _ = _fragments([0])

    outcome = module_page.evaluate(
        """async ({ mime, init }) => {
            const { MsePlayer } = await import('/static/js/player.js');
            const bytes = (b64) => Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const video = document.createElement('video');
            const errors = [];
            let last = null;
            const player = new MsePlayer(video, { onState: (s) => { last = s; }, onError: (e) => errors.push(e) });
            const header = { type: 'chunk', index: 0, fps: 8, codec: 'h264', mime, init: true };
            let rejected = null;
            try {
                await player.pushChunk(header, [bytes(init), new Uint8Array([0, 0, 0, 16, 109, 111, 111, 102, 1, 2, 3, 4, 5, 6, 7, 8])]);
            } catch (err) { rejected = err.message; }
            player.destroy();
            return { errors, rejected, decodeErrors: last.decodeErrors };
        }""",
        {"mime": mime, "init": init},
    )

    # Then the chunk is refused and the page is told (it falls back to JPEG on this)
    assert outcome["rejected"] and outcome["errors"], outcome
    assert outcome["decodeErrors"] >= 1, outcome


def test_live_seek_target_keeps_latency_bounded_and_skips_holes(module_page):
    targets = module_page.evaluate(
        """async () => {
            const { liveSeekTarget } = await import('/static/js/player.js');
            const ranges = (...pairs) => ({ length: pairs.length, start: (i) => pairs[i][0], end: (i) => pairs[i][1] });
            const chunkS = 0.75;
            return {
                inRange: liveSeekTarget(ranges([0, 1.5]), 0.5, { chunkS }),
                inHole: liveSeekTarget(ranges([0, 1.5], [2.25, 3.0]), 1.5, { chunkS }),
                lateJoiner: liveSeekTarget(ranges([37.5, 38.25]), 0, { chunkS }),
                behindLive: liveSeekTarget(ranges([0, 6]), 1, { chunkS }),
                atTheEdge: liveSeekTarget(ranges([0, 1.5]), 1.5, { chunkS }),
                empty: liveSeekTarget(ranges(), 0, { chunkS }),
            };
        }"""
    )

    assert targets["inRange"] is None and targets["atTheEdge"] is None and targets["empty"] is None
    assert targets["inHole"] == 2.25
    assert targets["lateJoiner"] == 37.5
    assert targets["behindLive"] == 5.25
