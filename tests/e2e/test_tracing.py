"""OpenTelemetry traces across the real processes (docs/observability.md, "Traces").

One platform (web, Celery, beat, one CPU worker) exports by OTLP/HTTP to a collector stand-in that
runs inside the test: a small HTTP server decoding the exporters' protobuf requests
(``opentelemetry-proto``). It must receive a decision's trace from the event (the session created
over HTTP) to the worker's answer, and a chunk's trace from the worker to the socket's send, each
under one trace id across processes. And a web process whose tracing is off imports no SDK.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from contracts.otlp_sink import OtlpSink
from contracts.wire.channel import heartbeat_acknowledged
from gpu.models import GpuWorker
from scheduling.live.enqueue import SCHEDULER_TICK
from tests.e2e.conftest import ROOT, Platform, wait_for
from tests.e2e.test_live_loop import Stream, create_session
from tests.factories import UserFactory

# The platform's processes see only committed rows: what they must see is written by the module
# fixtures, outside the tests' transactions.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]


@pytest.fixture(scope="module")
def traced(django_db_setup, django_db_blocker, tmp_path_factory, request):
    """The platform with tracing on, every chunk sampled, spans exported every 200 ms; one user."""
    from scheduling.models import SchedulerConfig
    from scheduling.services import beat_schedule_install

    receiver = OtlpSink()
    with django_db_blocker.unblock():
        call_command("flush", "--noinput", verbosity=0)
        beat_schedule_install(tick_s=1)
        SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": 1, "max_gpus": 1})
        platform = Platform(
            tmp_path_factory.mktemp("traced-platform"),
            env={
                "OTEL_ENABLED": "true",
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                "OTEL_CHUNK_SAMPLE_RATE": "1.0",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            },
        )
        platform.start()
        try:
            token = Token.objects.create(user=UserFactory()).key
        except BaseException:
            platform.stop()
            receiver.stop()
            raise
    try:
        yield platform, receiver, token
    finally:
        if request.session.testsfailed:
            print(platform.logs())
        with django_db_blocker.unblock():
            platform.stop()
            receiver.stop()
            call_command("flush", "--noinput", verbosity=0)


def _trace_with(receiver: OtlpSink, names: set[str], **where) -> list[dict] | None:
    """A trace that holds a span of each of ``names``, one of which has the attributes ``where``."""
    for spans in receiver.traces().values():
        if names <= {s["name"] for s in spans} and any(
            all(s["attributes"].get(k) == v for k, v in where.items()) for s in spans
        ):
            return spans
    return None


def _tick_enabled(enabled: bool) -> None:
    """Pause or resume beat's scheduler tick (saved one by one: beat notices a saved row)."""
    from django_celery_beat.models import PeriodicTask

    for task in PeriodicTask.objects.filter(task=SCHEDULER_TICK):
        task.enabled = enabled
        task.save()


def _ticks_stopped(worker_name: str, previous: list) -> bool:
    """Each tick bumps the worker's heartbeat acknowledgement: stopped once it holds still."""
    value = heartbeat_acknowledged(redis.Redis.from_url(settings.REDIS_URL), worker_name)
    held = value == previous[-1]
    previous.append(value)
    return held and len(previous) > 3


@pytest.fixture(scope="module")
def decided(traced, django_db_blocker) -> tuple[str, list[dict]]:
    """A session created over HTTP, and the spans of the trace that holds its start command."""
    platform, receiver, token = traced
    with django_db_blocker.unblock():
        worker = wait_for(
            lambda: GpuWorker.objects.filter(status="ready").first(), 120, message="a ready worker"
        )
        # The tick decides too (untraced: one trace a second of nothing); paused, the session's
        # arrival is the decision that starts it.
        _tick_enabled(False)
        try:
            wait_for(
                lambda seen=[b""]: _ticks_stopped(worker.name, seen), 30, interval=1.0, message="no tick"
            )
            session_id = create_session(platform, token)
            names = {"scheduler.event", "scheduler.decision", "command.send", "worker.command"}
            names |= {"worker.answer", "command.answered"}
            return session_id, wait_for(
                lambda: _trace_with(receiver, names, **{"command.kind": "start", "session.id": session_id}),
                60,
                message=f"the decision's trace; spans so far: {sorted({s['name'] for s in receiver.spans})}",
            )
        finally:
            _tick_enabled(True)


