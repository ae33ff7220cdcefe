"""Static baselines (TurboServe §7.1), as policies of the same interface.

All three run a fixed GPU budget (whatever pool they are given; they never add, drain or release),
never migrate, and suspend a session as soon as it goes idle (the base runtime's offloading, §3.1).
They differ only in where a newly activated (or resumed) session goes; every choice is restricted
to ready GPUs with memory for the session, and a session is queued only when none has:

* ``base`` — round-robin over the ready GPUs in id order, continuing after the last GPU used
  (TurboServe_base; each GPU then runs its sessions FCFS in coalesced steps);
* ``lag`` — Load-Aware Greedy: the GPU with the lowest load relative to its capacity
  (Σ session load / K; ties: lower id);
* ``mag`` — Memory-Aware Greedy (§7.1: "the GPU with the lowest memory utilization, aiming to balance
  memory pressure"): the GPU with the most free session-state memory in bytes — its byte limit, or
  its session limit × the type's state bytes when only that is given, less the state of every
  resident session (ties: lower id). It places by memory, not by load or session counts: it differs
  from ``lag`` where memory and compute capacity are not in one ratio — GPU types whose memory and K
  differ (an 80 GB and a 141 GB GPU of equal K), or sessions whose state is not proportional to their
  load. With identical sessions on identical GPUs (the Fig. 7 grid: every session load 1 and
  3.5–5 GB of state) free memory orders the GPUs exactly as load does, so there it still equals
  ``lag``; what would separate them is a memory model in which a session's state is not fixed
  (a KV cache that grows with the session), which the simulator does not have.
"""

from __future__ import annotations

from typing import Any

from .policy import Policy
from .types import Decision, Event, GpuTypeSpec, Signals, Snapshot


def memory_bytes(spec: GpuTypeSpec) -> float:
    """Session-state memory of one GPU of ``spec``: its byte limit, else its session limit × the
    type's state bytes (the built-in profiles give only a session limit)."""
    if spec.memory_limit_bytes is not None:
        return float(spec.memory_limit_bytes)
    return spec.session_limit() * spec.state_bytes


class _StaticPolicy(Policy):
    static = True

    def _choose(
        self, snapshot: Snapshot, ready: list[str], load: dict, count: dict, used: dict, sid: str
    ) -> str | None:
        raise NotImplementedError

    def decide(self, snapshot: Snapshot, event: Event) -> Decision:
        ready = [g for g, v in snapshot.gpus.items() if v.status == "ready"]
        ready.sort()
        load = {g: snapshot.gpu_load.get(g, 0.0) for g in ready}
        count = {g: len(snapshot.residents.get(g, ())) for g in ready}
        used = {g: snapshot.gpu_bytes.get(g, 0) for g in ready}
        suspend: list[str] = []
        for sid in snapshot.idle_resident:
            s = snapshot.sessions[sid]
            if s.gpu in load:
                load[s.gpu] -= s.load
                count[s.gpu] -= 1
                used[s.gpu] -= s.state_bytes
            suspend.append(sid)
        assign: list[tuple[str, str]] = []
        queue: list[str] = []
        for sid in snapshot.pending:
            gid = self._choose(snapshot, ready, load, count, used, sid)
            if gid is None:
                queue.append(sid)
                continue
            s = snapshot.sessions[sid]
            load[gid] += s.load
            count[gid] += 1
            used[gid] += s.state_bytes
            assign.append((sid, gid))
        rho_max = max((load[g] / snapshot.spec(g).capacity for g in ready), default=0.0)
        n_req = sum(load.values()) + sum(snapshot.sessions[s].load for s in queue)
        live = sum(1 for v in snapshot.gpus.values() if v.status in ("provisioning", "ready"))
        bottleneck = max((snapshot.spec(g).latency_ms(load[g]) for g in ready if count[g]), default=0.0)
        return Decision(
            time=snapshot.time,
            assign=tuple(assign),
            suspend=tuple(suspend),
            queue=tuple(queue),
            target_budget=live,
            signals=Signals(rho_max=rho_max, n_req=n_req, bottleneck_ms=bottleneck),
        )

    @staticmethod
    def _fits(snapshot: Snapshot, gid: str, count: dict, used: dict, sid: str) -> bool:
        spec = snapshot.spec(gid)
        return (
            count[gid] + 1 <= spec.session_limit()
            and used[gid] + snapshot.sessions[sid].state_bytes <= spec.bytes_limit()
        )


class BasePolicy(_StaticPolicy):
    name = "base"

    def __init__(self, **_: Any):
        self.cursor = ""  # id of the GPU that received the last session

    def _choose(self, snapshot, ready, load, count, used, sid):
        if not ready:
            return None
        start = 0
        for i, g in enumerate(ready):
            if g > self.cursor:
                start = i
                break
        else:
            start = 0
        for k in range(len(ready)):
            gid = ready[(start + k) % len(ready)]
            if self._fits(snapshot, gid, count, used, sid):
                self.cursor = gid
                return gid
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = str(state.get("cursor", ""))


class LeastLoadedPolicy(_StaticPolicy):
    name = "lag"

    def __init__(self, **_: Any):
        pass

    def _choose(self, snapshot, ready, load, count, used, sid):
        best = None
        for gid in ready:
            if not self._fits(snapshot, gid, count, used, sid):
                continue
            key = (load[gid] / snapshot.spec(gid).capacity, gid)
            if best is None or key < best:
                best = key
        return best[1] if best else None


class MemoryAwarePolicy(_StaticPolicy):
    name = "mag"

    def __init__(self, **_: Any):
        pass

    def _choose(self, snapshot, ready, load, count, used, sid):
        best = None
        for gid in ready:
            if not self._fits(snapshot, gid, count, used, sid):
                continue
            key = (-(memory_bytes(snapshot.spec(gid)) - used[gid]), gid)
            if best is None or key < best:
                best = key
        return best[1] if best else None
