"""The live autoscaler and one-shot jobs, on real rows through ``scheduler_run``: the jobs' backlog
against their deadlines (``job_demand_gpus``, costed as ``genserve`` costs them) scales the pool out
where the streams alone would not, and scale-in never drains a worker holding running or paused
jobs. Nothing leaves the test's transaction (commands and provisioning go out after commit)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.live.run import scheduler_run
from scheduling.live.worker_profiles import default_gpu_type, gpu_profiles
from scheduling.models import ScalingAction, SchedulerConfig
from tests.factories import GpuWorkerFactory, JobFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_seconds_a_step(settings, tmp_path):
    """A one-shot profile (``profile_model --one-shot`` shape) costing the tiny video at 2 s a step."""
    path = tmp_path / "tiny-video.json"
    point = {"width": 64, "height": 64, "frames": 16, "batch": 1, "step_s": 2.0}
    path.write_text(json.dumps({"model": "tiny", "kind": "video", "points": [point]}))
    settings.STREAMSERVE = settings.STREAMSERVE | {"JOB_PROFILES": [str(path)]}
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"scale_in_cooldown_s": 0.0, "min_gpus": 0})


def worker(name: str) -> GpuWorker:
    return GpuWorkerFactory(name=name, model_preset="tiny", gpu_type=default_gpu_type())


@pytest.mark.parametrize("with_jobs", [False, True])
def test_a_job_backlog_due_soon_scales_the_pool_out(two_seconds_a_step, with_jobs):
    worker("gpu-a")
    k = int(gpu_profiles()[default_gpu_type()].capacity)
    now = timezone.now()
    # 2K videos of 100 steps (200 s each) all due in 250 s: 1.6 K slots of work, more than one GPU
    for _ in range(2 * k if with_jobs else 0):
        JobFactory(
            kind="video", frames=16, steps=100, submitted_at=now, deadline=now + timedelta(seconds=250)
        )
    scheduler_run(trigger="tick")
    assert ScalingAction.objects.filter(direction="out").exists() == with_jobs


def test_scale_in_never_drains_a_worker_holding_a_paused_job(two_seconds_a_step):
    # Three idle workers; gpu-a, which sorts first (drained first without jobs), holds a paused job
    holder, *idle = worker("gpu-a"), worker("gpu-b"), worker("gpu-c")
    JobFactory(kind="video", frames=16, steps=100, state="paused", worker=holder, epoch=1,
               deadline=timezone.now() + timedelta(hours=1))  # fmt: skip
    scheduler_run(trigger="tick")
    statuses = dict(GpuWorker.objects.values_list("name", "status"))
    assert statuses["gpu-a"] == "ready"
    assert sorted(statuses[w.name] for w in idle) == ["draining", "ready"]
