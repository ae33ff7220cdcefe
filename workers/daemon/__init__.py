"""The GPU worker daemon (``manage.py gpuworker``), one part per role, composed by `WorkerDaemon`:

- ``worker`` — `WorkerDaemon`: the hot loop (``step() -> bool``: arrivals, commands, settled
  migrations, then one coalesced batch of chunks or, in the time the streams leave, one job step),
  ``run``, ``request_stop`` and ``shutdown``;
- ``streams`` — the sessions it owns: pacing, the chunk step, prompts, suspend/resume, checkpoints;
- ``publisher`` — `ChunkPublisher`: each chunk's record and frames, once, under the publish lease;
- ``jobs`` — `JobRunner`: one-shot jobs (docs/jobs.md), admission, step-level preemption, results;
- ``stages`` — `StageRole`: the stage role's decisions (which sessions and jobs may run here, the
  encoder and decoder workers in use, ``set_role``), over the runtime's `StageHost`;
- ``migration`` — `MigrationEndpoint`: state regions leaving and arriving (TurboServe §6.1);
- ``liveness`` — `Heartbeat`: telemetry and the liveness key, on a thread;
- ``commands`` — `CommandDispatcher`: each command to its part, one answer each (``answers``).

Every part reaches the control plane through the ``workers.ports`` it is handed, never directly.
"""

from workers.daemon.worker import WorkerDaemon

__all__ = ["WorkerDaemon"]
