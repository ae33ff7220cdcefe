from __future__ import annotations

import pytest
import torch

from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model():
    return build_model("tiny", device="cpu")


@pytest.fixture
def make_engine(tiny_model):
    engines: list[ChunkEngine] = []

    def factory(**kwargs) -> ChunkEngine:
        engine = ChunkEngine(tiny_model, encode_workers=1, **kwargs)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()
