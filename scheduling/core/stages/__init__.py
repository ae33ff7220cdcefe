"""Stage-level serving (TridentServe, issue 15): profiles, placement, dispatch and the simulator.

Pure Python (numpy/scipy): no Django, no workers imports (import-linter contract ``core-pure``).
``profiles`` gives time and memory per stage; ``placement`` chooses each GPU's role (Alg. 2) and
when to re-place; ``dispatch`` solves the per-tick integer program; ``simulator`` runs TridentServe
and the paper's baselines over a mixed trace; ``encoder_pool`` is the streams' memory model.
"""
