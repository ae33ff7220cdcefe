"""What a worker daemon loads at start: every scale-out pays it (docs/runtime.md, start-up CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_a_worker_starts_without_the_transport_solver_or_torch_dynamo():
    # POT (the regions' transport solver, ~0.7 s of CPU to import) is the scheduler's alone, and a
    # network built on the meta device must not run the default init of an Embedding there (PyTorch's
    # Python reference of normal_, whose first use imports torch._dynamo: ~1 s of CPU), nor allocate
    # it with ``to_empty`` (whose reference imports sympy: ~0.3 s).
    probe = (
        "import django, sys; django.setup(); "
        "import workers.management.commands.gpuworker; "
        "from workers.runtime.models import build_model; build_model('tiny'); "
        "print(sorted(m for m in ('ot', 'torch._dynamo', 'sympy') if m in sys.modules))"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "DEBUG": "true"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_the_scheduler_worker_imports_the_solver_before_it_forks():
    from celery.signals import worker_init

    import scheduling.tasks  # noqa: F401  (connects the receiver)

    receivers = [ref() for _key, ref in worker_init.receivers]
    assert any(getattr(r, "__name__", "") == "_preload_transport_solver" for r in receivers)
