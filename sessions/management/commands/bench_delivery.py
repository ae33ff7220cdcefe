"""``manage.py bench_delivery``: worker → channel layer → WebSocket delivery delay with S streams."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from sessions.benchmarks.delivery import DEPLOYED_APP, format_verdict, run_delivery
from workers.benchmarks.content import CONTENTS
from workers.benchmarks.live import ServiceUnavailable


class Command(BaseCommand):
    help = "Benchmark worker → channel layer → WebSocket delivery delay with S concurrent streams."

    def add_arguments(self, parser):
        parser.add_argument(
            "--streams", default="50,200", help="comma-separated stream counts (default 50,200)"
        )
        parser.add_argument(
            "--chunks-per-stream", type=int, default=40, help="chunks per stream (default 40)"
        )
        bench.add_warmup_argument(parser, default=2, help="first chunks of each stream not counted")
        parser.add_argument(
            "--period", type=float, default=0.5, help="seconds between a stream's chunks (tiny: 0.5)"
        )
        parser.add_argument(
            "--database",
            default=None,
            help="database on the configured server (default <configured name>_bench, created and migrated)",
        )
        parser.add_argument(
            "--channel-layer",
            choices=("configured", "pubsub"),
            default="configured",
            help="configured: settings.CHANNEL_LAYERS as deployed; pubsub: the same Redis through"
            " channels_redis.pubsub.RedisPubSubChannelLayer (a settings overlay for the server and publisher"
            " only, to compare)",
        )
        parser.add_argument(
            "--asgi-app",
            default=DEPLOYED_APP,
            help="ASGI application uvicorn serves (to compare a patched consumer; default the deployed one)",
        )
        parser.add_argument("--width", type=int, default=64, help="frame width (default 64: tiny)")
        parser.add_argument("--height", type=int, default=64, help="frame height (default 64: tiny)")
        parser.add_argument("--frames", type=int, default=4, help="frames per chunk (default 4: tiny)")
        parser.add_argument(
            "--codec",
            choices=("jpeg", "h264"),
            default="jpeg",
            help="what the viewers read: JPEG frames, or one H.264 fmp4 fragment per chunk (docs/media.md)",
        )
        parser.add_argument(
            "--content",
            choices=CONTENTS,
            default="photo",
            help="the chunks' frames: photo, a panned and zoomed photograph (natural content, default);"
            " noise, smooth noise no codec compresses (the worst case for bytes)",
        )
        parser.add_argument("--publishers", type=int, default=1, help="publisher processes (like workers)")
        parser.add_argument(
            "--webrtc-viewers",
            default=None,
            help="comma-separated counts N (e.g. 0,10,50): for each stream count, one run per N with N"
            " WebRTC viewers (aiortc peers) beside the socket clients, and the web process's event-loop"
            " lag reported (needs --codec h264)",
        )
        parser.add_argument(
            "--webrtc-media",
            choices=("process", "inline"),
            default="process",
            help="where the WebRTC viewers' peer connections run: process (a media process beside the web"
            " process, as deployed by default; its CPU is reported) or inline (in the web process)",
        )
        parser.add_argument(
            "--tracing",
            choices=("off", "on"),
            default="off",
            help="OpenTelemetry traces in the server and publisher processes (docs/observability.md), exported"
            " to an OTLP receiver in this process; off (default) as deployed",
        )
        parser.add_argument(
            "--chunk-sample-rate",
            type=float,
            default=None,
            help="with --tracing on: the share of chunks traced, 0..1 (default OTEL_CHUNK_SAMPLE_RATE's)",
        )
        parser.add_argument("--keep-logs", default=None, help="copy the processes' logs to this folder")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        streams = list(list_option(options, "streams", int, minimum=1))
        for flag in ("width", "height", "frames"):
            if options[flag] < 1:
                raise CommandError(f"--{flag} must be at least 1")
        chunks, warmup = options["chunks_per_stream"], options["warmup"]
        if not streams or min(streams) < 1 or chunks < 1 or warmup < 0 or warmup >= chunks:
            raise CommandError("--streams must be positive counts and 0 <= --warmup < --chunks-per-stream")
        webrtc_viewers = list_option(options, "webrtc_viewers", int, minimum=0) or ()
        if webrtc_viewers and options["codec"] != "h264":
            raise CommandError("--webrtc-viewers: WebRTC carries H.264 only; add --codec h264")
        if webrtc_viewers and options["asgi_app"] != DEPLOYED_APP:
            raise CommandError("--webrtc-viewers measures the deployed application: leave --asgi-app out")
        rate = options["chunk_sample_rate"]
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise CommandError("--chunk-sample-rate must be between 0 and 1")
        if rate is not None and options["tracing"] == "off":
            raise CommandError("--chunk-sample-rate needs --tracing on")
        if options["tracing"] == "on" and rate is None:
            rate = settings.TRACING["CHUNK_SAMPLE_RATE"]
        try:
            report = run_delivery(
                streams=streams,
                chunks=chunks,
                warmup=warmup,
                period=options["period"],
                database=options["database"],
                channel_layer=options["channel_layer"],
                asgi_app=options["asgi_app"],
                publishers=options["publishers"],
                keep_logs=options["keep_logs"],
                shape={key: options[key] for key in ("width", "height", "frames", "codec", "content")},
                webrtc_viewers=webrtc_viewers,
                webrtc_media=options["webrtc_media"],
                chunk_sample_rate=rate if options["tracing"] == "on" else None,
                say=bench.quiet_unless_text(options["json"], self.stdout.write),
            )
        except ServiceUnavailable as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_verdict,
            write=self.stdout.write,
        )
