"""Mixed traces (sessions + one-shot jobs) and the job costing rule (issue 14)."""

from __future__ import annotations

import io
import json

import pytest

from scheduling.core.jobs.job_profiles import (
    BUILTIN_JOB_PROFILES,
    JobProfileError,
    job_profile_from_json,
    load_job_catalog,
)
from scheduling.sim.traces import (
    JobEvent,
    TraceError,
    TraceEvent,
    parse_mixed_trace,
    parse_trace,
    write_mixed_trace,
)

ARRIVE = '{"t": 0, "session": "s1", "event": "arrive"}'
IMAGE = '{"t": 1, "job": "j1", "event": "submit", "kind": "image", "resolution": "768x768", "steps": 28, "slo_s": 4}'
VIDEO = (
    '{"t": 2, "job": "j2", "event": "submit", "kind": "video", "model": "wan2.2-5b", '
    '"resolution": "480x480", "frames": 81, "steps": 50, "slo_s": 60.5}'
)


def test_mixed_trace_round_trips_through_the_writer():
    _, sessions, jobs = parse_mixed_trace([ARRIVE, IMAGE, VIDEO, '{"t": 3, "job": "j2", "event": "cancel"}'])
    assert [e.session for e in sessions] == ["s1"]
    assert jobs[0] == JobEvent(1.0, "j1", "submit", "image", None, 768, 768, None, 28, 4.0)
    assert jobs[1].frames == 81 and jobs[1].model == "wan2.2-5b" and jobs[1].deadline == 62.5
    assert jobs[2] == JobEvent(3.0, "j2", "cancel")
    out = io.StringIO()
    write_mixed_trace(out, sessions, jobs, meta={"name": "m"})
    assert parse_mixed_trace(out.getvalue().splitlines()) == ({"name": "m"}, sessions, jobs)


def test_session_reader_rejects_job_lines_and_names_the_mixed_reader():
    with pytest.raises(TraceError) as err:
        parse_trace([ARRIVE, IMAGE])
    assert err.value.line == 2 and "parse_mixed_trace" in str(err.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"t": 1, "job": "j9", "event": "start"}', "unknown job event"),
        (
            '{"t": 1, "job": "j9", "event": "submit", "kind": "image", "resolution": "768", "steps": 2, "slo_s": 1}',
            "'resolution'",
        ),
        (
            '{"t": 1, "job": "j9", "event": "submit", "kind": "video", "resolution": "8x8", "steps": 2, "slo_s": 1}',
            "needs 'frames'",
        ),
        (
            '{"t": 1, "job": "j9", "event": "submit", "kind": "image", "resolution": "8x8", "frames": 3, "steps": 2, "slo_s": 1}',
            "videos only",
        ),
        (
            '{"t": 1, "job": "j9", "event": "submit", "kind": "image", "resolution": "8x8", "steps": 0, "slo_s": 1}',
            "'steps'",
        ),
        (
            '{"t": 1, "job": "j9", "event": "submit", "kind": "image", "resolution": "8x8", "steps": 2, "slo_s": -1}',
            "'slo_s'",
        ),
        (
            '{"t": 1, "job": "j9", "event": "submit", "kind": "audio", "resolution": "8x8", "steps": 2, "slo_s": 1}',
            "'kind'",
        ),
        (
            '{"t": 1, "job": "j9", "event": "submit", "kind": "image", "resolution": "8x8", "steps": 2}',
            "missing",
        ),
        (
            '{"t": 1, "job": "j1", "event": "submit", "kind": "image", "resolution": "8x8", "steps": 2, "slo_s": 1}',
            "duplicate submit",
        ),
        ('{"t": 1, "job": "j7", "event": "cancel"}', "unknown job"),
        ('{"t": 1, "job": "j1", "event": "cancel", "kind": "image"}', "unknown field"),
        ('{"t": 0.5, "job": "j8", "event": "cancel"}', "time goes back"),
        ('{"t": 1, "job": "j8", "session": "s1", "event": "cancel"}', "not both"),
    ],
)
def test_malformed_job_lines_are_rejected_with_their_number(line, message):
    with pytest.raises(TraceError) as err:
        parse_mixed_trace([ARRIVE, "", IMAGE, line])
    assert err.value.line == 4
    assert message in str(err.value)


