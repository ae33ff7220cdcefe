"""Where a session's checkpoint lives (pure; the daemon writes it, the scheduler looks for it)."""

from __future__ import annotations

import os
from pathlib import Path


def checkpoint_path(directory: str | os.PathLike, session_id: str) -> Path:
    return Path(directory) / f"{session_id}.safetensors"
