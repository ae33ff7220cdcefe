"""GPU paths of the runtime (issue 28), each off or on by a setting and taken only on CUDA.

| setting (env var) | default | what it does on CUDA |
|---|---|---|
| ``STREAMSERVE_SDPA_FLASH`` | off | self-attention through the flash kernel (``sdpa_kernel(FLASH_ATTENTION)``) where the shapes allow it: no mask, fp16/bf16, head dim ≤ 256 and a multiple of 8; otherwise PyTorch's own choice |
| ``STREAMSERVE_CUDA_GRAPHS`` | off | the DiT blocks of a steady-state step (full KV window, no mask: one fixed shape per batch size) captured once per (block, batch shape) and replayed |
| ``STREAMSERVE_COMPILE_BLOCKS`` | off | ``torch.compile`` of the block function (one compiled function for every block: the block module is an argument, its parameters graph inputs) |
| ``STREAMSERVE_OFFLOAD_SIDE_STREAM`` | on | suspend/resume copies on a side stream (``ChunkEngine``) |
| ``STREAMSERVE_OFFLOAD_PINNED`` | on | suspended states in pinned (page-locked) host buffers |

The first three are new and stay off until ``make gpu-check`` has measured them on a GPU (no claim
that any is faster is made without that measurement). The offload pair predates the settings: the
engine has always copied on a side stream into pinned buffers on CUDA, and without pinning a
device-to-host copy cannot be asynchronous at all; the settings exist so the check can measure each
with and without. On a CPU every setting is read and reported but none changes what runs.

A malformed value raises ``ValueError`` naming the variable (configuration fails loudly).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

ENV_SDPA_FLASH = "STREAMSERVE_SDPA_FLASH"
ENV_CUDA_GRAPHS = "STREAMSERVE_CUDA_GRAPHS"
ENV_COMPILE_BLOCKS = "STREAMSERVE_COMPILE_BLOCKS"
ENV_OFFLOAD_SIDE_STREAM = "STREAMSERVE_OFFLOAD_SIDE_STREAM"
ENV_OFFLOAD_PINNED = "STREAMSERVE_OFFLOAD_PINNED"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


@dataclass(frozen=True)
class GpuPaths:
    """Which GPU paths are asked for (see the module docstring); `Accelerator.active` says which
    of them apply on a given device."""

    flash_attention: bool = False
    cuda_graphs: bool = False
    compile_blocks: bool = False
    offload_side_stream: bool = True
    offload_pinned: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GpuPaths:
        env = os.environ if environ is None else environ
        return cls(
            flash_attention=env_flag(env, ENV_SDPA_FLASH, False),
            cuda_graphs=env_flag(env, ENV_CUDA_GRAPHS, False),
            compile_blocks=env_flag(env, ENV_COMPILE_BLOCKS, False),
            offload_side_stream=env_flag(env, ENV_OFFLOAD_SIDE_STREAM, True),
            offload_pinned=env_flag(env, ENV_OFFLOAD_PINNED, True),
        )

    def with_(self, **changes: bool) -> GpuPaths:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


def copy_stream(device: torch.device, paths: GpuPaths) -> torch.cuda.Stream | None:
    """The side stream offload copies run on: one on CUDA when the setting asks for it; None (the
    caller's current stream, synchronous copies) otherwise and always on a CPU."""
    if device.type != "cuda" or not paths.offload_side_stream:
        return None
    return torch.cuda.Stream(device=device)


def pin_host_buffers(device: torch.device, paths: GpuPaths) -> bool:
    """Whether suspended states go to pinned host memory: on CUDA when the setting asks for it."""
    return device.type == "cuda" and paths.offload_pinned


def flash_eligible(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Shapes and dtypes the flash kernel takes: CUDA, fp16/bf16, no mask, head dim ≤ 256 and a
    multiple of 8 (q, k, v as [B, heads, tokens, head_dim])."""
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and mask is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and head_dim <= 256
        and head_dim % 8 == 0
    )


# -- arguments as flat leaves (tensors become the graph's static inputs) ----------------------------


def _flatten(args: tuple[Any, ...]) -> tuple[list[Any], list[int]]:
    """Leaves of ``args`` (tuples of tensors inside it are opened one level, e.g. RoPE's (cos, sin))
    and, per argument, how many leaves it took (-1: not a tuple)."""
    leaves: list[Any] = []
    widths: list[int] = []
    for arg in args:
        if isinstance(arg, tuple):
            leaves.extend(arg)
            widths.append(len(arg))
        else:
            leaves.append(arg)
            widths.append(-1)
    return leaves, widths


def _rebuild(leaves: list[Any], widths: list[int]) -> tuple[Any, ...]:
    args, cursor = [], 0
    for width in widths:
        if width < 0:
            args.append(leaves[cursor])
            cursor += 1
        else:
            args.append(tuple(leaves[cursor : cursor + width]))
            cursor += width
    return tuple(args)


def capture_args(statics: list[Any], leaves: list[Any], widths: list[int]) -> tuple[Any, ...]:
    """The arguments a graph is captured with: the slot's static tensors (what replays read) and
    this call's other arguments (the block module, the model: they differ between the graphs that
    share a slot)."""
    mixed = [
        static if isinstance(leaf, torch.Tensor) else leaf
        for static, leaf in zip(statics, leaves, strict=True)
    ]
    return _rebuild(mixed, widths)


def graph_keys(
    index: int, fn: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(slot key, graph key) of one block call. Calls with the same function and the same tensor
    shapes and dtypes share a slot — its static input and output buffers and its memory pool — and
    each (block index, non-tensor arguments: the block module, the model) has its own graph in it."""
    leaves, widths = _flatten(args)
    tensors = tuple(
        (i, tuple(leaf.shape), leaf.dtype) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
    )
    others = tuple(
        (i, id(leaf)) if leaf is not None else (i, None)
        for i, leaf in enumerate(leaves)
        if not isinstance(leaf, torch.Tensor)
    )
    slot = (fn, tuple(widths), tensors)
    return slot, (index, others)


@dataclass
class _Slot:
    """Static buffers shared by the graphs of one signature: blocks run one after the other, so
    one set of inputs, outputs and one memory pool serve all of them."""

    inputs: list[Any]  # static copies of the tensor leaves (other leaves: as the first call had them)
    widths: list[int]
    pool: Any
    outputs: tuple[torch.Tensor, ...] | None = None
    graphs: dict[tuple[Any, ...], torch.cuda.CUDAGraph] | None = None


class BlockGraphs:
    """CUDA graphs of block calls, captured once per (block, batch shape) and replayed.

    A call copies its tensors into the slot's static inputs, replays the block's graph (captured on
    first use after ``warmup`` eager runs on a side stream) and returns the slot's static outputs,
    which the next replay of any graph in the slot overwrites: the caller consumes them first (the
    model's block loop does: x goes into the next block, k/v into the ring). At most ``max_slots``
    signatures are kept (least recently used dropped with their graphs and buffers).
    """

    def __init__(self, device: torch.device, *, warmup: int = 2, max_slots: int = 8) -> None:
        self.device = device
        self.warmup = warmup
        self.max_slots = max_slots
        self._slots: OrderedDict[tuple[Any, ...], _Slot] = OrderedDict()
        self.captures = 0
        self.replays = 0

    def __len__(self) -> int:
        return sum(len(slot.graphs or {}) for slot in self._slots.values())

    def run(self, index: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        slot_key, graph_key = graph_keys(index, fn, args)
        leaves, widths = _flatten(args)
        slot = self._slots.get(slot_key)
        if slot is None:
            slot = self._new_slot(slot_key, leaves, widths)
        self._slots.move_to_end(slot_key)
        for static, leaf in zip(slot.inputs, leaves, strict=True):
            if isinstance(leaf, torch.Tensor) and static.data_ptr() != leaf.data_ptr():
                static.copy_(leaf)
        assert slot.graphs is not None
        graph = slot.graphs.get(graph_key)
        if graph is None:
            graph = slot.graphs[graph_key] = self._capture(
                slot, fn, capture_args(slot.inputs, leaves, widths)
            )
        graph.replay()
        self.replays += 1
        assert slot.outputs is not None
        return slot.outputs

    def _new_slot(self, key: tuple[Any, ...], leaves: list[Any], widths: list[int]) -> _Slot:
        while len(self._slots) >= self.max_slots:
            self._slots.popitem(last=False)
        inputs = [
            torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
            if isinstance(leaf, torch.Tensor)
            else leaf
            for leaf in leaves
        ]
        slot = _Slot(inputs=inputs, widths=widths, pool=torch.cuda.graph_pool_handle(), graphs={})
        self._slots[key] = slot
        return slot

    def _capture(self, slot: _Slot, fn: Callable[..., Any], args: tuple[Any, ...]) -> torch.cuda.CUDAGraph:
        # Warm-up on a side stream (library handles, workspaces, autotuning happen outside capture).
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(max(1, self.warmup)):
                out = fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if slot.outputs is None:
            # Outside the pool: they outlive every capture of the slot.
            slot.outputs = tuple(torch.empty_like(o) for o in out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=slot.pool, capture_error_mode="thread_local"):
            out = fn(*args)
            for dst, src in zip(slot.outputs, out, strict=True):
                dst.copy_(src)
        self.captures += 1
        return graph

    def clear(self) -> None:
        self._slots.clear()


class Accelerator:
    """The GPU paths of one model instance: attention, block calls (graphs, compile) — what the
    models call — and which paths are active on its device."""

    def __init__(self, device: torch.device | str, paths: GpuPaths | None = None) -> None:
        self.device = torch.device(device)
        self.paths = paths if paths is not None else GpuPaths.from_env()
        cuda = self.device.type == "cuda"
        self.flash = cuda and self.paths.flash_attention
        self.graphs = BlockGraphs(self.device) if cuda and self.paths.cuda_graphs else None
        self.compile = cuda and self.paths.compile_blocks
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}

    @property
    def active(self) -> dict[str, bool]:
        """Which paths run on this device (all False on a CPU, whatever the settings say)."""
        cuda = self.device.type == "cuda"
        return {
            "flash_attention": self.flash,
            "cuda_graphs": self.graphs is not None,
            "compile_blocks": self.compile,
            "offload_side_stream": cuda and self.paths.offload_side_stream,
            "offload_pinned": cuda and self.paths.offload_pinned,
        }

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``scaled_dot_product_attention`` of q, k, v [B, heads, tokens, head_dim]; through the flash
        kernel when asked for and eligible (`flash_eligible`), else PyTorch's own choice."""
        if self.flash and flash_eligible(q, mask):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def block(
        self, index: int, fn: Callable[..., Any], args: tuple[Any, ...], *, fixed_shape: bool
    ) -> tuple[torch.Tensor, ...]:
        """``fn(*args)`` for block ``index``: compiled when asked for, replayed from a CUDA graph
        when asked for and ``fixed_shape`` (the caller's statement that this call has the steady
        state's shapes: full KV window, no mask). ``fn`` is a plain function (the same object for
        every block, the block module among ``args``), so one compilation serves all blocks."""
        if self.compile:
            compiled = self._compiled.get(fn)
            if compiled is None:
                compiled = self._compiled[fn] = torch.compile(fn)
            fn = compiled
        if self.graphs is not None and fixed_shape:
            return self.graphs.run(index, fn, args)
        return fn(*args)


__all__ = [
    "ENV_COMPILE_BLOCKS",
    "ENV_CUDA_GRAPHS",
    "ENV_OFFLOAD_PINNED",
    "ENV_OFFLOAD_SIDE_STREAM",
    "ENV_SDPA_FLASH",
    "Accelerator",
    "BlockGraphs",
    "GpuPaths",
    "copy_stream",
    "env_flag",
    "flash_eligible",
    "graph_keys",
    "pin_host_buffers",
]
