"""Reproduction of the TurboServe paper's experiments with StreamServe's scheduling core (pure Python).

``run_all(out, quick=..., seed=..., jobs=...)`` runs the plan in :mod:`.experiments` and writes
``README.md``, PNG charts and ``results.json`` with the paper's figures beside ours (:mod:`.report`).
"""

from .experiments import EXPERIMENTS, plan
from .runner import run_all

__all__ = ["EXPERIMENTS", "plan", "run_all"]
