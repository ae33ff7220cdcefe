"""The generation page playing a session over WebRTC in Chromium: the server's aiortc peer connection
(in the media process beside the web process), signalled over the session socket, sending the
worker's H.264 as it was encoded (no re-encoding)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import h264_media, screenshot
from tests.browser.test_generate_page import _watch_executing_session

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    # The peer connections run in the media process beside the server, as deployed.
    pytest.mark.usefixtures("media_server"),
]

# Mean colour of what the WebRTC <video> presents now, and the player's counters.
RTC_SAMPLE = """() => {
  const v = document.getElementById('rtc-video');
  const c = document.createElement('canvas');
  c.width = v.videoWidth || 1; c.height = v.videoHeight || 1;
  const ctx = c.getContext('2d');
  ctx.drawImage(v, 0, 0);
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  let r = 0, g = 0, b = 0;
  for (let i = 0; i < d.length; i += 4) { r += d[i]; g += d[i + 1]; b += d[i + 2]; }
  const n = d.length / 4;
  const s = window.streamserve.player.stats;
  return {r: r / n, g: g / n, b: b / n, width: v.videoWidth, height: v.videoHeight, currentTime: v.currentTime,
          shown: s.framesShown, decoded: s.decodedFrames, chunk: v.dataset.chunk, errors: s.decodeErrors};
}"""


def _send(worker_stand_in, session, index: int, hue: int) -> None:
    worker_stand_in.chunk(
        session,
        index=index,
        frames=[],
        worker="gpu-a",
        generation_ms=400.0,
        media=h264_media(session, index=index, hue=hue),
    )


def test_a_session_plays_over_webrtc(browser_context, asgi_server, worker_stand_in, page_problems):
    # Given a viewer that picked WebRTC, watching an executing session
    session, page = _watch_executing_session(
        browser_context, asgi_server, page_problems, username="rtc", url="&codec=webrtc"
    )
    expect(page.locator("#stat-codec")).to_have_text("H.264 (WebRTC)")
    expect(page.locator("#rtc-video")).to_be_visible()
    expect(page.locator("#mse-video")).to_be_hidden()
    page.wait_for_function("window.streamserve.player.stats.connectionState === 'connected'")

    # When the worker sends H.264 fragments (red, then blue)
    for index, hue in ((0, 0), (1, 1)):
        _send(worker_stand_in, session, index, hue)

    # Then the <video> plays them: pictures presented, time advances, blue once chunk 1 shows
    page.wait_for_function(
        "document.getElementById('rtc-video').dataset.chunk === '1'"
        f" && window.streamserve.player.stats.framesShown > {session.frames_per_chunk}"
    )
    page.wait_for_timeout(150)  # a frame or two into chunk 1
    first = page.evaluate(RTC_SAMPLE)
    assert (first["width"], first["height"]) == (session.width, session.height), first
    assert first["currentTime"] > 0 and first["b"] > first["r"] + 60, first
    expect(page.locator("#stat-chunk")).to_have_text("#1")
    expect(page.locator("#player-overlay")).to_be_hidden()

    # and after a skipped chunk (a gap in the session's timeline) the next one plays: green
    _send(worker_stand_in, session, 3, 2)
    page.wait_for_function("document.getElementById('rtc-video').dataset.chunk === '3'")
    page.wait_for_timeout(150)
    later = page.evaluate(RTC_SAMPLE)
    assert later["g"] > later["r"] + 60 and later["shown"] > first["shown"], later
    assert later["errors"] == 0, later
    expect(page.locator("#stat-codec")).to_have_text("H.264 (WebRTC)")  # no fallback happened
    screenshot(page, "generate-webrtc")
    page_problems.assert_clean()


# Rewrites the page's offers on their way out so that they cannot receive H.264 (a browser without
# it): the server refuses them with a bad_sdp error frame.
OFFER_WITHOUT_H264 = """
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  if (typeof data === 'string' && data.includes('"webrtc.offer"')) {
    const message = JSON.parse(data);
    message.sdp = message.sdp.split('\\r\\n').filter((line) => !/ H264\\//.test(line)).join('\\r\\n');
    data = JSON.stringify(message);
  }
  return send.call(this, data);
};
"""


def test_a_refused_offer_falls_back_to_the_socket(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    # Given a viewer that picked WebRTC in a browser whose offer the server cannot answer with H.264
    browser_context.add_init_script(OFFER_WITHOUT_H264)
    session, page = _watch_executing_session(
        browser_context, asgi_server, page_problems, username="rtc-refused", url="&codec=webrtc"
    )

    # Then the page says why and carries on over the socket, through MSE
    expect(page.locator("#stat-codec")).to_have_text("H.264 (MSE)")
    expect(page.locator("#codec-note")).to_contain_text("WebRTC failed")
    expect(page.locator("#page-message")).to_contain_text("H.264")
    expect(page.locator("#mse-video")).to_be_visible()
    expect(page.locator("#rtc-video")).to_be_hidden()
    expect(page.locator("#connection-state")).to_have_text("Live")
    _send(worker_stand_in, session, 0, 1)
    page.wait_for_function("document.getElementById('mse-video').dataset.chunk === '0'")
    page_problems.assert_clean()
