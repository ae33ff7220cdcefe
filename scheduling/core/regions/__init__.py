"""Multi-region serving (TORTA, ``docs/regions.md``): topologies, an optimal-transport router,
per-region demand forecasts with a predictive autoscaling floor, and a multi-region simulator.

Pure Python (numpy, networkx, POT, statsmodels); no Django — the ``scheduling.core`` purity contract.
"""
