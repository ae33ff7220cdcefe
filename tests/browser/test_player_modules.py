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
