"""StreamServe's scheduling core: the pure algorithms the service runs, no Django (docs/scheduling.md).

Entry points: ``pipeline.decision_run`` (the decision run: partition by region, jobs' demand,
predictive floor, each region's policy, spill, regions to zero), ``types.Snapshot.build`` /
``types.Event`` / ``types.Decision``, ``policy.make_policy`` (built-in names or ``package.module:ClassName``: ``turboserve``,
``baselines``, ``forecast_floor``), ``gpu_profiles.load_profile``, ``scaleplan`` and ``provisioning``
(scale-out); ``jobs`` (the job dispatcher's ``JobPolicy``), ``stages`` (stage placement and
dispatch), ``regions`` (routing, forecasts, moves). The live loop (``scheduling.live``) and the
simulator run the same pipeline with the same objects in it.

The lab lives apart and the core never imports it (import-linter ``core-pure``): simulators, traces,
generators and oracles in ``scheduling.sim``, paper reproductions in ``scheduling.reproduce``,
benchmarks in ``scheduling.benchmarks``.
"""
