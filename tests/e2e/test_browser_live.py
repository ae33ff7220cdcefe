"""The generation page in real Chromium against the whole real platform (no stand-in for any part):
uvicorn, Celery worker + beat, the local provisioner's CPU worker generating the frames, encoded as
H.264 (played through MSE) and, once the user picks them, as JPEG and over WebRTC."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.conf import settings
from playwright.sync_api import expect, sync_playwright

from sessions.models import GenerationSession
from tests.factories import UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db]

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# What the <video> (H.264) or the canvas (JPEG) shows now.
SAMPLE = """(id) => {
  const surface = document.getElementById(id);
  let c = surface;
  if (surface.tagName === 'VIDEO') {
    c = document.createElement('canvas');
    c.width = surface.videoWidth; c.height = surface.videoHeight;
    c.getContext('2d').drawImage(surface, 0, 0);
  }
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let sum = 0, lit = 0;
  for (let i = 0; i < d.length; i += 4) { sum += d[i] + 2 * d[i + 1] + 3 * d[i + 2]; if (d[i] + d[i+1] + d[i+2] > 30) lit++; }
  return {checksum: sum, lit: lit / (d.length / 4), chunk: Number(surface.dataset.chunk)};
}"""

# The platform fixture starts a media process for this module: it plays WebRTC.
PLATFORM_MEDIA = True


@pytest.fixture(scope="module")
def creator(platform, django_db_blocker):
    with django_db_blocker.unblock():
        return UserFactory(username="live-creator")


def test_a_real_worker_streams_frames_that_render_and_change(platform, creator):
    assert Path(CHROMIUM).exists(), "run scripts/ensure_test_tools.sh (apt-get install chromium)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(base_url=platform.url, viewport={"width": 1280, "height": 800})
        page.goto("/")
        page.get_by_label("Username").fill(creator.username)
        page.get_by_label("Password").fill("pw-for-tests-1")
        page.get_by_role("button", name="Log in").click()
        page.get_by_label("Prompt", exact=True).fill("a paper boat on a river")
        page.get_by_role("button", name="Start").click()
        expect(page).to_have_url(re.compile(r"\?session="), timeout=15_000)
        expect(page.locator("#session-state")).to_have_text("Executing", timeout=90_000)
        expect(page.locator("#stat-codec")).to_have_text("H.264 (MSE)")
        first, _ = _two_pictures(page, "mse-video")
        # The MIME the worker's encoder sent, played by this browser (x264's High profile)
        mime = page.evaluate("window.streamserve.player.mime")
        assert mime.startswith('video/mp4; codecs="avc1.64'), mime
        assert (
            page.evaluate("document.getElementById('mse-video').getVideoPlaybackQuality().totalVideoFrames")
            > 0
        )
        artifacts = Path(settings.BASE_DIR) / "artifacts" / "screenshots"
        artifacts.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(artifacts / "generate-real-worker.png"))

        # The user picks JPEG: the worker encodes JPEG again for this viewer and the canvas plays it
        page.get_by_label("Play as").select_option("jpeg")
        expect(page.locator("#stat-codec")).to_have_text("JPEG")
        _two_pictures(page, "video")

        # and then WebRTC: the web process sends the worker's H.264 over a peer connection
        page.get_by_label("Play as").select_option("webrtc")
        expect(page.locator("#stat-codec")).to_have_text("H.264 (WebRTC)")
        _two_pictures(page, "rtc-video")
        assert page.evaluate("window.streamserve.player.stats.decodeErrors") == 0
        browser.close()
    session = GenerationSession.objects.get(owner=creator)
    assert session.worker is not None and session.worker.name.startswith("local-cpu")
    assert session.chunks.count() >= first["chunk"]


def _two_pictures(page, surface: str):
    """Two pictures ``surface`` shows two chunks apart: drawn (not blank) and different."""
    page.wait_for_function(f"Number(document.getElementById('{surface}').dataset.chunk) >= 1", timeout=60_000)
    first = page.evaluate(SAMPLE, surface)
    page.wait_for_function(
        f"Number(document.getElementById('{surface}').dataset.chunk) >= {first['chunk'] + 2}", timeout=60_000
    )
    later = page.evaluate(SAMPLE, surface)
    assert first["lit"] > 0.5 and later["lit"] > 0.5, (first, later)  # frames drawn, not a blank surface
    assert later["checksum"] != first["checksum"]  # the picture changes from chunk to chunk
    return first, later
