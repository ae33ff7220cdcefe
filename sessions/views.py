"""Pages of the sessions app: the interactive generation page and the one-shot jobs page.

A thin view: the page renders a template whose scripts talk to the REST API and the session's
WebSocket. The operator console's pages live with the scheduler (``scheduling.views``).
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest
from django.shortcuts import render
from django.views.decorators.http import require_GET


@login_required
@require_GET
def generate(request: HttpRequest):
    return render(
        request,
        "sessions/generate.html",
        {
            "max_prompt_chars": settings.STREAMSERVE["MAX_PROMPT_CHARS"],
            # The browser's side of WebRTC needs the same STUN/TURN servers as the server's.
            "webrtc_ice_servers": settings.STREAMSERVE["WEBRTC_ICE_SERVERS"],
            "page": "generate",
        },
    )


@login_required
@require_GET
def jobs_page(request: HttpRequest):
    """One-shot image and video jobs: submit, watch progress, the gallery of results."""
    limits = settings.STREAMSERVE
    return render(
        request,
        "sessions/jobs.html",
        {
            "max_prompt_chars": limits["MAX_PROMPT_CHARS"],
            "max_steps": limits["JOB_MAX_STEPS"],
            "max_frames": limits["JOB_MAX_FRAMES"],
            "default_slo_s": limits["JOB_DEFAULT_SLO_S"],
            "page": "jobs",
        },
    )
