"""StreamServe's scheduling core: pure Python, no Django (docs/scheduling.md).

Entry points: ``types.Snapshot.build`` / ``types.Event`` / ``types.Decision``,
``policy.make_policy`` (built-in names or ``package.module:ClassName``), ``profiles.load_profile``,
``simulator.simulate``, ``compare.compare_policies``, ``profiling.profile_volatility_table``; traces
in ``traces`` and ``generators``; oracles in ``oracles``. The decision-time benchmark lives apart, in
``scheduling.benchmarks.scheduler``.
"""