def test_nearest_point_costing_scales_by_token_count():
    wan = BUILTIN_JOB_PROFILES["wan2.2-5b"]
    # 1280x704 (880 tokens/frame) is nearest to 768² (576); costed as 768² × 880/576.
    assert wan.nearest_shape(1280, 704, 81) == (768, 768, 81)
    assert wan.step_ms(1280, 704, 81) == pytest.approx(781.57 * 880 / 576)
    # 480² × 41 frames = 11 latent frames × 225 = 2475 tokens: |ln(2475/1344)| = 0.61 is nearer
    # than |ln(4725/2475)| = 0.65, so it is costed from 256²/81 f.
    assert wan.nearest_shape(480, 480, 41) == (256, 256, 81)
    assert wan.step_ms(480, 480, 41) == pytest.approx(wan.step_ms(256, 256, 81) * 2475 / 1344)
    sd = BUILTIN_JOB_PROFILES["sd3.5-medium"]
    # Batch 3 between the measured batches 2 and 4 (linear), and a batch beats sequential steps.
    two, four = sd.step_ms(256, 256, batch=2), sd.step_ms(256, 256, batch=4)
    assert sd.step_ms(256, 256, batch=3) == pytest.approx((two + four) / 2)
    assert four < 4 * sd.step_ms(256, 256)
    # Only measured SP degrees are offered; the 768² SP-8 speedup is the slides' ×7.0.
    assert wan.degrees(768, 768, 81) == (1, 2, 4, 8) and sd.degrees(768, 768) == (1,)
    assert wan.speedup(768, 768, 81, 8) == pytest.approx(7.0, abs=0.01)
    with pytest.raises(JobProfileError):
        sd.step_ms(768, 768, sp=2)


def test_one_shot_profile_json_loads_and_becomes_the_default():
    data = {
        "model": "tiny-image",
        "kind": "image",
        "gpu_type": "cpu",
        "token_patch": 8,
        "temporal_stride": 1,
        "default_steps": 4,
        "points": [{"width": 64, "height": 64, "frames": 1, "batch": 1, "sp": 1, "step_ms": 12.5}],
    }
    profile = job_profile_from_json(json.loads(json.dumps(data)))
    assert profile.step_ms(128, 64, batch=2) == pytest.approx(12.5 * 2 * 2)
    with pytest.raises(JobProfileError, match="unknown field"):
        job_profile_from_json({**data, "bogus": 1})
    with pytest.raises(JobProfileError, match="batch-1, SP-1"):
        job_profile_from_json({**data, "points": [{**data["points"][0], "batch": 2}]})
    # Block boundaries (where a step is abandoned for streams): 1 unless the profile says
    assert profile.blocks == 1 and job_profile_from_json({**data, "blocks": 4}).blocks == 4
    assert job_profile_from_json(job_profile_from_json({**data, "blocks": 4}).to_json()).blocks == 4
    with pytest.raises(JobProfileError, match="blocks"):
        job_profile_from_json({**data, "blocks": 0})
    catalog = load_job_catalog()
    assert catalog.profile("video", None).model == "wan2.2-5b"
    with pytest.raises(JobProfileError, match="not image"):
        catalog.profile("image", "wan2.2-5b")


def test_profile_model_one_shot_output_loads_as_is():
    # The shape workers/benchmarks/jobs.py:profile_one_shot writes (seconds per step, no SP).
    written = {
        "model": "tiny",
        "kind": "video",
        "points": [
            {"width": 64, "height": 64, "frames": 8, "batch": 1, "step_s": 0.004},
            {"width": 64, "height": 64, "frames": 16, "batch": 1, "step_s": 0.007},
            {"width": 64, "height": 64, "frames": 16, "batch": 2, "step_s": 0.012},
        ],
        "machine": "cpu: x86_64, 2 logical cores, torch threads 1",
    }
    profile = job_profile_from_json(written)
    assert profile.step_ms(64, 64, 16, batch=2) == pytest.approx(12.0)
    assert profile.degrees(64, 64, 16) == (1,) and profile.default_steps == 50
    # Tokens default to pixels × frames: 128×64×16 is costed from 64×64×16 at twice the tokens.
    assert profile.step_ms(128, 64, 16) == pytest.approx(14.0)
    with pytest.raises(JobProfileError, match="step_ms"):
        job_profile_from_json({**written, "points": [{"width": 8, "height": 8, "frames": 1, "batch": 1}]})


def test_writer_orders_sessions_before_jobs_at_equal_times():
    out = io.StringIO()
    submit = JobEvent(1.0, "j", "submit", "image", None, 8, 8, None, 2, 1.0)
    write_mixed_trace(out, [TraceEvent(1.0, "s1", "arrive")], [submit])
    assert [list(json.loads(line))[1] for line in out.getvalue().splitlines()] == ["session", "job"]
