"""The scheduling lab: what measures the scheduler offline, never what serves users (docs/scheduling.md).

Pure Python, no Django (import-linter contract ``sim-pure``), and no service module imports it
(contract ``service-not-lab``). A simulator replays a trace through the *same* pure steps the live
loop runs (``scheduling.core``): it measures them, it does not copy them.

- ``simulator``: the stream simulator (``simulate``); ``jobs.cosim``: one-shot jobs on the GPUs the
  streams leave; ``stages.simulator``: stage-level serving (TridentServe); ``regions.simulator``:
  multi-region routing (TORTA).
- ``traces`` (the trace format) and the trace generators: ``generators``, ``jobs.workload``,
  ``stages.workloads``, ``regions.demand`` / ``regions.topology``.
- ``oracles``: exact placement, the autoscaling cost oracle, the placement gap.
- ``compare`` (the §7.1 protocol), ``profiling`` (the volatility table's grid search), ``plots``.
- ``cli``, ``stages.cli``, ``regions.cli``: what the research commands (``simulate*``,
  ``profile_volatility``) call; ``regions.policies``: the router policies the regions simulator runs;
  ``stages.encoder_pool``: the shared encoder pool's memory model.

Paper reproductions live in ``scheduling.reproduce``, benchmarks in ``scheduling.benchmarks``.
"""
