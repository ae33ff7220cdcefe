"""Real-browser fixtures: the real ASGI app under uvicorn on the test database, Debian's Chromium.

The server is a subprocess (``python -m uvicorn controlplane.asgi:application``) whose
``DATABASE_URL`` names the test database pytest-django created, so rows a test writes (with
``transactional_db``, i.e. committed) are what the pages read. The tests play the GPU worker by
publishing real chunk messages to a session's group on the real Redis channel layer.
"""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from playwright.sync_api import expect

from contracts.wire.frames import chunk_message, group_name
from scheduling.supervision import web_argv
from tests import isolation
from tests.webrtc_media import media_process

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(settings.BASE_DIR) / "artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
PASSWORD = "pw-for-tests-1"  # tests.factories.UserFactory's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_redis_url() -> str:
    """The Redis the test server uses (channel layer, cache, Celery broker, worker commands).

    A database of its own (12 without xdist, one per worker with it: tests/isolation.py; or
    ``BROWSER_TEST_REDIS_URL``): the scheduler tasks its requests enqueue must not be taken by a
    Celery worker of another platform running on this machine, and nothing of theirs may reach the
    pages under test.
    """
    return os.environ.get("BROWSER_TEST_REDIS_URL") or isolation.browser_server_url(settings.REDIS_URL)


def _database_url() -> str:
    from django.db import connection

    db = connection.settings_dict
    auth = quote(db["USER"] or "", safe="")
    if db.get("PASSWORD"):
        auth += ":" + quote(db["PASSWORD"], safe="")
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or "5432"
    return f"postgres://{auth}@{host}:{port}/{db['NAME']}"


@pytest.fixture(scope="module", autouse=True)
def _orm_beside_playwright():
    # Playwright's sync API keeps an event loop running in this thread, so Django's async guard
    # would refuse the ordinary synchronous ORM calls the tests (and the database flush after each
    # transactional test) make between browser steps. Module scope: set before any test's fixtures,
    # restored after the module, so only browser tests run with the guard relaxed.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


