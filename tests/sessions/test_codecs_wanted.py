"""Which codecs a session's viewers want (contracts/wire/codecs.py), on real Redis."""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings

from contracts.wire import codecs
from contracts.wire.codecs import codec_leave, codec_want, codecs_wanted_many


@pytest.fixture
def client():
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    for key in client.scan_iter("ss:codecs:*"):
        client.delete(key)


def test_nobody_asked_means_both_and_each_viewer_adds_its_codec(client):
    both = {"h264", "jpeg"}
    assert codecs_wanted_many(client, ["s1", "s2"]) == {"s1": both, "s2": both}
    codec_want(client, "s1", "h264", "viewer-a")
    codec_want(client, "s1", "jpeg", "viewer-b")
    codec_want(client, "s2", "h264", "viewer-c")
    assert codecs_wanted_many(client, ["s1", "s2"]) == {"s1": {"h264", "jpeg"}, "s2": {"h264"}}
    assert codecs_wanted_many(client, []) == {}


def test_a_lease_runs_out_unless_refreshed_and_a_leaving_viewer_lingers(client, monkeypatch):
    codec_want(client, "s1", "h264", "viewer-a", ttl_s=0.2)
    time.sleep(0.3)
    assert codecs_wanted_many(client, ["s1"]) == {"s1": {"h264", "jpeg"}}  # back to nobody asked
    monkeypatch.setattr(codecs, "CODEC_LINGER_S", 0.3)
    codec_want(client, "s1", "h264", "viewer-a")
    codec_leave(client, "s1", "h264", "viewer-a")
    assert codecs_wanted_many(client, ["s1"]) == {"s1": {"h264"}}  # a reload finds it still encoded
    assert client.ttl(codecs.codecs_key("s1")) > 0  # the key goes by itself


def test_an_unknown_codec_is_refused(client):
    with pytest.raises(ValueError, match="unknown codec 'vp9'"):
        codec_want(client, "s1", "vp9", "viewer-a")
