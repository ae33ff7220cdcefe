"""The scheduling app's benchmarks (the lab): commands that print figures and JSON, never timed
assertions in the test suite. Each ``bench_*`` or ``soak`` command runs one of them.

``scheduler``: decision time per event through the pure core's simulator; ``scaleplan``: the scale
planner's decision time; ``jobs_round``: one GenServe round solve; ``stages``: the stage dispatcher's
integer program and one live re-placement plan; ``regions``: one macro routing step; ``activation``:
activation → first chunk on a real platform; ``soak``: many sessions for a long time on a real
platform (``platform`` starts it). Those that share the harness report through :mod:`contracts.bench`.
"""
