"""What the web application loads: not PyTorch (docs/media.md, the web process's memory)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_asgi_application_and_the_scheduler_load_without_torch():
    # POT (the multi-region transport's solver) loads torch as a backend when it is installed:
    # ~350 MB in every web, Celery and beat process, unless scheduling.core.regions turns it off.
    probe = (
        "import sys, controlplane.asgi, scheduling.core.regions.transport, ot; "
        "print('torch' in sys.modules, ot.backend.get_backend_list())"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    env.pop("POT_BACKEND_DISABLE_PYTORCH", None)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    torch_loaded, backends = done.stdout.strip().split(" ", 1)
    assert torch_loaded == "False", done.stdout
    assert "Torch" not in backends and "Numpy" in backends, backends