# Module scope: the server and the browser stop when a browser test module ends, so nothing of
# theirs outlives the browser tests in a whole-suite run.
@pytest.fixture(scope="module")
def asgi_server(django_db_setup, django_db_blocker):
    """Base URL of uvicorn serving controlplane.asgi against the test database."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    with django_db_blocker.unblock():
        database_url = _database_url()
    redis_url = _server_redis_url()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": redis_url,
        "DB_CONN_MAX_AGE": "0",
        "PYTHONUNBUFFERED": "1",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    log_path = ARTIFACTS / f"browser-server{isolation.suffix()}.log"
    log = open(log_path, "wb")  # noqa: SIM115  (closed at teardown)
    process = subprocess.Popen(
        list(web_argv(port=port)),  # the platform's own web command line
        cwd=settings.BASE_DIR,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if process.poll() is not None:
            log.close()
            raise RuntimeError(f"uvicorn exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{base_url}/accounts/login/", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            log.close()
            raise RuntimeError(f"uvicorn did not answer in 90 s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.3)
    yield base_url
    # Scheduler tasks nobody consumed (no Celery worker runs in these tests), and commands to the
    # stand-in workers: this Redis database is the browser tests' own.
    import redis

    client = redis.Redis.from_url(redis_url)
    client.delete("scheduler", "default", *client.scan_iter("ss:cmd:*"))
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log.close()


@pytest.fixture(scope="module")
def media_server(asgi_server):
    """The media process beside the server (``manage.py runmedia``: WebRTC peer connections run
    there, ``WEBRTC_MEDIA=process``), on the server's Redis."""
    redis_url = _server_redis_url()
    env = {
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": redis_url,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }
    with media_process(ARTIFACTS / f"browser-media{isolation.suffix()}.log", env=env):
        yield


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/ensure_test_tools.sh (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


class PageProblems:
    """JavaScript errors and requests that left the server's origin (pages load nothing from the internet)."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.errors: list[str] = []
        self.foreign_requests: list[str] = []

    def watch(self, page) -> None:
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on(
            "request",
            lambda request: (
                None
                if request.url.startswith(
                    (self.base_url, self.base_url.replace("http", "ws", 1), "data:", "blob:")
                )
                else self.foreign_requests.append(request.url)
            ),
        )

    def assert_clean(self) -> None:
        assert self.errors == [], f"JavaScript errors: {self.errors}"
        assert self.foreign_requests == [], f"requests outside the app: {self.foreign_requests}"


@pytest.fixture
def browser_context(browser, asgi_server):
    context = browser.new_context(viewport=DESKTOP, accept_downloads=True, base_url=asgi_server)
    context.set_default_timeout(15_000)
    # A loaded CI machine (2 cores shared with uvicorn, Redis and PostgreSQL) can be slow to repaint.
    expect.set_options(timeout=10_000)
    yield context
    context.close()


@pytest.fixture
def page_problems(asgi_server):
    return PageProblems(asgi_server)


def log_in(context, base_url: str, user) -> None:
    """Attach a logged-in Django session cookie (the login form itself is tested once, in the UI)."""
    from django.test import Client

    client = Client()
    client.force_login(user)
    cookie = client.cookies[settings.SESSION_COOKIE_NAME]
    context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": cookie.value, "url": base_url}])


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


class WorkerStandIn:
    """Plays the GPU worker and the control plane's broadcaster on the real Redis channel layer.

    A background thread owns one event loop (channels_redis keeps its connections per loop), so
    the synchronous tests can publish while Playwright's own loop is busy in the main thread.
    """

    def __init__(self, redis_url: str):
        from django.utils.module_loading import import_string

        # The same layer class the server runs (pub/sub by default), pointed at the server's Redis.
        layer = settings.CHANNEL_LAYERS["default"]
        config = {**layer["CONFIG"], "hosts": [redis_url]}
        self.layer = import_string(layer["BACKEND"])(**config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.loop.run_forever()
        # Closed in its own thread: channels_redis hooks loop.close() to close its connections,
        # which needs to run the loop, and Playwright's loop is running in the main thread.
        self.loop.run_until_complete(self._close_layer())
        self.loop.close()

    async def _close_layer(self):
        # Inside the loop: the pub/sub layer picks its per-loop connection from the running loop.
        close = getattr(self.layer, "close_pools", None) or self.layer.flush
        await close()

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=15)

    def status(self, session, **fields) -> None:
        """The control plane's status broadcast for ``session`` (its real message), with ``fields``
        replaced."""
        from contracts.wire.frames import status_message
        from sessions.selectors import session_status_message

        message = status_message({**session_status_message(session), **fields})
        self._run(self.layer.group_send(f"session.{session.pk}", message))

    def job(self, job, **fields) -> None:
        """The control plane's broadcast of ``job``'s state (its real message), with ``fields`` replaced."""
        from sessions.jobs import JOB_MESSAGE, group_name
        from sessions.selectors import job_status_message

        message = {"type": JOB_MESSAGE, **job_status_message(job, position=None), **fields}
        self._run(self.layer.group_send(group_name(job.owner_id), message))

    def chunk(
        self,
        session,
        *,
        index: int,
        frames: list[bytes],
        worker: str,
        generation_ms: float,
        batch_size=1,
        media: dict | None = None,
    ):
        """A chunk as a worker publishes it: JPEG ``frames``, and its H.264 fragment (``media``,
        ``h264_media``) when a viewer reads H.264."""
        header = {
            "session": str(session.pk),
            "index": index,
            "generation_ms": generation_ms,
            "generated_at": time.time(),
            "worker": worker,
            "batch_size": batch_size,
            "width": session.width,
            "height": session.height,
            "fps": session.fps,
            "mime": "image/jpeg",
            # The owner's epoch, as a real worker's header carries it (the consumer filters on it).
            "epoch": session.epoch,
        }
        message = chunk_message(header, frames, media=media)
        self._run(self.layer.group_send(group_name(str(session.pk)), message))

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def worker_stand_in(asgi_server):
    stand_in = WorkerStandIn(_server_redis_url())
    yield stand_in
    stand_in.close()


CHUNK_COLOURS = [(220, 40, 40), (40, 90, 220), (40, 180, 80), (230, 180, 30)]


def jpeg_frames(width: int, height: int, count: int, *, hue: int) -> list[bytes]:
    """``count`` real JPEGs: a colour field (``hue`` picks it) with a bar that moves frame by frame."""
    from PIL import Image, ImageDraw

    frames = []
    base = CHUNK_COLOURS[hue % 4]
    for i in range(count):
        image = Image.new("RGB", (width, height), base)
        draw = ImageDraw.Draw(image)
        x = (i * width // max(1, count)) % width
        draw.rectangle([x, 0, x + width // 8, height], fill=(250, 250, 250))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=85)
        frames.append(buffer.getvalue())
    return frames


def h264_media(session, *, index: int, hue: int) -> dict:
    """Chunk ``index``'s H.264 fragment as a worker publishes it (``chunk_message``'s ``media``): a
    flat colour field (``hue`` picks it, as in ``jpeg_frames``) with a bar moving frame by frame."""
    import numpy as np

    from workers.runtime.media import FragmentEncoder

    frames = np.empty((session.frames_per_chunk, session.height, session.width, 3), dtype=np.uint8)
    frames[:] = CHUNK_COLOURS[hue % 4]
    for i in range(session.frames_per_chunk):
        x = (i * session.width // session.frames_per_chunk) % session.width
        frames[i, :, x : x + max(1, session.width // 8)] = 250
    fragment = FragmentEncoder().encode(
        frames, fps=session.fps, chunk_index=index, frames_per_chunk=session.frames_per_chunk
    )
    return {
        "init": fragment.init,
        "fragment": fragment.data,
        "mime": fragment.mime,
        "encoder": fragment.encoder,
    }