def test_a_decision_is_one_trace_from_the_event_to_the_workers_answer(decided):
    session_id, spans = decided
    ids = {s["span_id"]: s for s in spans}
    start_id = next(
        s["attributes"]["command.id"] for s in spans if s["attributes"].get("command.kind") == "start"
    )
    answered = _one(spans, "command.answered", start_id)
    answer = ids[answered["parent_span_id"]]
    command = ids[answer["parent_span_id"]]
    send = ids[command["parent_span_id"]]
    decision = ids[send["parent_span_id"]]
    # The chain, span by span, across processes: the answer recorded by the worker's reporter, given
    # and applied on the worker, sent by the decision that Celery ran.
    assert [answer["name"], command["name"], send["name"], decision["name"]] == [
        "worker.answer",
        "worker.command",
        "command.send",
        "scheduler.decision",
    ]
    assert answered["attributes"]["command.status"] == "acked"
    assert (answered["service"], command["service"]) == ("streamserve-worker", "streamserve-worker")
    assert decision["service"] == "streamserve-celery"
    # The session's own event (its creation makes it arrive, active) decided its placement.
    assert decision["attributes"]["session.id"] == session_id
    assert decision["attributes"]["scheduler.trigger"] in ("arrive", "active")
    (region_decision,) = decision["events"]
    assert region_decision["attributes"]["outcome.placements_changed"] >= 1
    # Up from the decision: the Celery task (its instrumentation carries the trace in the task's
    # headers), the event where the request was served, and the request itself at the root.
    ancestors, span = [], decision
    while span["parent_span_id"]:
        span = ids[span["parent_span_id"]]
        ancestors.append((span["name"], span["service"]))
    assert ("run/scheduling.tasks.scheduler_event", "streamserve-celery") in ancestors
    assert ("scheduler.event", "streamserve-web") in ancestors
    assert ancestors[-1][1] == "streamserve-web" and "POST" in ancestors[-1][0]


def _one(spans: list[dict], name: str, command_id: str) -> dict:
    (span,) = [s for s in spans if s["name"] == name and s["attributes"].get("command.id") == command_id]
    return span


def test_a_chunk_is_one_trace_from_the_worker_to_the_socket(traced):
    platform, receiver, token = traced
    session_id = create_session(platform, token, seed=12)  # over HTTP: no database access here
    stream = asyncio.run(Stream(platform, session_id, token).collect(chunks=2, timeout=90))
    assert len(stream.chunks) == 2, platform.logs()
    index = stream.chunks[0][0]["index"]
    spans = wait_for(
        lambda: _trace_with(
            receiver,
            {"chunk", "chunk.publish", "chunk.receive", "chunk.send"},
            **{"session.id": session_id, "chunk.index": index},
        ),
        30,
        message="the chunk's trace",
    )
    by_name = {s["name"]: s for s in spans}
    assert len({s["trace_id"] for s in spans}) == 1
    assert by_name["chunk"]["service"] == "streamserve-worker" and by_name["chunk"]["parent_span_id"] == ""
    assert by_name["chunk.publish"]["parent_span_id"] == by_name["chunk"]["span_id"]
    assert by_name["chunk.receive"]["service"] == "streamserve-web"
    assert by_name["chunk.receive"]["parent_span_id"] == by_name["chunk.publish"]["span_id"]
    assert by_name["chunk.send"]["parent_span_id"] == by_name["chunk.receive"]["span_id"]
    assert by_name["chunk"]["attributes"]["chunk.batch_size"] >= 1
    assert by_name["chunk.send"]["attributes"]["chunk.bytes"] > 0


def _sdk_imported_by_web_app(**env: str) -> bool:
    code = "import sys, controlplane.asgi; print('opentelemetry.sdk' in sys.modules)"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {
        "DEBUG": "true",
        **env,
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1] == "True"


def test_tracing_off_the_web_process_imports_no_sdk():
    assert not _sdk_imported_by_web_app()
    assert _sdk_imported_by_web_app(OTEL_ENABLED="true")  # on, it does: the check can tell
