"""The GPU check kit (issue 28; docs/gpu-check.md): everything a GPU machine lent for a few minutes
should measure, as one prepared command.

``scripts/gpu_check.py`` (``make gpu-check OUT=<dir>``) runs :func:`run.main` with the machine's own
``python3``: the worker runtime alone (pure PyTorch), no Django, no services. It writes
``gpu-check.json`` and ``gpu-check.txt`` to OUT after every section, so a run cut short still leaves
what it measured. ``--dry`` runs the same code on the CPU with tiny shapes (the test suite runs it).

- ``report``: the report, its sections, the time budget and the targets;
- ``wheels``: carried wheels (``var/wheels/``) put on ``sys.path`` without pip or network;
- ``wan``: the Wan2.1-T2V-1.3B streaming generator with random weights in the real architecture
  (diffusers' DiT and VAE, transformers' UMT5-XXL), built on the device without any file;
- ``sections``: what is measured (correctness, memory, latency, engine overhead, GPU paths,
  offload, encode, the scheduler profile);
- ``run``: arguments, the order of the sections and the budget.
"""
