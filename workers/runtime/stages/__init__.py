"""Stage-level serving (issue 15, TridentServe): encode, diffuse and decode as separate stages.

``contract`` (the stage contract, roles, per-stage weight sizes), one adapter per model class
(``demo``, ``causal_dit``), ``pipeline`` (what a worker does with the message stream), ``link``
(hand-off over torch.distributed pair groups with bounded, host-spilling buffers), ``worker`` (the
stage worker process), ``chain`` (a driver for a chain of worker processes) and ``memory`` (the
shared encoder pool's memory model). A worker daemon in a stage role: ``host`` (its role and
``set_role``), ``staged_model`` (a split role's engine model), ``restage`` (re-cutting the model at
run time), ``clients`` and ``service`` (the encoder and decoder workers' request/response services,
both sides). See docs/runtime.md, "Stage-level serving".
"""
