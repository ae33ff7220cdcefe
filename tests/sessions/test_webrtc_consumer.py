"""WebRTC on the session socket (``?transport=webrtc``): signalling and its bad input, and a real
aiortc peer standing in for the browser: it receives the session's chunks as decoded pictures, each
admitted index once, from the current owner only, with the viewer counted for the H.264 lease.

The peer connections run where the deployment runs them: in a real media process (``manage.py
runmedia``, started for this module, ``WEBRTC_MEDIA=process``, the default) and, for the pictures
test, also in the web process itself (``inline``)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import redis
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from contracts.wire.codecs import codecs_wanted_many
from contracts.wire.frames import chunk_message, decode_chunk_frame, group_name
from contracts.wire.viewers import viewer_count
from sessions.viewers import viewers_client
from sessions.webrtc.relay import MediaRelay, media_process_leave, media_process_register
from tests.factories import SessionFactory, UserFactory
from tests.sessions.sockets import connect_as
from tests.webrtc_media import media_process
from workers.runtime.media import FragmentEncoder

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.asyncio,
    pytest.mark.usefixtures("close_thread_connections"),
]

PER_CHUNK, FPS = 4, 8


@pytest.fixture(scope="module", autouse=True)
def a_media_process(tmp_path_factory):
    with media_process(tmp_path_factory.mktemp("media") / "runmedia.log") as process:
        yield process


# A browser's offer, cut down to what aiortc reads: valid SDP that only VP8 can satisfy.
VP8_ONLY_OFFER = (
    "v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\na=group:BUNDLE 0\r\n"
    "m=video 9 UDP/TLS/RTP/SAVPF 96\r\nc=IN IP4 0.0.0.0\r\na=mid:0\r\na=recvonly\r\na=rtcp-mux\r\n"
    "a=ice-ufrag:abcd\r\na=ice-pwd:abcdefghijklmnopqrstuvwx\r\n"
    "a=fingerprint:sha-256 " + ":".join(["AB"] * 32) + "\r\na=setup:actpass\r\n"
    "a=rtpmap:96 VP8/90000\r\n"
)


async def webrtc_socket(session, user, query: str = "?transport=webrtc"):
    communicator = await connect_as(user, f"/ws/sessions/{session.pk}/{query}")
    status = json.loads(await communicator.receive_from())
    assert status["type"] == "status"
    return communicator


async def next_text(communicator, timeout: float = 5) -> dict:
    """The next text frame other than the peer connection's state changes."""
    while True:
        data = await communicator.receive_output(timeout)
        if data["type"] == "websocket.send" and data.get("text") is not None:
            message = json.loads(data["text"])
            if message["type"] != "webrtc.state":
                return message


async def next_binary(communicator, timeout: float = 5) -> bytes:
    while True:
        data = await communicator.receive_output(timeout)
        if data["type"] == "websocket.send" and data.get("bytes") is not None:
            return data["bytes"]


async def an_owner_and_session():
    user = await sync_to_async(UserFactory)()
    return user, await sync_to_async(SessionFactory)(owner=user)


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "code", "named"),
    [
        ({"type": "webrtc.offer"}, "bad_sdp", "needs an 'sdp' string"),
        ({"type": "webrtc.offer", "sdp": "hello"}, "bad_sdp", "must start with 'v=0'"),
        ({"type": "webrtc.offer", "sdp": "v=0\r\ns=-\r\n"}, "bad_sdp", "no video section"),
        ({"type": "webrtc.offer", "sdp": VP8_ONLY_OFFER}, "bad_sdp", "H.264"),
        (
            {
                "type": "webrtc.offer",
                "sdp": "v=0\r\nm=video 9 RTP\r\na=rtpmap:1 H264/90000\r\na=fmtp:1 packetization-mode=1",
            },
            "bad_sdp",
            "malformed SDP",
        ),
        (
            {"type": "webrtc.ice", "candidate": "candidate:1 1 udp 1 127.0.0.1 9 typ host"},
            "bad_signal",
            "offer",
        ),
        ({"type": "webrtc.bye"}, "bad_message", "webrtc.offer, webrtc.ice"),
    ],
)
async def test_bad_signalling_is_an_error_frame_naming_it_and_the_socket_carries_on(message, code, named):
    # Given a WebRTC viewer and, beside it, a socket viewer of the same session
    user, session = await an_owner_and_session()
    communicator = await webrtc_socket(session, user)
    beside = await webrtc_socket(session, user, "?codec=jpeg")

    # When it sends a malformed signalling message
    await communicator.send_to(text_data=json.dumps(message))

    # Then an error frame names the problem
    error = await next_text(communicator)
    assert error["type"] == "error" and error["code"] == code and named in error["detail"], error

    # and the socket stays open and answers the next message; the other viewer is unaffected
    await communicator.send_to(text_data=json.dumps({"type": "prompt", "text": "a lighthouse"}))
    assert (await next_text(communicator))["type"] == "prompt"
    header = {"session": str(session.pk), "index": 0, "epoch": 1, "generated_at": 0.0, "mime": "image/jpeg"}
    await get_channel_layer().group_send(group_name(str(session.pk)), chunk_message(header, [b"\xff\xd8a"]))
    received, frames = decode_chunk_frame(await next_binary(beside))
    assert received["index"] == 0 and frames == [b"\xff\xd8a"]
    await communicator.disconnect()
    await beside.disconnect()


