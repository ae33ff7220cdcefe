"""The generation page in Chromium: log in, start a session, watch real frames, steer it, survive a blip."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from contracts.catalog import PRESETS
from gpu.models import GpuWorker
from sessions.models import GenerationSession, Prompt
from tests.browser.conftest import PASSWORD, h264_media, jpeg_frames, log_in, screenshot
from tests.factories import GpuWorkerFactory, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TINY = PRESETS["tiny"]

# Mean colour and the share of non-black pixels of what the canvas shows right now.
CANVAS_SAMPLE = """() => {
  const c = document.getElementById('video');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let r = 0, g = 0, b = 0, lit = 0;
  for (let i = 0; i < d.length; i += 4) {
    r += d[i]; g += d[i + 1]; b += d[i + 2];
    if (d[i] + d[i + 1] + d[i + 2] > 60) lit += 1;
  }
  const n = d.length / 4;
  return {r: r / n, g: g / n, b: b / n, lit: lit / n, chunk: c.dataset.chunk, shown: Number(c.dataset.framesShown || 0)};
}"""


def _session_from_url(page) -> GenerationSession:
    match = re.search(r"session=([0-9a-f-]{36})", page.url)
    assert match, page.url
    return GenerationSession.objects.select_related("worker").get(pk=match.group(1))


def _execute_on(session: GenerationSession, worker: GpuWorker) -> GenerationSession:
    """What the scheduler does on placement, minus the scheduler."""
    GenerationSession.objects.filter(pk=session.pk).update(
        status="executing", worker=worker, host_worker=None, state_location="worker", queue_position=None
    )
    return GenerationSession.objects.select_related("worker").get(pk=session.pk)


def _wait_for_chunk(page, index: int):
    page.wait_for_function(f"document.getElementById('video').dataset.chunk === '{index}'")
    return page.evaluate(CANVAS_SAMPLE)


def test_log_in_start_watch_steer_pause_resume_and_reconnect(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    user = UserFactory(username="creator")
    gpu = GpuWorkerFactory(name="gpu-a")
    page = browser_context.new_page()
    page_problems.watch(page)

    # Log in through the form.
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/accounts/login/\?next=/"))
    page.get_by_label("Username").fill(user.username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(f"{asgi_server}/")
    # This test reads the JPEG canvas: JPEG forced from the URL (H.264 has its own tests below).
    page.goto("/?codec=jpeg")
    expect(page.locator("#stat-codec")).to_have_text("JPEG")

    # A bad request shows the API's field error next to the field.
    expect(page.locator("#start-model option")).not_to_have_count(0)
    expect(page.get_by_role("button", name="Start")).to_be_enabled()
    page.get_by_label("Prompt", exact=True).fill("   ")
    page.get_by_role("button", name="Start").click()
    expect(page.locator("#start-prompt-error")).to_contain_text("must not be empty")
    expect(page.locator("#page-message")).to_contain_text("correct the highlighted fields")

    # Start a session: it is queued until a worker takes it.
    page.get_by_label("Prompt", exact=True).fill("a lighthouse in a storm")
    page.get_by_label("Model").select_option("tiny")
    page.get_by_label("Resolution").select_option(TINY.default_resolution)
    page.get_by_role("button", name="Start").click()
    expect(page).to_have_url(re.compile(r"\?session="))
    session = _session_from_url(page)
    assert (session.owner, session.model_name, session.resolution) == (user, "tiny", TINY.default_resolution)
    expect(page.locator("#session-state")).to_contain_text("Queued")
    expect(page.locator("#connection-state")).to_have_text("Live")
    expect(page.locator("#session-list li[aria-current='true']")).to_contain_text("a lighthouse in a storm")

    # Placed on a worker: status over the socket, then real JPEG chunks.
    session = _execute_on(session, gpu)
    worker_stand_in.status(session)
    expect(page.locator("#session-state")).to_have_text("Executing")
    expect(page.locator("#session-where")).to_contain_text("on gpu-a")
    worker_stand_in.chunk(
        session,
        index=0,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=0),
        worker="gpu-a",
        generation_ms=412.0,
    )
    worker_stand_in.chunk(
        session,
        index=1,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=1),
        worker="gpu-a",
        generation_ms=388.0,
    )
    first = _wait_for_chunk(page, 0)
    second = _wait_for_chunk(page, 1)
    assert first["lit"] > 0.9 and second["lit"] > 0.9, (first, second)  # frames drawn, not a blank surface
    assert first["r"] > first["b"] + 60 and second["b"] > second["r"] + 60, (
        first,
        second,
    )  # red chunk, then blue
    expect(page.locator("#stat-chunk")).to_have_text("#1")
    expect(page.locator("#stat-generation")).to_have_text("388 ms")
    expect(page.locator("#stat-batch")).to_have_text("1 on gpu-a")
    expect(page.locator("#player-overlay")).to_be_hidden()
    screenshot(page, "generate")

    # A new prompt applies from the next chunk.
    page.get_by_label(re.compile("New prompt")).fill("the storm clears, sunrise")
    page.get_by_role("button", name="Apply prompt").click()
    expect(page.locator("#prompt-status")).to_contain_text("applies from chunk")
    prompt = Prompt.objects.filter(session=session).latest("id")
    assert prompt.text == "the storm clears, sunrise"

    # Pause: the session goes idle; the scheduler parks it; the page says so.
    page.get_by_role("button", name="Pause").click()
    expect(page.get_by_role("button", name="Resume")).to_be_enabled()
    session.refresh_from_db()
    assert session.activity == "idle"
    GenerationSession.objects.filter(pk=session.pk).update(
        status="suspended", worker=None, host_worker=gpu, state_location="host"
    )
    session.refresh_from_db()
    worker_stand_in.status(session)
    expect(page.locator("#session-state")).to_have_text("Paused — parked in host memory")

    # Resume: active again, executing again, and the stream continues at the next chunk.
    page.get_by_role("button", name="Resume").click()
    expect(page.get_by_role("button", name="Pause")).to_be_enabled()
    session.refresh_from_db()
    assert session.activity == "active"
    session = _execute_on(session, gpu)
    worker_stand_in.status(session)
    expect(page.locator("#session-state")).to_have_text("Executing")
    worker_stand_in.chunk(
        session,
        index=2,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=2),
        worker="gpu-a",
        generation_ms=401.0,
    )
    third = _wait_for_chunk(page, 2)
    assert third["g"] > third["r"] + 60, third

    # A stalled stream: the socket stays open but nothing arrives (a wedged proxy, a half-dead
    # network path). The watchdog notices the silence, drops the socket and reconnects with backoff.
    # It waits for max(4 s, 8 chunks) of silence: longer than expect's default 5 s.
    expect(page.locator("#page-message")).to_contain_text(
        "nothing arrived for several seconds", timeout=20_000
    )
    expect(page.locator("#connection-state")).to_have_text("Live", timeout=20_000)
    expect(page.locator("#page-message")).to_contain_text("Reconnected")
    worker_stand_in.chunk(
        session,
        index=3,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=3),
        worker="gpu-a",
        generation_ms=395.0,
    )
    fourth = _wait_for_chunk(page, 3)
    assert fourth["r"] > 150 and fourth["g"] > 120, fourth  # the yellow chunk

    # A network blip: the browser goes offline. Chromium may close the socket or leave it silent;
    # either way the page notices, retries with backoff and reconnects when the network is back.
    browser_context.set_offline(True)
    expect(page.locator("#page-message")).to_contain_text("Live stream interrupted", timeout=20_000)
    expect(page.locator("#connection-state")).not_to_have_text("Live")
    browser_context.set_offline(False)
    expect(page.locator("#connection-state")).to_have_text("Live", timeout=20_000)
    expect(page.locator("#page-message")).to_contain_text("Reconnected")
    worker_stand_in.chunk(
        session,
        index=4,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=0),
        worker="gpu-a",
        generation_ms=390.0,
    )
    _wait_for_chunk(page, 4)

    # An abrupt close (server restart, proxy timeout): reconnects at once with backoff.
    page.evaluate("window.streamserve.page.socket.ws.close()")
    expect(page.locator("#page-message")).to_contain_text("the connection was lost")
    expect(page.locator("#connection-state")).to_have_text("Live")
    worker_stand_in.chunk(
        session,
        index=5,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=2),
        worker="gpu-a",
        generation_ms=388.0,
    )
    _wait_for_chunk(page, 5)

    # A socket error frame is shown, and the connection stays open.
    page.evaluate("window.streamserve.page.socket.ws.send('not json')")
    expect(page.locator("#page-message")).to_contain_text("did not understand")
    expect(page.locator("#connection-state")).to_have_text("Live")

    # End: the socket closes, controls are disabled.
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="End session").click()
    expect(page.locator("#session-state")).to_have_text("Ended")
    expect(page.get_by_role("button", name="Apply prompt")).to_be_disabled()
    session.refresh_from_db()
    assert session.status == "terminated"
    page_problems.assert_clean()


def test_another_users_session_is_not_found(browser_context, asgi_server, page_problems):
    from tests.factories import SessionFactory

    owner, intruder = UserFactory(username="owner"), UserFactory(username="intruder")
    session = SessionFactory(owner=owner)
    from tests.browser.conftest import log_in

    log_in(browser_context, asgi_server, intruder)
    page = browser_context.new_page()
    page_problems.watch(page)
    page.goto(f"/?session={session.pk}")
    expect(page.locator("#page-message")).to_contain_text("Not found")
    expect(page.locator("#controls")).to_be_hidden()
    page_problems.assert_clean()


def test_generation_page_at_phone_width(browser_context, asgi_server, page_problems):
    from tests.browser.conftest import PHONE, log_in

    log_in(browser_context, asgi_server, UserFactory(username="phone"))
    page = browser_context.new_page()
    page.set_viewport_size(PHONE)
    page_problems.watch(page)
    page.goto("/")
    expect(page.locator("#start-model option")).not_to_have_count(0)
    expect(page.get_by_role("button", name="Start")).to_be_enabled()
    # Before a session is open, no empty session bar, latency panel or controls are shown.
    for hidden in ("#session-bar", "#latency", "#latency-spark", "#controls"):
        expect(page.locator(hidden)).to_be_hidden()
    # Nothing overflows sideways at phone width.
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    screenshot(page, "generate-phone")
    page_problems.assert_clean()


def test_scheduler_states_and_an_operator_ending_the_session_are_shown(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    from django.utils import timezone

    from contracts.catalog import parse_resolution
    from sessions.models import SessionEvent
    from tests.browser.conftest import log_in
    from tests.factories import SessionFactory

    user, gpu = UserFactory(username="watcher"), GpuWorkerFactory(name="gpu-a")
    width, height = parse_resolution(TINY.default_resolution)
    session = SessionFactory(
        owner=user,
        status="executing",
        worker=gpu,
        state_location="worker",
        model_name=TINY.name,
        width=width,
        height=height,
        fps=TINY.fps,
        frames_per_chunk=TINY.frames_per_chunk,
    )
    log_in(browser_context, asgi_server, user)
    page = browser_context.new_page()
    page_problems.watch(page)
    page.goto(f"/?session={session.pk}")
    expect(page.locator("#connection-state")).to_have_text("Live")
    expect(page.locator("#session-state")).to_have_text("Executing")

    # Every state the scheduler can put it in is shown as such.
    worker_stand_in.status(session, status="migrating")
    expect(page.locator("#session-state")).to_have_text("Migrating to another GPU")
    worker_stand_in.status(session, status="queued", worker=None, queue_position=3)
    expect(page.locator("#session-state")).to_have_text("Queued — position 3")
    expect(page.locator("#session-where")).not_to_contain_text("on gpu-a")

    # What the control plane does when an operator terminates it, then its status broadcast.
    now = timezone.now()
    GenerationSession.objects.filter(pk=session.pk).update(
        status="terminated", activity="idle", worker=None, state_location="none", terminated_at=now
    )
    SessionEvent.objects.create(session=session, kind="depart", at=now, detail={"reason": "operator:boss"})
    session.refresh_from_db()
    worker_stand_in.status(session)

    expect(page.locator("#session-state")).to_have_text("Ended — an operator ended it")
    expect(page.locator("#page-message")).to_have_text("An operator ended this session.")
    expect(page.get_by_role("button", name="Resume")).to_be_disabled()
    page_problems.assert_clean()


def test_a_session_refused_by_admission_control_shows_why(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    from django.utils import timezone

    from sessions.models import SessionEvent
    from tests.browser.conftest import log_in
    from tests.factories import SessionFactory

    # Given a user watching their session wait in the queue
    user = UserFactory(username="refused")
    session = SessionFactory(owner=user, status="queued", queue_position=3, model_name=TINY.name)
    log_in(browser_context, asgi_server, user)
    page = browser_context.new_page()
    page_problems.watch(page)
    page.goto(f"/?session={session.pk}")
    expect(page.locator("#connection-state")).to_have_text("Live")
    expect(page.locator("#session-state")).to_have_text("Queued — position 3")

    # When admission control refuses it (what the scheduler does when the queue is over its
    # bound: the depart event's reason, then the status broadcast that carries it)
    reason = "queue full (2 waiting)"
    now = timezone.now()
    GenerationSession.objects.filter(pk=session.pk).update(
        status="terminated", activity="idle", queue_position=None, terminated_at=now
    )
    SessionEvent.objects.create(session=session, kind="depart", at=now, detail={"reason": reason})
    session.refresh_from_db()
    worker_stand_in.status(session)

    # Then the page says why, and keeps saying it (state badge and player, not only a message)
    shown = f"refused or ended by the platform: {reason}"
    expect(page.locator("#session-state")).to_have_text(f"Ended — {shown}")
    expect(page.locator("#player-overlay")).to_have_text(f"This session has ended ({shown}).")
    expect(page.locator("#page-message")).to_have_text(f"The session has ended: {reason}.")
    expect(page.locator("#terminate-button")).to_be_disabled()

    # and so does the page opened afterwards on the ended session (the reason from its events)
    later = browser_context.new_page()
    page_problems.watch(later)
    later.goto(f"/?session={session.pk}")
    expect(later.locator("#session-state")).to_have_text(f"Ended — {shown}")
    expect(later.locator("#player-overlay")).to_have_text(f"This session has ended ({shown}).")
    page_problems.assert_clean()


def test_an_expired_login_is_explained_with_a_way_back(browser_context, asgi_server, page_problems):
    from tests.browser.conftest import log_in
    from tests.factories import SessionFactory

    user = UserFactory(username="sleepy")
    session = SessionFactory(owner=user)
    log_in(browser_context, asgi_server, user)
    page = browser_context.new_page()
    page_problems.watch(page)
    page.goto(f"/?session={session.pk}")
    expect(page.locator("#connection-state")).to_have_text("Live")

    browser_context.clear_cookies()  # the login expires while the page is open
    page.get_by_role("button", name="Pause").click()

    expect(page.locator("#page-message")).to_contain_text("You are not logged in")
    login_link = page.locator("#page-message").get_by_role("link", name="Log in")
    expect(login_link).to_have_attribute("href", f"/accounts/login/?next=%2F%3Fsession%3D{session.pk}")
    session.refresh_from_db()
    assert session.activity == "active"
    page_problems.assert_clean()


# Mean colour of what the <video> presents now, and its playback counters.
VIDEO_SAMPLE = """() => {
  const v = document.getElementById('mse-video');
  const c = document.createElement('canvas');
  c.width = v.videoWidth || 1; c.height = v.videoHeight || 1;
  const ctx = c.getContext('2d');
  ctx.drawImage(v, 0, 0);
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  let r = 0, g = 0, b = 0;
  for (let i = 0; i < d.length; i += 4) { r += d[i]; g += d[i + 1]; b += d[i + 2]; }
  const n = d.length / 4;
  const q = v.getVideoPlaybackQuality();
  return {r: r / n, g: g / n, b: b / n, currentTime: v.currentTime, decoded: q.totalVideoFrames,
          shown: Number(v.dataset.framesShown || 0), chunk: v.dataset.chunk, hidden: v.hidden};
}"""


def _watch_executing_session(browser_context, asgi_server, page_problems, *, username: str, url: str = ""):
    """A user's executing session on gpu-a, opened in the generation page (``url``: extra query)."""
    from contracts.catalog import parse_resolution
    from tests.factories import SessionFactory

    user, gpu = UserFactory(username=username), GpuWorkerFactory(name="gpu-a")
    width, height = parse_resolution(TINY.default_resolution)
    session = SessionFactory(
        owner=user,
        status="executing",
        worker=gpu,
        state_location="worker",
        model_name=TINY.name,
        width=width,
        height=height,
        fps=TINY.fps,
        frames_per_chunk=TINY.frames_per_chunk,
    )
    log_in(browser_context, asgi_server, user)
    page = browser_context.new_page()
    page_problems.watch(page)
    page.goto(f"/?session={session.pk}{url}")
    expect(page.locator("#connection-state")).to_have_text("Live")
    return session, page


