"""Re-cutting a worker's model at run time (issue 15, ``set_role``): the components of the stages
it gains are built and loaded, those of the stages it drops are freed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from workers.runtime.models.base import StagewiseModel
from workers.runtime.stages.contract import Stage, StagedModel, staged_class

# Loads the named network components' weights for a stage a worker adds at run time:
# ``components -> (tensors by name, source, detail)``, source one of peer, host-cache, local, seed
# (``workers.weights_loading.StageWeightsFetcher`` pulls them from the parameter pool).
StageLoader = Callable[[list[str]], tuple[Mapping[str, torch.Tensor], str, str]]


def restage(
    model: StagewiseModel,
    stages: tuple[Stage, ...],
    *,
    weights_path: str | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
    loader: StageLoader | None = None,
) -> tuple[StagedModel, str, str]:
    """The same model re-cut to host ``stages``: the components of stages it lacks are built and
    loaded (through ``loader``, else from ``weights_path``/``weights`` or the preset's own weights,
    as a stage worker's are), those of stages it no longer hosts are dropped (their memory freed once
    nothing else holds them). Returns the adapter over the model (the network object is changed in
    place), where the loaded weights came from (``""`` when nothing was loaded) and a detail."""
    adapter = staged_class(model.preset)
    net = model.net  # type: ignore[attr-defined]
    hosted = {
        stage
        for stage in Stage
        if all(getattr(net, name, None) is not None for name in adapter.COMPONENTS[stage])
    }
    missing = tuple(stage for stage in stages if stage not in hosted)
    source = detail = ""
    if missing:
        kwargs: dict[str, Any] = {"stages": missing, "device": model.device}
        if loader is not None:
            weights, source, detail = loader(adapter.components_for(missing))
        elif weights is None:
            source, detail = ("local", weights_path) if weights_path is not None else ("seed", "preset seed")
        if weights_path is not None and weights is None:
            kwargs["weights_path"] = weights_path
        if weights is not None:
            kwargs["weights"] = weights
        donor = adapter.from_preset(model.preset, **kwargs)
        for stage in missing:
            for name in adapter.COMPONENTS[stage]:
                setattr(net, name, getattr(donor.net, name))
    for stage in hosted - set(stages):
        for name in adapter.COMPONENTS[stage]:
            setattr(net, name, None)
    return adapter(model, tuple(stages)), source, detail


def hosted_stages(model: StagewiseModel) -> tuple[Stage, ...]:
    """The stages whose components ``model``'s network holds now."""
    adapter = staged_class(model.preset)
    net = model.net  # type: ignore[attr-defined]
    return tuple(
        stage
        for stage in Stage
        if all(getattr(net, name, None) is not None for name in adapter.COMPONENTS[stage])
    )


def resident_weight_bytes(model: StagewiseModel, extra: list[torch.Tensor] = ()) -> int:  # type: ignore[assignment]
    """Bytes of weight memory ``model`` keeps alive: the storages behind its network's parameters
    and buffers (a view of a packed pool buffer counts its whole buffer), plus ``extra`` tensors
    (the pool copy), each storage once."""
    net = model.net  # type: ignore[attr-defined]
    storages: dict[tuple[str, int], int] = {}
    for tensor in (*net.parameters(), *net.buffers(), *extra):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
