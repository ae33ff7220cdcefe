"""Stage-level serving (issue 15, TridentServe): encode, diffuse and decode as separate stages.

``contract`` (the stage contract, roles, per-stage weight sizes), one adapter per model class
(``demo``, ``causal_dit``), ``pipeline`` (what a worker does with the message stream), ``link``
(hand-off over torch.distributed pair groups with bounded, host-spilling buffers), ``worker`` (the
stage worker process), ``chain`` (a driver for a chain of worker processes) and ``memory`` (the
shared encoder pool's memory model). See docs/runtime.md, "Stage-level serving".
"""
