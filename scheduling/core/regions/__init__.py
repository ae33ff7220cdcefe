"""Multi-region serving (TORTA, ``docs/regions.md``): the optimal-transport router (``transport``),
per-region demand forecasts and the predictive autoscaling floor (``forecast``), when a session
moves region (``moves``) and the split of one snapshot by region (``partition``).

Pure Python (numpy, POT, statsmodels); no Django — the ``scheduling.core`` purity contract. The
topologies, generated demand and the multi-region simulator are the lab's (``scheduling.sim.regions``).
"""

import os

# POT (``ot``, imported by ``transport``) loads PyTorch as one of its array backends whenever torch is
# installed: about 350 MB of resident memory and seconds of start-up in every process that imports
# the scheduler (the web process, Celery, beat), none of which holds a tensor. The transport solves
# numpy arrays only. Set before ``transport`` imports ``ot``; a process that imported ``ot`` already
# keeps its backends.
os.environ.setdefault("POT_BACKEND_DISABLE_PYTORCH", "1")
