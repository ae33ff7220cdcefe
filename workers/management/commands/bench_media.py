"""``manage.py bench_media``: JPEG against H.264 fragments per stream, at real frame sizes (docs/media.md)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from workers.benchmarks.media import CONTENTS, format_media_bench, run_media_bench


class Command(BaseCommand):
    help = (
        "Benchmark (lab): bits per second, bytes per chunk, encode time per chunk on one core, and "
        "PSNR/SSIM of JPEG and H.264 (fragmented MP4, one closed GOP per chunk) on natural content."
    )

    def add_arguments(self, parser):
        parser.add_argument("--width", type=int, default=832)
        parser.add_argument("--height", type=int, default=480)
        parser.add_argument("--fps", type=float, default=16.0)
        parser.add_argument("--frames-per-chunk", type=int, default=12)
        parser.add_argument("--chunks", type=int, default=4, help="chunks of each content (default 4)")
        parser.add_argument(
            "--content",
            default=",".join(CONTENTS),
            help=f"comma-separated, first is the headline ({', '.join(CONTENTS)})",
        )
        parser.add_argument("--jpeg-quality", type=int, default=85)
        parser.add_argument("--crf", type=int, default=23)
        parser.add_argument("--preset", default="veryfast", help="x264 preset")
        parser.add_argument("--threads", type=int, default=1, help="encoder threads (default 1: one core)")
        parser.add_argument("--encoder", default="libx264", help="libx264, libopenh264 or h264_nvenc")
        parser.add_argument(
            "--no-match",
            action="store_true",
            help="skip the search for each codec's setting at the other's SSIM",
        )
        bench.add_repeats_argument(parser, default=3, help="passes over the chunks for encode times")
        bench.add_seed_argument(parser)
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        for flag in ("width", "height", "frames_per_chunk", "chunks", "repeats"):
            if options[flag] < 1:
                raise CommandError(f"--{flag.replace('_', '-')} must be at least 1")
        if options["fps"] <= 0:
            raise CommandError("--fps must be positive")
        if not 1 <= options["jpeg_quality"] <= 95:
            raise CommandError("--jpeg-quality must be within 1..95")
        if not 0 <= options["crf"] <= 51:
            raise CommandError("--crf must be within 0..51")
        contents = tuple(c.strip() for c in options["content"].split(",") if c.strip())
        unknown = [c for c in contents if c not in CONTENTS]
        if not contents or unknown:
            raise CommandError(f"--content: choose from {', '.join(CONTENTS)} (got {options['content']!r})")
        import av

        if options["encoder"] not in av.codecs_available:
            raise CommandError(f"--encoder: {options['encoder']!r} is not in this FFmpeg build")
        report = run_media_bench(
            width=options["width"],
            height=options["height"],
            fps=options["fps"],
            frames_per_chunk=options["frames_per_chunk"],
            chunks=options["chunks"],
            contents=contents,
            jpeg_quality=options["jpeg_quality"],
            crf=options["crf"],
            preset=options["preset"],
            threads=options["threads"],
            encoder_name=options["encoder"],
            repeats=options["repeats"],
            seed=options["seed"],
            match_quality=not options["no_match"],
        )
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_media_bench,
            write=self.stdout.write,
        )
