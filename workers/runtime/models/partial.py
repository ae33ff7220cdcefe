"""Build a model's network with only some of its top-level components materialised.

A stage worker must not hold the weights of stages it does not host. The network is built on the
meta device (no memory), the components of the other stages are removed (set to None, so the
remaining parameters keep their names — and seeded weights, derived from the names, keep their
values), and only what is left is allocated on the target device.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch
from torch import nn


def top_level_names(net: nn.Module) -> set[str]:
    return {name for name, _ in net.named_children()} | set(net._parameters)


def partial_network(
    factory: Callable[[], nn.Module], keep: Collection[str], device: torch.device
) -> nn.Module:
    """``factory()`` with every top-level component not in ``keep`` removed, the rest uninitialised
    on ``device`` (the caller loads or seeds the weights)."""
    with torch.device("meta"):
        net = factory()
    unknown = set(keep) - top_level_names(net)
    if unknown:
        raise ValueError(f"{type(net).__name__} has no component(s) {sorted(unknown)}")
    for name in top_level_names(net) - set(keep):
        setattr(net, name, None)
    return materialise(net, device)


def materialise(net: nn.Module, device: torch.device) -> nn.Module:
    """``net.to_empty(device=device)`` for a network built on the meta device, without its cost at
    start: ``to_empty`` calls ``empty_like`` on meta tensors, whose Python reference imports sympy
    (through ``torch.fx.experimental.symbolic_shapes``), ~0.3 s of CPU in every worker that builds a
    model. Parameters and buffers are created contiguous, so a plain ``empty`` of the same shape and
    dtype is the same allocation."""
    return net._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_subset(net: nn.Module, weights: Mapping[str, torch.Tensor], origin: str) -> None:
    """Load the tensors of ``weights`` that ``net`` (a partial network) has; every one it has must be
    there, the others (weights of stages this worker does not host) are skipped without a copy."""
    wanted = net.state_dict().keys()
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise ValueError(f"{origin} lacks parameter(s) {missing[:8]}")
    net.load_state_dict({name: weights[name] for name in wanted}, strict=True)


def load_subset_from_file(net: nn.Module, path: str, device: torch.device) -> None:
    """`load_subset` from a safetensors file, reading only the tensors ``net`` has (the file is
    memory-mapped: the other stages' weights are never read)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device=str(device)) as weights_file:
        available = set(weights_file.keys())
        wanted = [name for name in net.state_dict() if name in available]
        load_subset(net, {name: weights_file.get_tensor(name) for name in wanted}, path)


def component_bytes(net: nn.Module, components: Collection[str]) -> int:
    """Bytes of the parameters and buffers of the named top-level components of ``net``."""
    total = 0
    for name in components:
        part = getattr(net, name)
        tensors = [part] if isinstance(part, torch.Tensor) else [*part.parameters(), *part.buffers()]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
