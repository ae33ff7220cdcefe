"""Stage-level serving (TridentServe, issue 15): stage profiles, placement and dispatch.

Pure Python (numpy/scipy): no Django, no workers imports (import-linter contract ``core-pure``).
``stage_profiles`` gives time and memory per stage; ``placement`` chooses each GPU's role (Alg. 2)
and when to re-place; ``dispatch`` solves the per-tick integer program; ``encoders`` says when a
worker without E needs another encoder. The live loop runs them
(``scheduling.live.stages``, ``scheduling.core.jobs.tridentserve``); the simulator, its workloads and
the encoder pool's memory model are the lab's (``scheduling.sim.stages``).
"""
