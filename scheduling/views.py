"""Pages of the operator console: the console, the audit page and the console's page-only JSON.

Thin views: pages render a template whose scripts talk to the REST API and the WebSockets; the
console's few page-only JSON endpoints (snapshot, actions) call ``scheduling.console``.
"""

from __future__ import annotations

import json
from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET, require_POST

from gpu.models import GpuWorker
from gpu.services import TransitionError
from scheduling import console
from sessions.models import GenerationSession


def staff_required(view):
    """Anonymous visitors go to the login page; logged-in non-staff get a 403 (not a login loop)."""

    @wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs):
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not request.user.is_staff:
            raise PermissionDenied("The operator console is for staff only.")
        return view(request, *args, **kwargs)

    return wrapped


def _json_staff_required(view):
    """Like ``staff_required`` for JSON endpoints: 401/403 with a JSON reason instead of a redirect."""

    @wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs):
        if not request.user.is_authenticated:
            return JsonResponse({"detail": "Authentication credentials were not provided."}, status=401)
        if not request.user.is_staff:
            return JsonResponse({"detail": "You do not have permission to perform this action."}, status=403)
        return view(request, *args, **kwargs)

    return wrapped


@staff_required
@require_GET
def console_page(request: HttpRequest):
    return render(
        request,
        "console/console.html",
        {"snapshot": console.cluster_snapshot(), "page": "console"},
    )


@staff_required
@require_GET
def audit_page(request: HttpRequest):
    return render(request, "console/audit.html", {"page": "audit"})


@_json_staff_required
@require_GET
def console_snapshot(request: HttpRequest):
    return JsonResponse(console.cluster_snapshot())


def _body(request: HttpRequest) -> dict:
    if not request.body:
        return {}
    try:
        data = json.loads(request.body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationError({"non_field_errors": f"the request body is not JSON: {exc}"}) from exc
    if not isinstance(data, dict):
        raise ValidationError({"non_field_errors": "the request body must be a JSON object"})
    return data


def _errors(exc: ValidationError) -> JsonResponse:
    return JsonResponse(exc.message_dict, status=400)


@_json_staff_required
@require_POST
def console_worker_drain(request: HttpRequest, worker_id: int):
    worker = get_object_or_404(GpuWorker, pk=worker_id)
    try:
        worker = console.console_worker_drain(user=request.user, worker=worker)
    except TransitionError as exc:  # not ready: a state conflict, in the API's error shape
        return JsonResponse({"detail": str(exc)}, status=409)
    return JsonResponse({"id": worker.pk, "name": worker.name, "status": worker.status})


@_json_staff_required
@require_POST
def console_session_terminate(request: HttpRequest, session_id):
    session = get_object_or_404(GenerationSession, pk=session_id)
    session = console.console_session_terminate(user=request.user, session=session)
    return JsonResponse({"id": str(session.pk), "status": session.status})


@_json_staff_required
@require_POST
def console_config(request: HttpRequest):
    try:
        config = console.console_config_update(user=request.user, changes=_body(request))
    except ValidationError as exc:
        return _errors(exc)
    return JsonResponse(
        {name: getattr(config, name) for name in ("min_gpus", "max_gpus", "target_utilization", "slo_ms")}
    )