def test_a_session_plays_as_h264_through_media_source_extensions(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    # Given a browser that can play H.264 through MSE, watching an executing session
    session, page = _watch_executing_session(browser_context, asgi_server, page_problems, username="mse")
    expect(page.locator("#stat-codec")).to_have_text("H.264 (MSE)")
    expect(page.locator("#mse-video")).to_be_visible()
    expect(page.locator("#video")).to_be_hidden()
    chunk_s = session.frames_per_chunk / session.fps

    # When the worker sends H.264 fragments (red, then blue)
    for index, hue in ((0, 0), (1, 1)):
        worker_stand_in.chunk(
            session,
            index=index,
            frames=[],
            worker="gpu-a",
            generation_ms=400.0,
            media=h264_media(session, index=index, hue=hue),
        )

    # Then the <video> plays them: time advances, frames are decoded and presented, blue at the end
    page.wait_for_function(
        f"document.getElementById('mse-video').currentTime > {chunk_s * 1.5}"
        " && document.getElementById('mse-video').dataset.chunk === '1'"
    )
    first = page.evaluate(VIDEO_SAMPLE)
    assert first["decoded"] > 0 and first["shown"] > 0, first
    assert first["b"] > first["r"] + 60, first
    expect(page.locator("#stat-chunk")).to_have_text("#1")
    expect(page.locator("#player-overlay")).to_be_hidden()

    # and after a skipped chunk (a gap in the timeline) it jumps to the next one and keeps playing
    worker_stand_in.chunk(
        session,
        index=3,
        frames=[],
        worker="gpu-a",
        generation_ms=400.0,
        media=h264_media(session, index=3, hue=2),
    )
    page.wait_for_function(
        f"document.getElementById('mse-video').currentTime > {chunk_s * 3.2}"
        " && document.getElementById('mse-video').dataset.chunk === '3'"
    )
    later = page.evaluate(VIDEO_SAMPLE)
    assert later["g"] > later["r"] + 60 and later["shown"] > first["shown"], later  # the green chunk
    assert page.evaluate("window.streamserve.player.stats.decodeErrors") == 0
    screenshot(page, "generate-h264")
    page_problems.assert_clean()


def test_without_media_source_extensions_the_page_plays_jpeg(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    # Given a browser without MSE (emulated: removed before the page's scripts run)
    browser_context.add_init_script("delete window.MediaSource; delete window.ManagedMediaSource;")
    session, page = _watch_executing_session(browser_context, asgi_server, page_problems, username="nomse")

    # Then the page asks for JPEG and says why
    expect(page.locator("#stat-codec")).to_have_text("JPEG")
    expect(page.locator("#codec-note")).to_contain_text("cannot play H.264")
    expect(page.locator("#video")).to_be_visible()
    expect(page.locator("#mse-video")).to_be_hidden()

    # and JPEG chunks are drawn on the canvas
    worker_stand_in.chunk(
        session,
        index=0,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=1),
        worker="gpu-a",
        generation_ms=400.0,
    )
    shown = _wait_for_chunk(page, 0)
    assert shown["lit"] > 0.9 and shown["b"] > shown["r"] + 60, shown
    page_problems.assert_clean()


def test_an_h264_stream_the_browser_refuses_falls_back_to_jpeg(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    # Given a page playing H.264
    session, page = _watch_executing_session(browser_context, asgi_server, page_problems, username="badmse")
    expect(page.locator("#stat-codec")).to_have_text("H.264 (MSE)")

    # When a fragment arrives that the SourceBuffer refuses
    media = {**h264_media(session, index=0, hue=0), "fragment": b"\x00\x00\x00\x10moof" + bytes(8)}
    worker_stand_in.chunk(session, index=0, frames=[], worker="gpu-a", generation_ms=400.0, media=media)

    # Then the page says so, and reconnects asking for JPEG
    expect(page.locator("#page-message")).to_contain_text("H.264 playback failed")
    expect(page.locator("#stat-codec")).to_have_text("JPEG")
    expect(page.locator("#codec-note")).to_contain_text("fell back")
    expect(page.locator("#connection-state")).to_have_text("Live")
    expect(page.locator("#video")).to_be_visible()

    # and the next chunks are drawn on the canvas
    worker_stand_in.chunk(
        session,
        index=1,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=2),
        worker="gpu-a",
        generation_ms=400.0,
    )
    shown = _wait_for_chunk(page, 1)
    assert shown["g"] > shown["r"] + 60, shown
    page_problems.assert_clean()


def test_the_user_can_choose_jpeg_and_back(browser_context, asgi_server, worker_stand_in, page_problems):
    # Given a page playing H.264
    session, page = _watch_executing_session(browser_context, asgi_server, page_problems, username="chooser")
    expect(page.locator("#stat-codec")).to_have_text("H.264 (MSE)")

    # When the user picks JPEG
    page.get_by_label("Play as").select_option("jpeg")

    # Then the page asks for JPEG (and the URL keeps the choice for a reload)
    expect(page.locator("#stat-codec")).to_have_text("JPEG")
    expect(page).to_have_url(re.compile(r"codec=jpeg"))
    expect(page.locator("#connection-state")).to_have_text("Live")
    worker_stand_in.chunk(
        session,
        index=0,
        frames=jpeg_frames(session.width, session.height, session.frames_per_chunk, hue=0),
        worker="gpu-a",
        generation_ms=400.0,
    )
    _wait_for_chunk(page, 0)

    # and back to automatic: H.264 again
    page.get_by_label("Play as").select_option("auto")
    expect(page.locator("#stat-codec")).to_have_text("H.264 (MSE)")
    expect(page).not_to_have_url(re.compile(r"codec=jpeg"))
    page_problems.assert_clean()
