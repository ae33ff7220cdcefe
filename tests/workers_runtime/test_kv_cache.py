"""The batched rolling KV cache of the causal DiT adapters (``workers.runtime.models.kv_cache``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.runtime.models.base import SessionState
from workers.runtime.models.kv_cache import KvCacheBatch, attention_over_cache

BLOCKS, SLOTS, TOKENS, DIM, HEADS = 2, 4, 3, 8, 2


def session() -> SessionState:
    cache = torch.zeros(BLOCKS, 2, SLOTS, TOKENS, DIM)
    return SessionState(tensors={"kv_cache": cache}, meta={}, region=cache.view(-1))


def test_a_chunk_written_into_each_sessions_slots_is_read_back_batched():
    # given two sessions and one frame of keys/values each, bound for different ring slots
    states = [session(), session()]
    k, v = torch.randn(2, TOKENS, DIM), torch.randn(2, TOKENS, DIM)
    slots = torch.tensor([[2], [0]])
    # when the cache pass writes block 1
    KvCacheBatch(states, read=0, write_slots=slots).write(1, k, v)
    # then each session holds its own frame in its own slot, and nothing else changed
    assert torch.equal(states[0].tensors["kv_cache"][1, 0, 2], k[0])
    assert torch.equal(states[1].tensors["kv_cache"][1, 1, 0], v[1])
    assert states[0].tensors["kv_cache"][0].count_nonzero() == 0
    # and a pass reading three slots gets [B, 3 × T, D], in slot order
    cached_k, cached_v = KvCacheBatch(states, read=3).cached(1)
    assert cached_k.shape == cached_v.shape == (2, 3 * TOKENS, DIM)
    assert torch.equal(cached_k[0, 2 * TOKENS :], k[0]) and torch.equal(cached_v[1, :TOKENS], v[1])


def test_nothing_is_read_before_the_first_chunk_and_nothing_written_outside_the_cache_pass():
    state = session()
    assert KvCacheBatch([state], read=0).cached(0) == (None, None)
    KvCacheBatch([state], read=2).write(0, torch.ones(1, TOKENS, DIM), torch.ones(1, TOKENS, DIM))
    assert state.tensors["kv_cache"].count_nonzero() == 0


def test_one_session_reads_its_own_region_without_a_copy():
    state = session()
    cached_k, _ = KvCacheBatch([state], read=2).cached(0)
    assert cached_k.data_ptr() == state.tensors["kv_cache"][0, 0].data_ptr()


def test_masked_cache_keys_are_not_attended_to():
    # given a chunk of 2 tokens, a cache of 3 tokens, and a mask hiding the second cached token
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, HEADS, DIM // HEADS) for _ in range(3))
    cache_k, cache_v = torch.randn(1, 3, DIM), torch.randn(1, 3, DIM)
    mask = torch.tensor([[True, False, True]])
    # when the chunk attends over cache and itself
    out = attention_over_cache(q, k, v, cache_k, cache_v, mask)
    # then it is attention over the visible cached tokens and the chunk's own
    seen = [0, 2]
    keys = torch.cat([cache_k[:, seen].unflatten(2, (HEADS, -1)), k], dim=1)
    values = torch.cat([cache_v[:, seen].unflatten(2, (HEADS, -1)), v], dim=1)
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
    assert out.shape == (1, HEADS, 2, DIM // HEADS)
    torch.testing.assert_close(out, expected)
    # and without a cache it is the chunk's own attention
    alone = attention_over_cache(q, k, v, None, None, None)
    own = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert torch.equal(alone, own)
