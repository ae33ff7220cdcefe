"""What the control plane and the workers share in Redis (no Django): durable per-worker command
channels, and each session's publish lease.

Commands: the control plane appends them to ``ss:cmd:<worker>``; the worker reads them through the
consumer group ``daemon``, applies them at a chunk boundary and acknowledges each stream entry
(XACK) after it has answered the command. A worker process that restarts under the same name reads
its unacknowledged entries again first, so a command is never lost between delivery and answer;
answers are idempotent because each command carries a unique id the worker remembers.

The publish lease (``PublishFence``) is a fencing token: ``ss:epoch:<session>`` holds the session's
current ownership epoch (TurboServe §6.1). It only ever rises: the control plane raises it after
committing a transition that hands the session to a new owner or ends it (``sessions.lifecycle``),
and a worker that holds a newer epoch (from a committed command) raises it on its first publish.
Before each chunk the worker's publisher asks ``admit`` — one round trip, a Lua script, so the
check and the lease renewal are atomic — and a worker whose epoch is older than the lease never
publishes again for that session: a worker frozen past its heartbeat timeout wakes up fenced out.
``ss:delivered:<session>`` is the last index actually handed to the channel layer, written *after*
the send (``mark_delivered``) and only while the lease still holds: the resume point after a
takeover is never ahead of what was delivered. A chunk sent but not yet marked when its worker
died is generated again by the next owner; the session consumer drops the second copy.
"""

from __future__ import annotations

import enum
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import redis

GROUP = "daemon"
STREAM_MAXLEN = 10_000


def stream_key(worker_name: str) -> str:
    return f"ss:cmd:{worker_name}"


def delivered_key(session_id: str) -> str:
    """The last chunk index handed to the channel layer for a session (written after the send)."""
    return f"ss:delivered:{session_id}"


def epoch_key(session_id: str) -> str:
    """The session's publish lease: the epoch of the only owner allowed to publish its chunks."""
    return f"ss:epoch:{session_id}"


def heartbeat_key(worker_name: str) -> str:
    """A worker's liveness beside its PostgreSQL heartbeat: present while it beats (a TTL)."""
    return f"ss:hb:{worker_name}"


def heartbeat_beat(client: redis.Redis, worker_name: str, ttl_s: float) -> None:
    """The worker is alive now; the key expires ``ttl_s`` after its last beat (Redis's clock)."""
    client.set(heartbeat_key(worker_name), "1", px=max(1, int(ttl_s * 1000)))


def heartbeat_ack_key(worker_name: str) -> str:
    """The control plane's acknowledgement of a worker's heartbeat: a counter it bumps each tick."""
    return f"ss:hb-ack:{worker_name}"


def heartbeats_acknowledge(client: redis.Redis, worker_names: list[str], ttl_s: float) -> None:
    """The control plane saw these workers beat: bump each one's acknowledgement.

    A counter, not a timestamp: a worker compares it only with the value it saw last, on its own
    clock, so no clock is shared across hosts. The TTL drops the keys of workers that are gone.
    """
    if not worker_names:
        return
    pipe = client.pipeline(transaction=False)
    for name in worker_names:
        pipe.incr(heartbeat_ack_key(name))
        pipe.pexpire(heartbeat_ack_key(name), max(1, int(ttl_s * 1000)))
    pipe.execute()


def heartbeat_acknowledged(client: redis.Redis, worker_name: str) -> bytes | None:
    """The worker's acknowledgement counter (None: never acknowledged, or not for a TTL)."""
    return client.get(heartbeat_ack_key(worker_name))


def heartbeats_alive(client: redis.Redis, worker_names: list[str]) -> set[str]:
    """Which of ``worker_names`` beat within their TTL."""
    if not worker_names:
        return set()
    values = client.mget([heartbeat_key(name) for name in worker_names])
    return {name for name, value in zip(worker_names, values, strict=True) if value is not None}


def new_command(kind: str, **fields: Any) -> dict[str, Any]:
    return {"id": str(uuid.uuid4()), "kind": kind, **fields}


