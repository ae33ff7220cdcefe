"""Static baselines (TurboServe §7.1), as policies of the same interface.

All three run a fixed GPU budget (whatever pool they are given; they never add, drain or release),
never migrate, and suspend a session as soon as it goes idle (the base runtime's offloading, §3.1).
They differ only in where a newly activated (or resumed) session goes; every choice is restricted
to ready GPUs with memory for the session, and a session is queued only when none has:

* ``base`` — round-robin over the ready GPUs in id order, continuing after the last GPU used
  (TurboServe_base; each GPU then runs its sessions FCFS in coalesced steps);
* ``lag`` — Load-Aware Greedy: the GPU with the lowest load relative to its capacity
  (Σ session load / K; ties: lower id);
* ``mag`` — Memory-Aware Greedy: the GPU with the lowest fraction of its memory limit in use,
  counting the state of every resident session (max of bytes/bytes-limit and sessions/session-limit;
  ties: lower id). With identical sessions on identical GPUs it orders like ``lag``; it differs
  when state size is not proportional to compute load or when GPU types differ.
"""

from __future__ import annotations

from typing import Any

from .policy import Policy
from .types import Decision, Event, Signals, Snapshot


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
            spec = snapshot.spec(gid)
            frac = max(count[gid] / spec.session_limit(), used[gid] / spec.bytes_limit())
            key = (frac, gid)
            if best is None or key < best:
                best = key
        return best[1] if best else None
