"""Multi-region serving in the lab (TORTA, ``docs/regions.md``): built-in topologies, seeded
per-region demand, the router policies (TORTA and baselines) and the multi-region simulator, over
the transport, forecast and move rules of ``scheduling.core.regions``; ``cli`` is what
``simulate_regions`` calls."""
