"""Celery entry points of the scheduler: event-driven runs and the periodic tick (beat)."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import worker_init
from django.db import close_old_connections

from gpu.provisioners.registry import provisioners_by_backend
from scheduling.core.regions.transport import preload_solver
from scheduling.live.enqueue import JOBS_DISPATCH, SCHEDULER_EVENT, SCHEDULER_TICK, WORKER_RELEASE
from scheduling.live.jobs import jobs_dispatch as dispatch
from scheduling.live.liveness import workers_check
from scheduling.live.region_moves import slot_moves
from scheduling.live.regions import region_forecast_step
from scheduling.live.run import scheduler_run
from scheduling.live.scaling import release

logger = logging.getLogger(__name__)


@worker_init.connect
def _preload_transport_solver(**_kwargs) -> None:
    # The regions' transport solver is imported lazily (every other process loads these apps too);
    # the worker imports it before its pool forks, so no decision pays for it.
    preload_solver()


@shared_task(name=SCHEDULER_EVENT, time_limit=60, soft_time_limit=50, ignore_result=True)
def scheduler_event(*, trigger: str, session_id: str | None = None, was_active: bool = False) -> list[int]:
    """A session event committed: decide at once (TurboServe is event-driven)."""
    close_old_connections()
    return scheduler_run(trigger=trigger, session_id=session_id, was_active=was_active)


@shared_task(name=SCHEDULER_TICK, time_limit=60, soft_time_limit=50, ignore_result=True)
def scheduler_tick() -> dict:
    """Beat: lost workers and stuck provisioning first, then rebalance/autoscale on fresh state, then
    the job dispatcher."""
    close_old_connections()
    reconcile = []
    try:
        provisioners = provisioners_by_backend()
    except Exception:
        logger.exception("provisioners cannot be built")
        provisioners = []
    # One reconcile per backend in use, over the regions that name it (docs/provisioners.md).
    for provisioner in provisioners:
        try:
            reconcile.append(provisioner.reconcile().as_dict())
        except Exception:
            logger.exception("provisioner reconcile failed provider=%s", provisioner.name)
    lost = workers_check()
    decisions = scheduler_run(trigger="worker" if lost else "tick")
    # The streams first: one-shot jobs take the room the decision above left (issue 14).
    jobs = dispatch().as_dict()
    return {"lost": lost, "reconcile": reconcile, "decisions": decisions, "jobs": jobs}


@shared_task(name=WORKER_RELEASE, time_limit=120, soft_time_limit=110, ignore_result=True)
def worker_release(*, worker_id: int, action_id: int | None = None) -> None:
    """Scale-in: stop a drained worker's process/pod (graceful first) and mark it released."""
    close_old_connections()
    release(worker_id=worker_id, action_id=action_id)


@shared_task(name=JOBS_DISPATCH, time_limit=60, soft_time_limit=50, ignore_result=True)
def jobs_dispatch() -> dict:
    """A job change committed: dispatch at once instead of waiting for the tick."""
    close_old_connections()
    return dispatch().as_dict()


@shared_task(name="scheduling.tasks.region_forecast", time_limit=60, soft_time_limit=50, ignore_result=True)
def region_forecast() -> dict[str, float]:
    """Beat, one call a forecast slot: the router's demand forecast by origin, then the slot's moves of
    parked sessions to the regions the plan shifts load to, then the moves of running sessions whose
    saving beats their switching cost (``docs/regions.md``)."""
    close_old_connections()
    forecast = region_forecast_step()
    slot_moves()
    return forecast
