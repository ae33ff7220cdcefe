"""The daemon's claim watch on a real Redis command stream (docs/jobs.md, "Abandoning a step when
streams claim the device"): which commands claim the device, and that watching leaves the consumer
group's delivery untouched."""

from __future__ import annotations

import uuid

import pytest
import redis
from django.conf import settings

from contracts.wire.channel import (
    CommandReader,
    StreamClaimWatch,
    claims_the_device,
    send_command,
    stream_key,
)


@pytest.mark.parametrize(
    ("command", "claims"),
    [
        ({"kind": "start", "session": "s"}, True),
        ({"kind": "resume", "session": "s"}, True),
        ({"kind": "activate", "session": "s"}, True),
        ({"kind": "migrate_in", "session": "s"}, True),
        ({"kind": "migrate_in", "job": "j"}, False),
        ({"kind": "job_pause", "job": "j"}, False),
        ({"kind": "suspend", "session": "s"}, False),
        ({"kind": "prompt", "session": "s"}, False),
    ],
)
def test_only_commands_that_bring_a_stream_onto_the_device_claim_it(command, claims):
    assert claims_the_device(command) is claims


def test_the_watch_sees_a_claim_sent_after_the_hot_loops_last_read_and_the_loop_still_gets_every_command():
    client = redis.Redis.from_url(settings.REDIS_URL)
    worker = f"claims-{uuid.uuid4().hex[:8]}"
    reader = CommandReader(client, worker)
    watch = StreamClaimWatch(client, worker, poll_ms=20)
    watch.start()
    try:
        # Given a start the hot loop has already read (and a job step starting after that read)
        assert reader.read(block_ms=None) == []  # the first read is our own unacknowledged backlog
        send_command(client, worker, {"id": "old", "kind": "start", "session": "a"})
        assert [c.command["id"] for c in reader.read(block_ms=None)] == ["old"]
        # When a job command and a job's migrate_in arrive during the step
        send_command(client, worker, {"id": "pause", "kind": "job_pause", "job": "j"})
        watch.arm(reader.last_id)
        send_command(client, worker, {"id": "move", "kind": "migrate_in", "job": "j"})
        # Then nothing claims the device (the start read before the step is not seen again)
        assert not watch.claimed.wait(0.3)
        # When a session's migrate_in arrives
        send_command(client, worker, {"id": "in", "kind": "migrate_in", "session": "b"})
        # Then the flag is set, and the hot loop still receives every command once, in order
        assert watch.claimed.wait(10.0)
        watch.disarm()
        assert [c.command["id"] for c in reader.read(block_ms=None)] == ["pause", "move", "in"]
        # And a new step's watch starts clear
        watch.arm(reader.last_id)
        assert not watch.claimed.is_set()
    finally:
        watch.stop()
        watch.join(timeout=5)
        client.delete(stream_key(worker))