def send_command(client: redis.Redis, worker_name: str, command: dict[str, Any]) -> str:
    entry = client.xadd(
        stream_key(worker_name), {"json": json.dumps(command)}, maxlen=STREAM_MAXLEN, approximate=True
    )
    return entry.decode() if isinstance(entry, bytes) else entry


@dataclass
class ReceivedCommand:
    entry_id: str
    command: dict[str, Any]


class CommandReader:
    """The worker's side of its channel."""

    def __init__(self, client: redis.Redis, worker_name: str) -> None:
        self.client = client
        self.key = stream_key(worker_name)
        self.consumer = worker_name
        try:
            self.client.xgroup_create(self.key, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._backlog = True  # first read our own unacknowledged entries (after a restart)
        # The newest entry delivered to us: a `StreamClaimWatch` looks at what comes after it.
        self.last_id = _group_last_delivered(self.client, self.key)

    def read(self, block_ms: int | None, count: int = 100) -> list[ReceivedCommand]:
        start = "0" if self._backlog else ">"
        reply = self.client.xreadgroup(
            GROUP, self.consumer, {self.key: start}, count=count, block=None if self._backlog else block_ms
        )
        out: list[ReceivedCommand] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                raw = fields.get(b"json") or fields.get("json")
                entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    command = json.loads(raw)
                except (TypeError, json.JSONDecodeError):
                    command = {"id": entry, "kind": "malformed"}
                out.append(ReceivedCommand(entry, command))
                self.last_id = max(self.last_id, entry, key=_entry_order)
        if self._backlog and not out:
            self._backlog = False
        return out

    def ack(self, entry_id: str) -> None:
        self.client.xack(self.key, GROUP, entry_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entry_order(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


def _group_last_delivered(client: redis.Redis, key: str) -> str:
    for group in client.xinfo_groups(key):
        if _text(group.get("name", group.get(b"name", ""))) == GROUP:
            return _text(group.get("last-delivered-id", group.get(b"last-delivered-id", "0-0")))
    return "0-0"


# Commands that give a session this worker's device: a job step in flight is abandoned for them.
STREAM_CLAIMS = frozenset({"start", "resume", "activate"})


def claims_the_device(command: dict[str, Any]) -> bool:
    """Whether ``command`` brings a stream onto the device (a session's start, resume, migrate_in
    or activate; a job's migrate_in does not)."""
    kind = command.get("kind")
    return kind in STREAM_CLAIMS or (kind == "migrate_in" and "job" not in command)


class StreamClaimWatch(threading.Thread):
    """Watches a worker's command stream while a job step runs, and sets `claimed` as soon as a
    command that claims the device for a stream arrives (`claims_the_device`).

    The hot loop reads commands only between steps; this thread reads the same stream beside it
    with plain XREAD (which leaves the consumer group's delivery untouched) from the last entry the
    hot loop received, so a command that arrived just before the step is seen too. The job step
    polls `claimed` (a `threading.Event`) at its block boundaries.
    """

    def __init__(self, client: redis.Redis, worker_name: str, *, poll_ms: int = 50) -> None:
        super().__init__(name=f"claims-{worker_name}", daemon=True)
        self.client = client
        self.key = stream_key(worker_name)
        self.poll_ms = poll_ms
        self.claimed = threading.Event()
        self._armed = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._generation = 0
        self._after = "0-0"

    def arm(self, after_id: str) -> None:
        """A job step starts: watch for claims after ``after_id`` (the hot loop's last entry)."""
        with self._lock:
            self._generation += 1
            self._after = after_id
            self.claimed.clear()
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def stop(self) -> None:
        self._stopped.set()
        self._armed.set()

    def run(self) -> None:
        while not self._stopped.is_set():
            if not self._armed.wait(0.5) or self._stopped.is_set():
                continue
            with self._lock:
                generation, after = self._generation, self._after
            try:
                reply = self.client.xread({self.key: after}, count=100, block=self.poll_ms)
            except redis.RedisError:
                self._stopped.wait(self.poll_ms / 1000.0)  # the hot loop handles the outage
                continue
            last, claim = after, False
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = _text(entry_id)
                    try:
                        claim = claim or claims_the_device(
                            json.loads(fields.get(b"json") or fields.get("json"))
                        )
                    except (TypeError, json.JSONDecodeError):
                        continue
            with self._lock:
                if generation != self._generation:
                    continue  # the step this read was for has ended
                self._after = last
                if claim:
                    self.claimed.set()


# --- the publish lease ------------------------------------------------------------------------

# A session that publishes keeps renewing its lease; one that stopped (ended, or suspended for a
# week) lets it expire, after which the next owner's first publish takes it again.
LEASE_TTL_S = 7 * 86400
# The lease of a terminated session: above every epoch a worker can hold (exact in Lua's doubles).
EPOCH_ENDED = 2**50

# KEYS[1] lease; ARGV epoch, ttl. Raises the lease to ARGV[1] if it is below; returns the lease.
_RAISE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local epoch = tonumber(ARGV[1])
if epoch > current then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return epoch
end
return current
"""

# KEYS[1] lease, KEYS[2] delivered mark; ARGV epoch, index, ttl. Returns {verdict, lease, delivered}.
# A newer epoch than the lease comes from a committed command the control plane has not yet
# announced here (its after-commit raise may land after the command): it takes the lease.
_ADMIT = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local epoch = tonumber(ARGV[1])
if current > epoch then
  return {0, current, -1}
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
local delivered = tonumber(redis.call('GET', KEYS[2]) or '-1')
if tonumber(ARGV[2]) <= delivered then
  return {2, epoch, delivered}
end
return {1, epoch, delivered}
"""

# KEYS[1] lease, KEYS[2] delivered mark; ARGV epoch, index, ttl. Advances the mark (never back)
# only while the lease is still ARGV[1]; returns 1 if the lease held.
_MARK = """
if tonumber(redis.call('GET', KEYS[1]) or '-1') ~= tonumber(ARGV[1]) then
  return 0
end
if tonumber(ARGV[2]) > tonumber(redis.call('GET', KEYS[2]) or '-1') then
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
end
return 1
"""


class Verdict(enum.IntEnum):
    STALE = 0  # another owner holds a newer epoch, or the session ended: never publish again
    PUBLISH = 1  # the lease is ours (renewed) and the index is ahead of the delivered mark
    PASSED = 2  # the lease is ours but this index was already delivered: do not send it twice


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    lease: int  # the session's current epoch
    delivered: int  # the delivered mark (-1: none; unknown when stale)


class PublishFence:
    """The session publish lease on one Redis client (thread-safe: scripts hold no state)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._raise = client.register_script(_RAISE)
        self._admit = client.register_script(_ADMIT)
        self._mark = client.register_script(_MARK)

    def raise_to(self, session_id: str, epoch: int) -> int:
        """The control plane committed a new owner (or the end): older epochs may not publish."""
        return int(self._raise(keys=[epoch_key(session_id)], args=[epoch, LEASE_TTL_S]))

    def end(self, session_id: str) -> int:
        return self.raise_to(session_id, EPOCH_ENDED)

    def admit(self, session_id: str, epoch: int, index: int) -> Admission:
        """Before a publish: may the holder of ``epoch`` send chunk ``index``?"""
        verdict, lease, delivered = self._admit(
            keys=[epoch_key(session_id), delivered_key(session_id)], args=[epoch, index, LEASE_TTL_S]
        )
        return Admission(Verdict(int(verdict)), int(lease), int(delivered))

    def mark_delivered(self, session_id: str, epoch: int, index: int) -> bool:
        """After the send: ``index`` reached the channel layer. False if the lease moved meanwhile
        (the mark then stays where the new owner resumes from)."""
        return bool(
            self._mark(
                keys=[epoch_key(session_id), delivered_key(session_id)], args=[epoch, index, LEASE_TTL_S]
            )
        )

    def holds(self, session_id: str, epoch: int) -> bool:
        """Whether no newer owner (nor the end) has taken the session from ``epoch``."""
        raw = self.client.get(epoch_key(session_id))
        return raw is None or int(raw) <= epoch
