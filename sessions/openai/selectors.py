"""Reads of the adapter: a user's own videos and images, OpenAI's cursor pages."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet

from sessions.models import Job


def jobs_of(owner, kind: str) -> QuerySet[Job]:
    """The owner's jobs of a kind, not deleted. Staff too see only their own here: OpenAI's API is
    one account's view (the operator's view of every job is ``/api/jobs/``)."""
    return Job.objects.filter(owner=owner, kind=kind, deleted_at__isnull=True)


@dataclass(frozen=True)
class VideoPage:
    videos: list[Job]
    has_more: bool


def video_page(*, owner, after: UUID | None, limit: int, order: str) -> VideoPage:
    """``GET /v1/videos``: by creation time (ties by id), from after the video ``after``; a 400
    naming ``after`` when it is none of the owner's videos."""
    videos = jobs_of(owner, Job.Kind.VIDEO)
    if after is not None:
        anchor = videos.filter(pk=after).values("submitted_at", "pk").first()
        if anchor is None:
            raise ValidationError({"after": f"{after} is none of your videos"})
        at, pk = anchor["submitted_at"], anchor["pk"]
        if order == "desc":
            videos = videos.filter(Q(submitted_at__lt=at) | Q(submitted_at=at, pk__lt=pk))
        else:
            videos = videos.filter(Q(submitted_at__gt=at) | Q(submitted_at=at, pk__gt=pk))
    sort = ("-submitted_at", "-pk") if order == "desc" else ("submitted_at", "pk")
    found = list(videos.order_by(*sort)[: limit + 1])
    return VideoPage(videos=found[:limit], has_more=len(found) > limit)
