"""Multi-region serving (TORTA, ``docs/regions.md``): the optimal-transport router (``transport``),
per-region demand forecasts and the predictive autoscaling floor (``forecast``), when a session
moves region (``moves``) and the split of one snapshot by region (``partition``).

Pure Python (numpy, POT, statsmodels); no Django — the ``scheduling.core`` purity contract. The
topologies, generated demand and the multi-region simulator are the lab's (``scheduling.sim.regions``).
"""
