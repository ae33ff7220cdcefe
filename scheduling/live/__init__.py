"""The scheduler on live state, one module per question it answers.

- ``run``: one decision — snapshot from PostgreSQL → ``scheduling.core`` policy → recorded decision;
  ``apply``: how a decision becomes session transitions (``sessions.lifecycle``) and worker commands.
- ``outbox``: commands written as rows inside the transaction and sent to the workers' durable
  streams after it commits.
- ``answers``: what workers report back (command answers, finished or failed migrations);
  ``liveness``: lost workers, overdue commands and migrations, and recovery of their sessions.
- ``scaling``: provisioning and releasing workers (slow provisioner calls, outside the lock).
- ``jobs``, ``jobs_policy``: one-shot jobs onto the room the streams leave (issue 14): the dispatcher
  and its pluggable, pure policy.
- ``operator``: what operators ask for by hand (move a session now).
- ``reactions``: what a committed session event asks of workers (forward a prompt, free a state).
- ``moves``, ``state``, ``profiles``, ``enqueue``: the migration start shared by ``apply`` and
  ``operator``; where a session's checkpoint, prompts and delivered index are; the worker types'
  profiles; the Celery tasks other parts enqueue by name.
"""
