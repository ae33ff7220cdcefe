"""The sessions' rolling KV caches as one batch, block by block: what a causal DiT's forward pass
reads before each block, attends over in it, and in the cache pass writes after it
(``causal_dit.py``, ``wan_causal.py``; Self-Forcing's rolling cache, TurboServe §6.1's state region).

A session's ``kv_cache`` region is ``[blocks, 2 (keys, values), window slots, tokens per frame, D]``,
its slots a ring after the sink frames (the models' ``_ring_slots``). A pass over a batch reads the
first ``read`` slots of every session (the model's cache plan masks the slots a session has not
filled) and, in the cache pass that follows a sampled chunk (t = 0), writes the chunk's keys and
values into each session's own slots. ``workers/benchmarks/layersplit.py`` times this loop
split across devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.runtime.models.base import SessionState


@dataclass(frozen=True)
class KvCacheBatch:
    """The caches of ``states`` (the batch's order) for one forward pass."""

    states: Sequence[SessionState]
    # Ring slots every session's read covers (0: nothing cached yet, or a pass without the cache).
    read: int
    # [B, F]: where each session's F frames of this chunk go; None outside the cache pass.
    write_slots: torch.Tensor | None = None

    def cached(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """``block``'s cached keys and values, ``[B, read × T, D]`` each; (None, None) when the pass
        reads nothing."""
        if not self.read:
            return None, None
        if len(self.states) == 1:  # a view of the session's own region: no copy
            region = self.states[0].tensors["kv_cache"][block, :, : self.read].unsqueeze(1)
        else:
            region = torch.stack([s.tensors["kv_cache"][block, :, : self.read] for s in self.states], dim=1)
        return region[0].flatten(1, 2), region[1].flatten(1, 2)

    def write(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """In the cache pass, this chunk's keys and values ``[B, F × T, D]`` of ``block`` into each
        session's ``write_slots``; outside it, nothing."""
        if self.write_slots is None:
            return
        _, _, _, tokens_per_frame, dim = self.states[0].tensors["kv_cache"].shape
        kv = torch.stack([k, v], dim=1).view(len(self.states), 2, -1, tokens_per_frame, dim)
        for i, state in enumerate(self.states):
            state.tensors["kv_cache"][block].index_copy_(1, self.write_slots[i], kv[i])


def attention_over_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor | None,
    cache_v: torch.Tensor | None,
    cache_mask: torch.Tensor | None,
    attention: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Self-attention of a chunk's tokens over the cached tokens and their own.

    ``q``, ``k`` (RoPE'd), ``v``: the chunk's ``[B, N, H, hd]``; ``cache_k``, ``cache_v``: the cache's
    ``[B, M, H × hd]`` (``KvCacheBatch.cached``; None: nothing cached); ``cache_mask``: which of the M
    cached keys each session may see, ``[B, M]`` (None: all). A chunk's tokens always see each other.
    ``attention(q, k, v, mask)`` on ``[B, H, tokens, hd]`` is the kernel (the model's
    ``Accelerator.attention``; default PyTorch's ``scaled_dot_product_attention``).
    Returns ``[B, H, N, hd]``.
    """
    b, n, heads, _ = k.shape
    keys, values = k, v
    if cache_k is not None:
        keys = torch.cat([cache_k.unflatten(2, (heads, -1)), k], dim=1)
        values = torch.cat([cache_v.unflatten(2, (heads, -1)), v], dim=1)
    mask = None
    if cache_mask is not None:
        own = torch.ones(b, n, dtype=torch.bool, device=q.device)
        mask = torch.cat([cache_mask, own], dim=1)[:, None, None, :]
    q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if attention is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return attention(q, keys, values, mask)
