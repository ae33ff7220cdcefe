"""What the chaos tests share: a real WebSocket client, the owner probe, private Redis and PostgreSQL.

Every chaos test asserts on what a *client* saw (``ClientView``) and on what the *owner probe*
sampled while the fault was under way (``OwnerProbe``):

- the client: each chunk index at most once, none skipped, every delivered chunk recorded in
  PostgreSQL once the ingester has drained the record stream;
- the probe: every ``PROBE_INTERVAL_S`` it reads the session's publish lease in Redis
  (``ss:epoch:<session>``), and it taps the session's channel-layer group itself, so it sees every
  chunk any worker published (before the session consumer's epoch/index filter, which would hide a
  second publisher from the client). At each sampled moment at most one worker published under an
  epoch the lease still allows, and no worker published under an epoch the lease had passed more
  than ``FENCE_SLACK_S`` earlier (a chunk admitted just before the lease rose may still be in
  flight). Two workers generating one session — the failure fencing exists to prevent — fails
  both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redis.asyncio as aioredis
import websockets
from channels_redis.pubsub import RedisPubSubChannelLayer

from contracts.wire.channel import EPOCH_ENDED, epoch_key
from contracts.wire.frames import CHUNK_MESSAGE, decode_chunk_frame, group_name
from workers.benchmarks.live import free_port

PROBE_INTERVAL_S = 0.15
FENCE_SLACK_S = 1.0


# --- the client ----------------------------------------------------------------------------------


@dataclass
class ClientView:
    """What one WebSocket client received for one session (across reconnects)."""

    url: str
    headers: list[dict] = field(default_factory=list)
    payloads: list[list[bytes]] = field(default_factory=list)  # each chunk's, beside its header
    texts: list[dict] = field(default_factory=list)
    connections: int = 0

    @property
    def indices(self) -> list[int]:
        return [int(h["index"]) for h in self.headers]

    def workers(self) -> list[str]:
        return [h["worker"] for h in self.headers]

    async def run(self, stop: asyncio.Event) -> None:
        """Read until ``stop``; reconnect (as the page does) if the server closes the socket."""
        while not stop.is_set():
            try:
                async with websockets.connect(self.url, max_size=None, open_timeout=10) as ws:
                    self.connections += 1
                    reader = asyncio.ensure_future(self._read(ws))
                    stopper = asyncio.ensure_future(stop.wait())
                    await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    for task in (reader, stopper):
                        task.cancel()
                    with contextlib.suppress(BaseException):
                        await reader
            except (TimeoutError, OSError, websockets.WebSocketException):
                pass
            if not stop.is_set():
                self.texts.append({"type": "client.reconnect", "after_index": (self.indices or [None])[-1]})
                await asyncio.sleep(0.5)

    async def _read(self, ws) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in ws:
                if isinstance(message, bytes):
                    header, payloads = decode_chunk_frame(message)
                    self.headers.append(header)
                    self.payloads.append(payloads)
                else:
                    self.texts.append(json.loads(message))

    def assert_one_stream(self) -> None:
        """No index twice, none skipped, no chunk dropped for a slow socket."""
        indices = self.indices
        assert indices, f"the client received no chunk: {self.texts}"
        assert len(indices) == len(set(indices)), f"an index arrived twice: {indices}"
        expected = list(range(indices[0], indices[0] + len(indices)))
        assert indices == expected, f"indices skipped or out of order: {indices} texts={self.texts}"
        assert not [t for t in self.texts if t.get("type") == "skipped"], self.texts
        assert [h["epoch"] for h in self.headers] == sorted(h["epoch"] for h in self.headers), self.headers

    def assert_h264_decodes(self) -> None:
        """For a ``?codec=h264`` client: what it received is one H.264 stream that PyAV decodes into
        exactly the received chunks' frames — each chunk's fragment after the init segment it came
        with, every frame's presentation time ``index × frames_per_chunk + k`` for its chunk (so no
        frame twice, none missing, the indices contiguous). A new init segment (another encoder
        after a move) starts a new decode; the same one sent again (a reconnect) does not."""
        from workers.runtime.media import decode_fragments

        assert self.headers, f"the client received no chunk: {self.texts}"
        assert {h.get("codec") for h in self.headers} == {"h264"}, [h.get("codec") for h in self.headers]
        assert self.headers[0]["init"], "the first chunk came without the init segment"
        runs: list[tuple[bytes, list[bytes], list[dict]]] = []
        for header, payloads in zip(self.headers, self.payloads, strict=True):
            if header["init"]:
                init, fragment = payloads
                if not runs or runs[-1][0] != init:
                    runs.append((init, [], []))
            else:
                (fragment,) = payloads
            runs[-1][1].append(fragment)
            runs[-1][2].append(header)
        decoded = []
        for init, fragments, headers in runs:
            frames, pts = decode_fragments(init, fragments)  # a decoder error raises here
            expected = [
                int(h["index"]) * int(h["frames_per_chunk"]) + k
                for h in headers
                for k in range(int(h["frames_per_chunk"]))
            ]
            assert pts == expected, f"decoded frames {pts} against the chunks' {expected}"
            assert frames.shape[0] == len(expected) and frames.shape[1:3] == (
                headers[0]["height"],
                headers[0]["width"],
            )
            decoded.extend(pts)
        assert len(decoded) == len(set(decoded)), "a frame decoded twice"


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


# --- the owner probe -----------------------------------------------------------------------------


@dataclass
class Published:
    at: float  # monotonic time the probe received it
    worker: str
    epoch: int
    index: int


@dataclass
class OwnerProbe:
    """Samples, for each session, the publish lease and who actually publishes (see module doc)."""

    redis_url: str
    sessions: list[str]
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # sid → (t, lease)
    published: dict[str, list[Published]] = field(default_factory=dict)
    lease_errors: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        for sid in self.sessions:
            self.samples[sid], self.published[sid] = [], []
        tasks = [asyncio.ensure_future(self._sample(stop)), asyncio.ensure_future(self._tap(stop))]
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task

    async def _sample(self, stop: asyncio.Event) -> None:
        client = aioredis.Redis.from_url(self.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while not stop.is_set():
                try:
                    values = await client.mget([epoch_key(sid) for sid in self.sessions])
                except (redis.RedisError, OSError):
                    self.lease_errors += 1  # Redis down (the Redis test): nothing to sample
                else:
                    now = time.monotonic()
                    for sid, raw in zip(self.sessions, values, strict=True):
                        self.samples[sid].append((now, -1 if raw is None else int(raw)))
                await asyncio.sleep(PROBE_INTERVAL_S)
        finally:
            await client.aclose()

    async def _tap(self, stop: asyncio.Event) -> None:
        """Join every session's group on the platform's channel layer, as a consumer would."""
        from django.conf import settings

        prefix = settings.CHANNEL_LAYERS["default"]["CONFIG"].get("prefix", "asgi")
        while not stop.is_set():
            layer = RedisPubSubChannelLayer(hosts=[self.redis_url], prefix=prefix)
            try:
                channel = await layer.new_channel()
                for sid in self.sessions:
                    await layer.group_add(group_name(sid), channel)
                while not stop.is_set():
                    message = await layer.receive(channel)
                    if message.get("type") != CHUNK_MESSAGE:
                        continue
                    header = message["header"]
                    self.published[str(header["session"])].append(
                        Published(
                            time.monotonic(), header["worker"], int(header["epoch"]), int(header["index"])
                        )
                    )
            except (redis.RedisError, OSError):
                await asyncio.sleep(0.3)  # Redis down: join again once it is back
            finally:
                with contextlib.suppress(Exception):
                    await layer.flush()

    def lease_at(self, sid: str, t: float) -> int:
        """The lease as last sampled at or before ``t`` (-1 before the first sample)."""
        samples = self.samples[sid]
        i = bisect_right([s[0] for s in samples], t)
        return samples[i - 1][1] if i else -1

    def assert_one_owner(self, *, min_samples: int = 20) -> None:
        for sid in self.sessions:
            samples, published = self.samples[sid], self.published[sid]
            assert len(samples) >= min_samples, f"the probe sampled {sid} only {len(samples)} times"
            assert published, f"the probe saw nobody publish {sid}"
            # Each epoch has one publisher: two workers under one epoch are two owners whatever the lease.
            by_epoch: dict[int, set[str]] = {}
            for p in published:
                by_epoch.setdefault(p.epoch, set()).add(p.worker)
            assert all(len(w) == 1 for w in by_epoch.values()), (
                f"{sid}: one epoch, several publishers {by_epoch}"
            )
            previous = float("-inf")
            for t, lease in samples:
                if lease >= EPOCH_ENDED:
                    break  # terminated: nobody may publish, checked below
                window = [p for p in published if previous < p.at <= t]
                previous = t
                # Publish-capable at t: chunks under the lease read at t (it only rises, and each
                # admitted chunk's epoch is <= the lease). At most one worker holds it.
                holders = {p.worker for p in window if p.epoch >= lease}
                assert len(holders) <= 1, (
                    f"{sid}: {len(holders)} owners at one moment: {holders} lease={lease}"
                )
                # A publisher whose epoch the lease passed well before its chunk went out is a
                # second owner (fenced workers must stop; only a chunk already in flight may land).
                stale = [p for p in window if p.epoch < self.lease_at(sid, p.at - FENCE_SLACK_S)]
                assert not stale, f"{sid}: published after being fenced out: {stale}"


# --- private services ----------------------------------------------------------------------------


class PrivateRedis:
    """A ``redis-server`` of the test's own on a free port, with an append-only file fsynced on
    every write (the persistence the platform's Redis needs: leases, delivered marks, the record
    stream and command streams survive a restart)."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [
            shutil.which("redis-server") or "redis-server",
            "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no",
        ]  # fmt: skip
        with open(self.dir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(redis.RedisError):
                if redis.Redis.from_url(self.url, socket_timeout=1).ping():
                    return
            assert time.monotonic() < deadline, "the private redis-server did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # SHUTDOWN: the AOF is flushed
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (``initdb``/``pg_ctl`` into a temporary directory,
    on a free port, trust authentication), so that restarting it touches nobody else.

    PostgreSQL refuses to run as root: as root, the cluster belongs to the ``postgres`` system user
    (its directory outside pytest's root-only temporary tree) and its tools run under ``runuser``.
    """

    def __init__(self) -> None:
        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
        assert candidates, "no PostgreSQL server binaries under /usr/lib/postgresql"
        self.bin = candidates[-1].parent
        self.root = Path(tempfile.mkdtemp(prefix="ss-chaos-pg-"))
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = free_port()
        self.user = "postgres"

    def url(self, dbname: str) -> str:
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self.as_user, str(self.bin / tool), *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{tool} failed: {done.stdout[-2000:]} {done.stderr[-2000:]}"

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", self.user, "-A", "trust", "--no-sync")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
