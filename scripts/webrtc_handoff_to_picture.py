"""WebRTC hand-off to picture, in headless Chromium: from a chunk handed to a web-side WebRTC viewer
(``WebRtcViewer.offer_chunk``, what the session socket does once the channel layer delivers it) to its
first picture presented (``requestVideoFrameCallback``), at 832×480, 12 frames per chunk, 16 fps, one
chunk every 750 ms, over loopback. The aiortc side and Chromium share this machine's clock.

Not glass to glass: the worker's encode and the channel-layer hop are not in it (docs/media.md).
Run: ``.venv/bin/python scripts/webrtc_handoff_to_picture.py [chunks]``.
"""

import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from playwright.async_api import async_playwright

from sessions.webrtc.access_units import AccessUnitCache
from sessions.webrtc.peer import WebRtcViewer
from workers.runtime.media import FragmentEncoder

W, H, N, FPS = 832, 480, 12, 16


def media(index):
    fr = np.empty((N, H, W, 3), np.uint8)
    fr[:] = (index * 37) % 256
    for i in range(N):
        fr[i, :, (i * W // N) : (i * W // N) + W // 8] = 250
    f = FragmentEncoder().encode(fr, fps=FPS, chunk_index=index, frames_per_chunk=N)
    return {"init": f.init, "fragment": f.data, "mime": f.mime, "encoder": f.encoder}


async def main():
    chunks = [media(i) for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20)]
    async with async_playwright() as p:
        b = await p.chromium.launch(
            executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        pg = await b.new_page()
        await pg.goto("about:blank")
        await pg.set_content("<video id=v muted autoplay playsinline></video>")
        offer = await pg.evaluate("""async () => { const pc = new RTCPeerConnection(); window.pc = pc; window.shown=[];
          pc.addTransceiver('video', {direction: 'recvonly'});
          pc.ontrack = (e) => { const v = document.getElementById('v'); v.srcObject = new MediaStream([e.track]); v.play();
             const f = (now, m) => { window.shown.push([performance.timeOrigin + (m.presentationTime||now), m.rtpTimestamp]); v.requestVideoFrameCallback(f); }; v.requestVideoFrameCallback(f); };
          const o = await pc.createOffer(); await pc.setLocalDescription(o); return o.sdp; }""")
        v = WebRtcViewer(
            ice=[],
            cache=AccessUnitCache(),
            on_started=lambda h: None,
            on_skipped=print,
            on_state=lambda s: None,
        )
        await pg.evaluate("(sdp) => pc.setRemoteDescription({type:'answer', sdp})", await v.answer(offer))
        while not v.live:
            await asyncio.sleep(0.05)
        handed = []
        for i, m in enumerate(chunks):  # one chunk per 750 ms, as a worker in real time
            handed.append(time.time() * 1000)
            v.offer_chunk(("s", 0, i, "x"), {"index": i}, m)
            await asyncio.sleep(N / FPS)
        await asyncio.sleep(1)
        shown = await pg.evaluate("window.shown")
        # first presented frame of each chunk: shown frames in order, 12 per chunk
        firsts = [shown[i * N][0] for i in range(len(shown) // N)]
        d = sorted(f - h for f, h in zip(firsts, handed, strict=False))
        print(
            "frames shown",
            len(shown),
            "of",
            len(chunks) * N,
            "chunk hand-off → first frame presented ms: p50",
            round(statistics.median(d), 1),
            "max",
            round(d[-1], 1),
            "n",
            len(d),
        )
        await v.close()
        await b.close()


asyncio.run(main())
