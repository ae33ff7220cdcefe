"""Tell a session's connected clients its new status (over the channel layer, after commit)."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from contracts.wire.frames import group_name, status_message
from sessions.models import GenerationSession
from sessions.selectors import session_status_message


def session_status_broadcast(*, session_id: str) -> None:
    session = GenerationSession.objects.select_related("worker").filter(pk=session_id).first()
    if session is None:
        return
    async_to_sync(get_channel_layer().group_send)(
        group_name(session_id), status_message(session_status_message(session))
    )
