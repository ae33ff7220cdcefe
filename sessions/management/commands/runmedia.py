"""``manage.py runmedia``: the media process, WebRTC peer connections beside the web process
(``sessions.webrtc.media_process``; docs/media.md). Runs until SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import signal

from django.core.management.base import BaseCommand

from sessions.webrtc.media_process import MediaProcess, media_settings_problem


class Command(BaseCommand):
    help = "Serve WebRTC viewers' peer connections for the web processes (WEBRTC_MEDIA=process)."

    def handle(self, *args, **options):
        problem = media_settings_problem()
        if problem is not None:
            self.stderr.write(f"warning: {problem}")
        try:
            import uvloop  # the web server's loop too (uvicorn picks it when installed)
        except ImportError:
            asyncio.run(self._serve())
        else:
            uvloop.run(self._serve())

    async def _serve(self) -> None:
        process = MediaProcess()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, process.stop)
        channel = await process.start()
        self.stdout.write(f"media process serving WebRTC on channel {channel}")
        self.stdout.flush()
        await process.run()
