"""The scheduling app's benchmarks (the ``bench_scheduler`` and ``bench_activation`` commands run them).

``scheduler``: decision time per event through the pure core's simulator; ``activation``: activation
→ first chunk on a real platform. Both report through :mod:`contracts.bench`.
"""
