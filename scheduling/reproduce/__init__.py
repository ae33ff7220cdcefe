"""The papers' experiments reproduced with StreamServe's scheduling core (the lab; pure Python).

One place for every reproduction, each writing Markdown, charts or JSON beside the paper's figures:

- TurboServe (``reproduce_paper``): :mod:`.experiments` (the plan), :mod:`.runner`
  (``run_all(out, quick=..., seed=..., jobs=...)``), :mod:`.report` (``README.md``, PNG charts,
  ``results.json``), :mod:`.paper` (the paper's figures) and :mod:`.policies` (the ablation variants;
  their dotted paths are recorded in results.json, so these modules keep their names);
- GenServe (``reproduce_genserve``): :mod:`.genserve`;
- TridentServe (``reproduce_stages``): :mod:`.tridentserve`;
- TORTA (``reproduce_regions``): :mod:`.torta`.

They run the simulators of ``scheduling.sim`` and, where a paper reports decision times, the
benchmarks of ``scheduling.benchmarks``.
"""

from .experiments import EXPERIMENTS, plan
from .runner import run_all

__all__ = ["EXPERIMENTS", "plan", "run_all"]