async def test_signalling_on_a_socket_opened_without_webrtc_is_refused_by_name():
    user, session = await an_owner_and_session()
    communicator = await webrtc_socket(session, user, "?codec=h264")
    await communicator.send_to(text_data=json.dumps({"type": "webrtc.offer", "sdp": "v=0"}))
    error = await next_text(communicator)
    assert error["code"] == "bad_signal" and "?transport=webrtc" in error["detail"]
    await communicator.disconnect()


async def test_webrtc_with_a_jpeg_codec_or_an_unknown_transport_stays_on_the_socket():
    user, session = await an_owner_and_session()
    for query, named in [
        ("?transport=webrtc&codec=jpeg", "h264 only"),
        ("?transport=carrier-pigeon", "socket, webrtc"),
    ]:
        communicator = await webrtc_socket(session, user, query)
        error = await next_text(communicator)
        assert error["code"] == "bad_transport" and named in error["detail"], error
        await communicator.disconnect()


async def test_a_malformed_candidate_after_an_offer_is_an_error_frame():
    user, session = await an_owner_and_session()
    communicator = await webrtc_socket(session, user)
    browser = await a_browser()
    await communicator.send_to(
        text_data=json.dumps({"type": "webrtc.offer", "sdp": browser.localDescription.sdp})
    )
    assert (await next_text(communicator))["type"] == "webrtc.answer"
    await communicator.send_to(
        text_data=json.dumps({"type": "webrtc.ice", "candidate": "candidate:x", "sdpMid": "0"})
    )
    error = await next_text(communicator)
    assert error["code"] == "bad_candidate" and "candidate:x" in error["detail"]
    await browser.close()
    await communicator.disconnect()


# --- media -----------------------------------------------------------------------------------------


async def a_browser() -> RTCPeerConnection:
    """An aiortc peer that offers to receive video, as the page does (VP8 and H.264 offered)."""
    pc = RTCPeerConnection()
    pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    return pc


def an_h264_chunk(session, index: int, epoch: int, grey: int) -> dict:
    frames = np.full((PER_CHUNK, 64, 64, 3), grey, np.uint8)
    fragment = FragmentEncoder().encode(frames, fps=FPS, chunk_index=index, frames_per_chunk=PER_CHUNK)
    header = {
        "session": str(session.pk),
        "index": index,
        "epoch": epoch,
        "generation_ms": 10.0,
        "generated_at": 0.0,
        "worker": f"w{epoch}",
        "batch_size": 1,
        "fps": FPS,
        "frames_per_chunk": PER_CHUNK,
    }
    media = {"init": fragment.init, "fragment": fragment.data, "mime": fragment.mime, "encoder": "libx264"}
    return chunk_message(header, [], media=media)


