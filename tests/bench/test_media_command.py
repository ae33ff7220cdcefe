"""``manage.py bench_media`` prints its figures as JSON with the documented keys, and names a bad flag."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import CommandError, call_command


def test_bench_media_reports_both_codecs_on_both_contents():
    out = io.StringIO()
    call_command("bench_media", width=64, height=48, chunks=2, repeats=1, json=True, stdout=out)
    report = json.loads(out.getvalue())
    for key in ("bits_per_s", "ssim", "encode_ms_p50"):
        assert report["jpeg"][key] > 0 and report["h264"][key] > 0
    assert set(report["contents"]) == {"photo", "demo"}
    assert report["contents"]["photo"]["h264"]["mime"].startswith('video/mp4; codecs="avc1.')
    matched = report["contents"]["photo"]["matched"]["h264_at_jpeg_ssim"]
    assert matched["ssim"] >= matched["jpeg_ssim"]
    assert report["machine"]["cores_logical"] >= 1


@pytest.mark.parametrize(
    ("options", "flag"),
    [({"crf": 60}, "--crf"), ({"content": "movie"}, "--content"), ({"encoder": "h265_magic"}, "--encoder")],
)
def test_bench_media_names_the_bad_flag(options, flag):
    with pytest.raises(CommandError, match=flag):
        call_command("bench_media", **options)
