"""WebRTC viewers for ``bench_delivery --webrtc-viewers``, in their own process
(``python -m sessions.benchmarks.webrtc_clients``).

N aiortc peers, spread round-robin over the run's sessions, each on its own session socket
(``?transport=webrtc``): the offer goes over the socket, the answer comes back, and the web process
sends the session's H.264 over the peer connection as it would to a browser (ICE, DTLS, SRTP, RTP
packetization, pacing: everything the web process does per WebRTC viewer).

The peers receive and depacketize every picture but do not decode it: a browser decodes on its own
machine, and N software decoders of 832×480 here would take the CPUs the web process is measured on.
So aiortc's decoder is replaced, in this process only, by one that counts the pictures it is handed
(``CountingDecoder``). Nothing here imports Django.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import aiortc.rtcrtpreceiver
import websockets
from aiortc import RTCPeerConnection, RTCSessionDescription

CONNECT_TIMEOUT_S = 60.0


class CountingDecoder:
    """Stands in for aiortc's H.264 decoder: counts the complete pictures the jitter buffer hands it
    (bytes too) and returns none, so nothing is decoded."""

    lock = threading.Lock()
    pictures = 0
    picture_bytes = 0

    def decode(self, encoded_frame) -> list:
        with CountingDecoder.lock:
            CountingDecoder.pictures += 1
            CountingDecoder.picture_bytes += len(encoded_frame.data)
        return []


def _counting_decoder(codec) -> CountingDecoder:
    return CountingDecoder()


async def _peer(url: str, record: dict[str, Any], gate: asyncio.Semaphore, stop: asyncio.Event) -> None:
    pc = RTCPeerConnection()
    connected = asyncio.Event()

    @pc.on("connectionstatechange")
    def _state() -> None:
        record["state"] = pc.connectionState
        if pc.connectionState == "connected":
            connected.set()

    try:
        async with gate:  # a few at a time, as users arrive (each connect reads the database)
            ws = await websockets.connect(url, max_size=None, ping_interval=None, compression=None)
            pc.addTransceiver("video", direction="recvonly")
            await pc.setLocalDescription(await pc.createOffer())  # aiortc gathers first: no trickle
            await ws.send(json.dumps({"type": "webrtc.offer", "sdp": pc.localDescription.sdp}))
            while True:
                message = json.loads(await ws.recv())
                if message.get("type") == "webrtc.answer":
                    break
                if message.get("type") == "error":
                    raise RuntimeError(f"signalling refused: {message}")
            await pc.setRemoteDescription(RTCSessionDescription(sdp=message["sdp"], type="answer"))
            await asyncio.wait_for(connected.wait(), CONNECT_TIMEOUT_S)
        record["connected_at"] = time.time()
        reader = asyncio.ensure_future(_read_socket(ws, record))
        await stop.wait()
        reader.cancel()
        await ws.close()
    except Exception as exc:  # reported, and the run goes on with the peers that connected
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        await pc.close()


async def _read_socket(ws, record: dict[str, Any]) -> None:
    """The socket's text frames for this viewer: one ``webrtc.chunk`` per chunk sent, ``skipped``."""
    try:
        async for message in ws:
            if isinstance(message, str):
                kind = json.loads(message).get("type")
                if kind in ("webrtc.chunk", "skipped"):
                    record[kind] = record.get(kind, 0) + 1
    except websockets.ConnectionClosed:
        pass


async def run_peers(
    *, base_url: str, token: str, session_ids: list[str], viewers: int, ready: Path, stop_file: Path
) -> dict[str, Any]:
    records = [{"session": session_ids[i % len(session_ids)]} for i in range(viewers)]
    gate, stop = asyncio.Semaphore(8), asyncio.Event()
    tasks = [
        asyncio.ensure_future(
            _peer(f"{base_url}/ws/sessions/{r['session']}/?token={token}&transport=webrtc", r, gate, stop)
        )
        for r in records
    ]
    began = time.monotonic()
    while not all("connected_at" in r or "error" in r for r in records):
        if time.monotonic() - began > CONNECT_TIMEOUT_S * 2:
            break
        await asyncio.sleep(0.1)
    ready.write_text("ready")
    while not stop_file.exists():
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "viewers": viewers,
        "connected": sum("connected_at" in r for r in records),
        "errors": [r["error"] for r in records if "error" in r][:5],
        "chunks_announced": sum(r.get("webrtc.chunk", 0) for r in records),
        "skipped": sum(r.get("skipped", 0) for r in records),
        "pictures_received": CountingDecoder.pictures,
        "picture_bytes_received": CountingDecoder.picture_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions-file", required=True)
    parser.add_argument("--viewers", type=int, required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    aiortc.rtcrtpreceiver.get_decoder = _counting_decoder  # this process only: see the docstring
    result = asyncio.run(
        run_peers(
            base_url=args.base_url,
            token=args.token,
            session_ids=json.loads(Path(args.sessions_file).read_text()),
            viewers=args.viewers,
            ready=Path(args.ready_file),
            stop_file=Path(args.stop_file),
        )
    )
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