@pytest.mark.parametrize("where", ["process", "inline"])
async def test_a_webrtc_viewer_receives_each_admitted_chunk_once_as_pictures(where, monkeypatch):
    # Given a WebRTC viewer (an aiortc peer for the browser) connected through the session socket,
    # its peer connection in the media process or in the web process
    monkeypatch.setitem(settings.STREAMSERVE, "WEBRTC_MEDIA", where)
    user, session = await an_owner_and_session()
    communicator = await webrtc_socket(session, user)
    client = redis.Redis.from_url(settings.REDIS_URL)
    # counted as a viewer, and asking the worker for H.264
    assert codecs_wanted_many(client, [str(session.pk)])[str(session.pk)] == {"h264"}
    assert viewer_count(viewers_client(), str(session.pk)) == 1
    browser = await a_browser()
    pictures: list[np.ndarray] = []
    readers: list[asyncio.Task] = []
    connected = asyncio.Event()

    @browser.on("track")
    def on_track(track):
        async def read():
            try:
                while True:
                    pictures.append((await track.recv()).to_ndarray(format="rgb24"))
            except MediaStreamError:
                pass

        readers.append(asyncio.ensure_future(read()))

    @browser.on("connectionstatechange")
    def on_state():
        if browser.connectionState == "connected":
            connected.set()

    await communicator.send_to(
        text_data=json.dumps({"type": "webrtc.offer", "sdp": browser.localDescription.sdp})
    )
    answer = await next_text(communicator)
    assert answer["type"] == "webrtc.answer" and "H264/90000" in answer["sdp"] and "VP8" not in answer["sdp"]
    await browser.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    await asyncio.wait_for(connected.wait(), 10)

    # When the old owner and the new one both publish (a migration: epoch 1 then 2, copies and
    # stale chunks interleaved, as in the socket's own fencing tests)
    layer, group = get_channel_layer(), group_name(str(session.pk))
    # (aiortc's receiver hands a picture on once the next one begins: chunk 3 follows so that chunk
    # 2's last picture comes out)
    arrivals = [(0, 1, 40), (1, 2, 120), (1, 1, 250), (2, 1, 250), (2, 2, 200), (3, 2, 80)]
    for index, epoch, grey in arrivals:
        await layer.group_send(group, an_h264_chunk(session, index, epoch, grey))

    # Then the socket announces chunks 0 (old owner), 1 and 2 (new owner), each once, in order
    announced = []
    while len(announced) < 4:
        message = await next_text(communicator)
        if message["type"] == "webrtc.chunk":
            announced.append((message["index"], message["epoch"], message["transport"]))
    assert announced == [(0, 1, "webrtc"), (1, 2, "webrtc"), (2, 2, "webrtc"), (3, 2, "webrtc")]

    # and the peer decodes their pictures and no other: 4 of each, the stale owner's grey 250 never
    for _ in range(40):
        if len(pictures) >= 3 * PER_CHUNK + 1:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)
    greys = [round(float(p.mean())) for p in pictures]
    assert 3 * PER_CHUNK < len(greys) <= 4 * PER_CHUNK, greys
    for chunk, grey in enumerate((40, 120, 200, 80)):
        shown = greys[chunk * PER_CHUNK : (chunk + 1) * PER_CHUNK]
        assert shown and all(abs(g - grey) <= 3 for g in shown), (chunk, greys)
    await browser.close()
    await communicator.disconnect()
    client.delete(f"ss:codecs:{session.pk}")


async def test_an_offer_no_media_process_answers_is_an_error_frame_and_the_socket_carries_on(monkeypatch):
    # Given a media process that holds its lease but no longer reads its channel (killed within it)
    monkeypatch.setitem(settings.STREAMSERVE, "WEBRTC_MEDIA_ANSWER_TIMEOUT_S", 1.0)
    client = redis.Redis.from_url(settings.REDIS_URL)
    await sync_to_async(media_process_register)(client, "specific.gone", -1)  # the fewest peers: chosen
    try:
        user, session = await an_owner_and_session()
        communicator = await webrtc_socket(session, user)
        browser = await a_browser()

        # When the page offers
        await communicator.send_to(
            text_data=json.dumps({"type": "webrtc.offer", "sdp": browser.localDescription.sdp})
        )

        # Then an error frame says WebRTC is unavailable (the page falls back to the socket)
        error = await next_text(communicator)
        assert error["type"] == "error" and error["code"] == "webrtc_unavailable", error
        assert "did not answer within 1 s" in error["detail"]
        # and the socket carries on
        await communicator.send_to(text_data=json.dumps({"type": "prompt", "text": "a lighthouse"}))
        assert (await next_text(communicator))["type"] == "prompt"
        await browser.close()
        await communicator.disconnect()
    finally:
        await sync_to_async(media_process_leave)(client, "specific.gone")


async def test_a_media_process_whose_lease_lapses_is_a_failed_connection_to_its_viewer():
    # Given a viewer's relay answered by a registered media process
    client = redis.Redis.from_url(settings.REDIS_URL)
    await sync_to_async(media_process_register)(client, "specific.serving", 1)
    states: list[str] = []
    relay = MediaRelay(
        layer=get_channel_layer(),
        session_id="s",
        ice=[],
        on_started=lambda header: None,
        on_skipped=lambda index: None,
        on_state=states.append,
        on_error=lambda code, detail: None,
    )
    relay.media_channel = "specific.serving"
    relay.answered = asyncio.get_running_loop().create_future()
    relay.answered.set_result({"event": "answer", "sdp": "v=0"})

    # While its lease holds, nothing is said
    await relay.check_alive()
    assert states == []

    # When the media process is gone from the registry (stopped, or its lease lapsed)
    await sync_to_async(media_process_leave)(client, "specific.serving")
    await relay.check_alive()
    await relay.check_alive()

    # Then the page is told the connection failed, once (it falls back to the socket)
    assert states == ["failed"]
