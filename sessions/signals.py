"""What the sessions app announces to the rest of the platform.

Sessions never call the scheduler: they send ``session_event_committed`` after a session event has
committed, and whoever cares connects to it (the scheduling app does, in its ``ready()``).
"""

from __future__ import annotations

from django.dispatch import Signal

# Sent once per committed SessionEvent, after commit, with keyword arguments
# ``session_id`` (str), ``kind`` (a ``SessionEvent.Kind`` value) and ``detail`` (the event's JSON).
session_event_committed = Signal()

# Sent after a committed change of a one-shot job that asks something of the scheduler, with keyword
# arguments ``job_id`` (str), ``change`` ("submitted", "cancelled", "ended") and, for a cancelled job
# that a worker held, ``held_by`` (the worker's name) and ``epoch``.
job_changed = Signal()
