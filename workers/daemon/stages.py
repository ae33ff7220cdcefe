"""The worker's stage role as its commands see it (issue 15; docs/runtime.md "Stage-level serving").

The role itself (which stages the engine's model holds, the encoder and decoder workers in use, the
encoder or decoder service an ``E`` or ``C`` worker runs) is the runtime's `StageHost`
(``workers.runtime.stages.host``). This part makes the daemon's decisions about it: whether a
session or a job may run here and which stage workers it takes its embeddings from or decodes on,
and ``set_role``/``set_encoder`` at a chunk boundary. Every refusal is a `CommandRefused`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from workers.daemon.answers import CommandRefused
from workers.daemon.jobs import JobRunner
from workers.daemon.streams import Streams
from workers.runtime.engine import ChunkResult
from workers.runtime.stages.clients import StageUnavailable
from workers.runtime.stages.host import RoleRefused, StageHost

logger = logging.getLogger("workers.daemon")


class StageRole:
    def __init__(self, *, name: str, host: StageHost, streams: Streams, jobs: JobRunner) -> None:
        self.name = name
        self.host = host
        self.streams = streams
        self.jobs = jobs

    # --- what other commands need --------------------------------------------------------------

    def for_sessions(self, command: dict) -> None:
        """A start or prompt needs diffuse and decode here, and on a worker without the encode stage
        the encoder worker to take the prompt's embeddings from (``command["encoder"]``)."""
        if not self.host.holds_sessions:
            raise CommandRefused(self.host.sessions_refused)
        if not self.host.needs_encoder:
            return
        self.use_encoder(command)

    def for_job(self, command: dict) -> None:
        """A ``job_run`` needs diffuse here; a DC or D worker gets the job's prompt embeddings from
        the encoder worker the command names, a D or ED worker decodes the finished job's latents on
        the decoder worker named there."""
        if not self.host.runs_jobs:
            raise CommandRefused(
                f"one-shot jobs run on diffusion workers (EDC, ED, DC, D); {self.name} is {self.host.role}"
            )
        if self.host.needs_encoder and command.get("job") not in self.jobs.jobs:
            self.use_encoder(command)
        if self.host.needs_decoder and (command.get("job") not in self.jobs.jobs or "decoder" in command):
            self.use_decoder(command)

    def use_encoder(self, command: dict) -> None:
        try:
            self.host.use_encoder(command.get("encoder"))
        except (ValueError, StageUnavailable) as exc:
            raise CommandRefused(str(exc)) from exc

    def use_decoder(self, command: dict) -> None:
        try:
            self.host.use_decoder(command.get("decoder"))
        except (ValueError, StageUnavailable) as exc:
            raise CommandRefused(str(exc)) from exc

    def note_waiting(self, due: list[str], results: list[ChunkResult]) -> None:
        """After a step: who waits for a prompt's embeddings, and why (the heartbeat reports it)."""
        if self.host.needs_encoder:
            produced = {r.session_id for r in results}
            engine = self.streams.engine
            self.host.note_waiting({sid: engine.meta(sid) for sid in due if sid not in produced})

    # --- the role's own commands ---------------------------------------------------------------

    def set_encoder(self, command: dict) -> dict:
        """``{"kind": "set_encoder", "encoder": {worker, address}}``: take prompt embeddings from this
        encoder worker from now on (the one in use was lost, or the control plane moves the load).
        Sessions waiting for an encoding ask the new encoder at once."""
        if not self.host.needs_encoder:
            why = "encodes its own prompts" if "E" in self.host.role else "runs no prompts"
            raise CommandRefused(f"role {self.host.role} {why}")
        self.use_encoder(command)
        self.streams.apply_prompts_resident()
        waiting = sorted(self.host.waiting)
        return {"encoder": str(command["encoder"].get("worker", "")), "waiting": waiting}

    def set_role(self, command: dict, *, in_flight: int) -> dict:
        """Change the stages this worker hosts at a chunk boundary: load the missing stages'
        weights, drop the others. Refused while a migration is in flight (``in_flight``), while jobs
        are here and the role is not EDC, or when a session needs a stage the role drops
        (``StageHost``)."""
        if in_flight:
            raise CommandRefused(f"{in_flight} migration(s) in flight")
        if self.jobs.jobs and command.get("role") not in ("EDC", "DC"):
            raise CommandRefused(
                f"{len(self.jobs.jobs)} job(s) on {self.name} need diffuse and decode, which role "
                f"{command.get('role')} drops"
            )
        if command.get("encoder") is not None:
            try:
                self.host.use_encoder(command["encoder"])
            except (ValueError, StageUnavailable) as exc:
                raise CommandRefused(str(exc)) from exc
        metas: Mapping[str, Mapping[str, Any]] = {
            sid: self.streams.meta(owned) for sid, owned in self.streams.sessions.items()
        }
        try:
            result = self.host.set_role(str(command.get("role", "")), metas)
        except RoleRefused as exc:
            raise CommandRefused(str(exc)) from exc
        # A new encoder (or none) serves prompt switches from now on: ask for what is due.
        self.streams.apply_prompts_resident()
        logger.info("worker.role worker=%s %s", self.name, result)
        return {"ok": True, **result}
