"""The scheduler on live state, one module per question it answers.

The algorithms are the pure core's (``scheduling.core``, the same objects the simulator replays);
this package reads PostgreSQL and Redis into their inputs and turns their answers into rows and
worker commands. It never imports the lab (import-linter contract ``service-not-lab``).

- ``run``: one decision — inputs from PostgreSQL and Redis → the decision pipeline the simulator runs
  too (``scheduling.core.pipeline``: per region, with the jobs' demand and the predictive floor as
  inputs) → recorded decisions; ``apply``: how a decision becomes session transitions
  (``sessions.lifecycle``) and worker commands.
- ``outbox``: commands written as rows inside the transaction and sent to the workers' durable
  streams after it commits.
- ``answers``: what workers report back (command answers, finished or failed migrations);
  ``liveness``: lost workers, overdue commands and migrations, and recovery of their sessions.
- ``scaling``: provisioning and releasing workers (slow provisioner calls, outside the lock).
- ``jobs``: the job dispatcher — one-shot jobs onto the room the streams leave (issue 14): it reads
  the rows into a ``JobRound``, asks the ``JOB_POLICY`` — a pure ``JobPolicy`` of
  ``scheduling.core.jobs`` (``edf``, ``genserve``, ``tridentserve`` or a dotted path) — for a plan and
  applies it as job transitions and commands.
- ``stages``: live stage placement (TridentServe, issue 15; a package, one module per job): roles
  planned and changed per pool, the encoders and decoders of workers whose role lacks E or C,
  encoder failover, the encoder pool's size.
- ``regions``: the live regions (TORTA, issue 16): the global router's plan and forecast slot, the
  moves of parked sessions, each region's predictive floor; ``region_moves``: running sessions moved
  across regions when the saving beats the switching cost (``scheduling.core.regions.moves``).
- ``operator``: what operators ask for by hand (move a session now).
- ``reactions``: what a committed session event asks of workers (forward a prompt, free a state).
- ``moves``, ``state``, ``worker_profiles``, ``enqueue``: the migration start shared by ``apply``,
  ``operator`` and ``region_moves``; where a session's checkpoint, prompts and delivered index are;
  the scheduler profiles of the deployment's worker types (``WORKER_PROFILE``); the Celery tasks
  other parts enqueue by name.
"""
