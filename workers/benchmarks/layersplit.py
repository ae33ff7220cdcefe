"""Cooperative layer-split execution while a worker loads (BlitzScale §5.2, "ZigZag"): measured.

The question (issue 13): while a new worker is still receiving weights (blocks arrive in order along
the chain), can it run the first ``L`` DiT blocks it already holds for sessions moved off an
overloaded old worker, handing the activations to the old worker for blocks ``L..N`` on every
denoising step — and does that shorten chunk latency during scale-out versus simply waiting for the
full load?

Two real processes (rank 0 = the old, overloaded worker holding ``B = K + M`` sessions; rank 1 = the
loading worker) talk over a Gloo pair group (``workers.runtime.transport.gloo``, built on a TCPStore
as migrations build it). Per round the bench measures, on the causal DiT (``causal_dit.py``):

* ``whole_B``: the old worker's chunk step over all ``B`` sessions (what every session sees while the
  new worker loads and nothing is split);
* ``whole_K`` / ``whole_M``: the chunk step at ``K`` (old worker after the move) and at ``M`` (the
  moved sessions alone, the new worker once fully loaded);
* ``split[L]``: per denoising step, the new worker runs embed + blocks ``0..L`` for the ``M`` moved
  sessions and sends the activations; the old worker runs its own ``K`` sessions' whole step, then
  blocks ``L..N`` + head for the moved ones and sends the next latents back (the new worker's part
  overlaps the old worker's own step). A final pass at t=0 writes each side's KV blocks. Reported:
  the moved sessions' chunk latency, the old worker's own sessions' chunk latency, the hand-off bytes
  per chunk and the hand-off time per chunk (the same transfers, ping-ponged without compute), and
  the one-off KV move (the moved sessions' KV of blocks ``0..L``, which the new worker must own);
* correctness: the split chunk's frames and latents are compared with the whole step of the same
  sessions (bit-for-bit on CPU: the same kernels at the same batch).

Then the load timeline: the weights arrive at the paced link rate (``LinkPacer``'s
``mbps × 10⁶ / 8`` bytes/s), the non-block tensors first and the DiT blocks in order; block ``i`` is
usable once everything up to it has arrived. Stepping through the load window chunk by chunk gives
the chunk steps that fall inside it and the latency saved by splitting versus waiting. The same
quantities are projected for ``wan-1.3b`` shapes from tensor sizes and the GPU profiles' links
(``scheduling.core.gpu_profiles``), with the chunk step time taken from the profile's latency curve;
those figures are labelled projections. See docs/scaleout.md.
"""

from __future__ import annotations

import copy
import datetime
import math
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from contracts import bench
from scheduling.core.gpu_profiles import BUILTIN_PROFILES
from workers.runtime.models.causal_dit import (
    PRESETS,
    CausalDiTModel,
    CausalDiTNetwork,
    rope_tables,
    timestep_embedding,
)
from workers.runtime.models.kv_cache import KvCacheBatch
from workers.runtime.transport.gloo import GlooPairGroup

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --- the split forward --------------------------------------------------------------------------


class ChunkPlan:
    """Everything a chunk step derives from its sessions before the first forward (as ``generate``)."""

    def __init__(self, model: Any, states: list[Any]) -> None:

        cfg = model.cfg
        self.model, self.states = model, states
        fpc = cfg.frames_per_chunk
        shape = (fpc, cfg.latent_channels, cfg.latent_height, cfg.latent_width)
        self.chunks = [s.next_chunk for s in states]
        gens = [model.chunk_noise(s, c) for s, c in zip(states, self.chunks, strict=True)]
        draws = len(model.sigmas)
        per = [torch.stack([torch.randn(shape, generator=g) for _ in range(draws)]) for g in gens]
        self.noise = torch.stack(per, dim=1).to(model.device)
        self.context = torch.stack([s.tensors["prompt_embeds"] for s in states])
        self.frames_written = [int(s.meta["frames_written"]) for s in states]
        pos = torch.tensor([[c * fpc + i for i in range(fpc)] for c in self.chunks], dtype=torch.float64)
        self.rope = rope_tables(cfg, pos, model.device)
        self.cache = model._gather_cache_plan(states, self.frames_written)
        self.slots = torch.tensor([model._ring_slots(fw) for fw in self.frames_written]).to(model.device)


def embed(model: Any, latents: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens after patch_embed, temb, e) — the part before block 0 (as ``_forward``)."""

    cfg, dit = model.cfg, model.net.dit
    b, f, c, h, w = latents.shape
    p = cfg.patch
    tokens = (
        latents.to(model.dtype)
        .view(b, f, c, h // p, p, w // p, p)
        .permute(0, 1, 3, 5, 2, 4, 6)
        .reshape(b, f * (h // p) * (w // p), c * p * p)
    )
    t = torch.full((b,), sigma * 1000.0, device=model.device)
    temb = dit.time_embed(timestep_embedding(t).to(model.dtype))
    return dit.patch_embed(tokens), temb, dit.time_proj(temb)


def run_blocks(
    model: Any, plan: ChunkPlan, x: torch.Tensor, e: torch.Tensor, lo: int, hi: int, write: bool
) -> torch.Tensor:
    """DiT blocks ``lo..hi`` over activations ``x`` (as ``_forward``'s loop, sliced)."""
    read, mask = plan.cache
    kv_cache = KvCacheBatch(plan.states, read=read, write_slots=plan.slots if write else None)
    for index in range(lo, hi):
        ck, cv = kv_cache.cached(index)
        x, k, v = model.net.dit.blocks[index](x, e, plan.context, plan.rope, ck, cv, mask)
        kv_cache.write(index, k, v)
    return x


def head(model: Any, x: torch.Tensor, temb: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    cfg, dit = model.cfg, model.net.dit
    b, f, c, h, w = latents.shape
    p = cfg.patch
    shift, scale = (dit.head_modulation + temb.unsqueeze(1)).chunk(2, dim=1)
    out = dit.head(dit.head_norm(x) * (1 + scale) + shift)
    return out.view(b, f, h // p, w // p, c, p, p).permute(0, 1, 4, 2, 5, 3, 6).reshape(b, f, c, h, w).float()


def finish_chunk(model: Any, plan: ChunkPlan, x: torch.Tensor) -> torch.Tensor:
    """Decode and advance the sessions (as the end of ``generate``); returns the frames."""
    fpc = model.cfg.frames_per_chunk
    previous = torch.stack([s.tensors["latent_history"] for s in plan.states])
    frames = model.net.decoder(x.to(model.dtype), previous.to(model.dtype))
    for i, state in enumerate(plan.states):
        state.tensors["latent_history"].copy_(x[i, -1])
        state.meta["frames_written"] = plan.frames_written[i] + fpc
        state.meta["next_chunk"] = plan.chunks[i] + 1
    return frames


def clone_states(model: Any, states: list[Any]) -> list[Any]:
    out = []
    for s in states:
        c = model.create_state("x", 0)
        for name, tensor in s.tensors.items():
            c.tensors[name].copy_(tensor)
        c.meta = copy.deepcopy(s.meta)
        out.append(c)
    return out


# --- the two processes ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(rank: int, port: int) -> Any:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    return GlooPairGroup(store, rank, device=torch.device("cpu"), local_host="127.0.0.1", timeout_s=120)


def _send(group: Any, t: torch.Tensor) -> None:
    group.wait(group.isend(t.contiguous()), 120)


def _recv(group: Any, like: torch.Tensor) -> torch.Tensor:
    buf = torch.empty_like(like)
    group.wait(group.irecv(buf), 120)
    return buf


def _barrier(group: Any) -> None:
    token = torch.zeros(1)
    if group.rank == 0:
        _send(group, token)
        _recv(group, token)
    else:
        _recv(group, token)
        _send(group, token)


def _worker(rank: int, port: int, spec: dict[str, Any], queue: Any) -> None:
    try:
        torch.set_num_threads(spec["threads"])
        result = _run_rank(rank, _pair(rank, port), spec)
        queue.put((rank, result, None))
    except BaseException as exc:
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def _make_sessions(model: Any, count: int, offset: int, warm_chunks: int) -> list[Any]:
    states = [model.create_state(f"session {offset + i} a drifting scene", offset + i) for i in range(count)]
    for _ in range(warm_chunks):  # fill the KV ring so attention reads a full window
        model.generate(states)
    return states


def _run_rank(rank: int, group: Any, spec: dict[str, Any]) -> dict[str, Any]:

    model = CausalDiTModel.from_preset(spec["preset"], device="cpu")
    cfg = model.cfg
    k, m, nblocks = spec["k"], spec["m"], cfg.blocks
    steps = len(model.sigmas)
    warm_chunks = spec["warm_chunks"]
    # Both sides build the moved sessions identically (same seeds, same chunks), so the new worker's
    # prompt embeddings and latents match; its KV of blocks 0..L is then sent by the old worker.
    moved = _make_sessions(model, m, 1000, warm_chunks)
    own = _make_sessions(model, k, 0, warm_chunks) if rank == 0 else []
    out: dict[str, Any] = {"whole": {}, "split": {}, "handoff": {}}

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    if rank == 0:
        for label, batch in (("B", own + moved), ("K", own), ("M", moved)):
            samples = []
            for rnd in bench.rounds(spec["repeats"], spec["warmup"]):
                work = clone_states(model, batch)
                dt = timed(lambda w=work: model.generate(w))
                if rnd.measured:
                    samples.append(dt)
            out["whole"][label] = samples
    _barrier(group)

    b_tok = cfg.tokens_per_frame * cfg.frames_per_chunk
    act = torch.zeros(m, b_tok, cfg.dim, dtype=model.dtype)
    lat = torch.zeros(m, cfg.frames_per_chunk, cfg.latent_channels, cfg.latent_height, cfg.latent_width)
    for split_l in spec["splits"]:
        # The KV the new worker must own: blocks 0..L of the moved sessions (sent once per move).
        kv_bytes = 0
        t0 = time.perf_counter()
        for s in moved:
            part = s.tensors["kv_cache"][:split_l]
            kv_bytes += part.numel() * part.element_size()
            if rank == 0:
                _send(group, part)
            else:
                part.copy_(_recv(group, part))
        kv_move_s = time.perf_counter() - t0
        moved_lat, own_lat, equal, max_diff = [], [], True, 0.0
        for rnd in bench.rounds(spec["repeats"], spec["warmup"]):
            work = clone_states(model, moved)
            ref = clone_states(model, moved) if rank == 0 else None
            own_work = clone_states(model, own) if rank == 0 else []
            _barrier(group)
            t0 = time.perf_counter()
            plan = ChunkPlan(model, work)
            own_plan = ChunkPlan(model, own_work) if own_work else None
            own_x = own_plan.noise[0] if own_plan else None
            x = plan.noise[0]
            own_done = None
            for step in range(steps + 1):  # `steps` denoising passes + the t=0 cache pass
                sigma = model.sigmas[step] if step < steps else 0.0
                write = step == steps
                if rank == 1:
                    h, _, e = embed(model, x, sigma)
                    _send(group, run_blocks(model, plan, h, e, 0, split_l, write))
                    if step < steps:
                        x = _recv(group, lat)
                    continue
                # Old worker: its own sessions' pass first (the new worker's part overlaps it).
                if own_plan is not None:
                    oh, otemb, oe = embed(model, own_x, sigma)
                    oh = run_blocks(model, own_plan, oh, oe, 0, nblocks, write)
                    if step < steps:
                        vel = head(model, oh, otemb, own_x)
                        x0 = own_x - sigma * vel
                        nxt = model.sigmas[step + 1] if step + 1 < steps else None
                        own_x = x0 if nxt is None else (1.0 - nxt) * x0 + nxt * own_plan.noise[step + 1]
                    else:
                        finish_chunk(model, own_plan, own_x)
                        own_done = time.perf_counter() - t0
                _, temb, e = embed(model, x, sigma)  # cheap: the time embedding only is used
                h = run_blocks(model, plan, _recv(group, act), e, split_l, nblocks, write)
                if step < steps:
                    x0 = x - sigma * head(model, h, temb, x)
                    nxt = model.sigmas[step + 1] if step + 1 < steps else None
                    x = x0 if nxt is None else (1.0 - nxt) * x0 + nxt * plan.noise[step + 1]
                    _send(group, x)
            if rank == 0:
                frames = finish_chunk(model, plan, x)
                dt = time.perf_counter() - t0
                ref_frames = model.generate(ref)
                expect = torch.stack([c.frames for c in ref_frames])
                same = torch.equal(frames, expect) and all(
                    torch.equal(a.tensors["latent_history"], r.tensors["latent_history"])
                    and torch.equal(a.tensors["kv_cache"][split_l:], r.tensors["kv_cache"][split_l:])
                    for a, r in zip(work, ref, strict=True)
                )
                diff = float((frames.float() - expect.float()).abs().max())
                if rnd.measured:
                    moved_lat.append(dt)
                    own_lat.append(own_done if own_done is not None else 0.0)
                    equal = equal and same
                    max_diff = max(max_diff, diff)
            _barrier(group)
        # The hand-offs alone: the same transfers in the same order, no compute.
        handoff = []
        for rnd in bench.rounds(spec["repeats"], spec["warmup"]):
            _barrier(group)
            t0 = time.perf_counter()
            for step in range(steps + 1):
                if rank == 1:
                    _send(group, act)
                    if step < steps:
                        _recv(group, lat)
                else:
                    _recv(group, act)
                    if step < steps:
                        _send(group, lat)
            if rnd.measured:
                handoff.append(time.perf_counter() - t0)
        out["split"][str(split_l)] = {
            "moved": moved_lat,
            "own": own_lat,
            "equal": equal,
            "max_abs_diff": max_diff,
            "kv_move_bytes": kv_bytes,
            "kv_move_s": kv_move_s,
        }
        out["handoff"][str(split_l)] = handoff
    group.close()
    return out


# --- the load timeline ------------------------------------------------------------------------------


def block_bytes(preset: str) -> tuple[int, list[int], int]:
    """(bytes before the DiT blocks, bytes of each DiT block, bytes after them) of a preset, from
    tensor shapes, in the state dict's order — the order the weights manifest sends its blocks in
    (text encoder and embeddings, then ``dit.blocks.0..N``, then the head and the decoder)."""

    cfg = PRESETS[preset]
    with torch.device("meta"):
        net = CausalDiTNetwork(cfg)
    width = DTYPE_BYTES[cfg.dtype]
    blocks = [0] * cfg.blocks
    before = after = 0
    for name, p in net.state_dict().items():
        if name.startswith("dit.blocks."):
            blocks[int(name.split(".")[2])] += p.numel() * width
        elif any(blocks):
            after += p.numel() * width
        else:
            before += p.numel() * width
    return before, blocks, after


def load_timeline(
    *,
    prefix_bytes: int,
    blocks: Sequence[int],
    suffix_bytes: int = 0,
    bytes_per_s: float,
    whole_b: float,
    split_latency: Callable[[int], float | None],
) -> dict[str, Any]:
    """Step through the load window chunk by chunk: waiting (every chunk at ``whole_b``) versus
    splitting (a chunk started with ``L`` blocks received runs at ``split_latency(L)``, or at
    ``whole_b`` where splitting is not possible or slower). The saved latency sums, over the moved
    sessions' chunks inside the window, ``whole_b`` minus the chunk's latency."""
    ready = []
    total = prefix_bytes
    for nbytes in blocks:
        total += nbytes
        ready.append(total / bytes_per_s)
    window = (total + suffix_bytes) / bytes_per_s
    t, chunks_split, saved = 0.0, 0, 0.0
    while t < window:
        have = sum(1 for r in ready if r <= t)
        lat = split_latency(have) if 0 < have < len(blocks) else None
        lat = whole_b if lat is None else min(lat, whole_b)
        saved += whole_b - lat
        t += lat
        chunks_split += 1
    return {
        "load_window_s": window,
        "first_block_ready_s": ready[0],
        "chunk_steps_in_window_wait": window / whole_b,
        "chunk_steps_in_window_split": chunks_split,
        "latency_saved_s": saved,
    }


def _interp(table: dict[int, float], nblocks: int) -> Callable[[int], float | None]:
    """Split latency for ``L`` received blocks: the measured figure of the largest measured ``L' ≤ L``."""

    def lookup(have: int) -> float | None:
        usable = [lv for lv in table if lv <= have and 0 < lv < nblocks]
        return table[max(usable)] if usable else None

    return lookup


def projection_wan(
    *, profile: str = "h100-1.3b", k: int | None = None, m: int | None = None
) -> dict[str, Any]:
    """Projected figures for the wan-1.3b shapes (not measured): bytes from the tensor sizes, times
    from the GPU profile's links and latency curve."""

    cfg = PRESETS["wan-1.3b"]
    prof = BUILTIN_PROFILES[profile]
    k = k or int(prof.capacity)
    m = m or max(1, k // 2)
    width = DTYPE_BYTES[cfg.dtype]
    tokens = cfg.tokens_per_frame * cfg.frames_per_chunk
    steps = cfg.denoising_steps
    act_bytes = m * tokens * cfg.dim * width  # one block boundary, one pass, m sessions
    lat_bytes = m * cfg.frames_per_chunk * cfg.latent_channels * cfg.latent_height * cfg.latent_width * 4
    handoff_bytes = (steps + 1) * act_bytes + steps * lat_bytes
    kv_per_block = 2 * cfg.window_frames * cfg.tokens_per_frame * cfg.dim * width
    prefix, blocks, suffix = block_bytes("wan-1.3b")
    topo = prof.scale_out.topology
    links = {
        "nvlink": topo.nvlink_gbps,
        "rdma": topo.rdma_gbps,
        "pcie_host_cache": topo.pcie_gbps,
        "nvme": topo.nvme_gbps,
        # BlitzScale §6 measured its SSD loads at 10 Gbps: the slow path where loading is long.
        "ssd_10gbps_blitzscale": 1.25,
    }
    step_b = prof.latency_ms(k + m) / 1000.0
    step_k = prof.latency_ms(k) / 1000.0
    rows = {}
    dit_bytes = prefix + sum(blocks) + suffix
    full_bytes = prof.scale_out.weights_bytes
    for name, gbps in links.items():
        if not gbps:
            continue
        rate = gbps * 1e9
        rows[name] = {
            "link_gbps": gbps,
            "dit_load_window_s": dit_bytes / rate,
            "chunk_steps_in_dit_window_at_B": dit_bytes / rate / step_b,
            "full_load_window_s": full_bytes / rate,
            "chunk_steps_in_full_window_at_B": full_bytes / rate / step_b,
            # The most splitting could save in the window: the old worker's step shrinks by at most
            # the moved sessions' share, (step_B - step_K), for every chunk step inside the window.
            "max_saved_s_per_session": (dit_bytes / rate / step_b) * (step_b - step_k),
        }
    # The hand-off and the KV move run between the two GPUs: NVLink on one host, RDMA across hosts.
    between = {"nvlink": topo.nvlink_gbps, "rdma": topo.rdma_gbps}
    handoff = {
        name: {
            "handoff_s_per_chunk": handoff_bytes / (gbps * 1e9),
            "kv_move_s_per_session_per_block": kv_per_block / (gbps * 1e9),
            "kv_move_s_per_session_all_blocks": cfg.blocks * kv_per_block / (gbps * 1e9),
        }
        for name, gbps in between.items()
        if gbps
    }
    return {
        "label": "projection (tensor sizes × profile links; not measured)",
        "profile": profile,
        "k": k,
        "m": m,
        "dit_weights_bytes": dit_bytes,
        "block_bytes": blocks[0],
        "activation_bytes_per_handoff": act_bytes,
        "handoff_bytes_per_chunk": handoff_bytes,
        "kv_bytes_per_block_per_session": kv_per_block,
        "chunk_step_s_at_B": step_b,
        "chunk_step_s_at_K": step_k,
        "full_weights_bytes": full_bytes,
        "links": rows,
        "between_workers": handoff,
        "note": (
            "dit window: the preset's DiT + small text encoder + decoder; full window: the profile's "
            "weights (DiT + UMT5-XXL text encoder + VAE, the worker's time to ready). Moved sessions "
            "need no text encoder (their prompt embeddings travel in the state). The old worker's "
            "step only shrinks by the moved sessions' first L blocks: at most (step_B - step_K) × L / blocks"
        ),
    }


# --- the bench ----------------------------------------------------------------------------------


def run_layersplit(
    preset: str,
    *,
    k: int,
    m: int,
    splits: Sequence[int] | None = None,
    link_mbps: float = 1000.0,
    repeats: int = 3,
    warmup: int = 1,
    warm_chunks: int = 2,
    threads: int = 1,
    progress: Callable[[str], Any] = print,
) -> dict[str, Any]:

    if preset not in PRESETS:
        raise ValueError(f"--preset: unknown causal-dit preset {preset!r}; available: {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    if k < 0 or m < 1:
        raise ValueError(f"--k must be >= 0 and --m >= 1, got k={k} m={m}")
    if not link_mbps > 0:
        raise ValueError(f"--link-mbps must be positive, got {link_mbps!r}")
    if splits is None:
        splits = sorted({1, cfg.blocks // 2, cfg.blocks - 1} - {0})
    for s in splits:
        if not 0 < s < cfg.blocks:
            raise ValueError(f"--splits: L must be in 1..{cfg.blocks - 1}, got {s}")
    spec = {
        "preset": preset,
        "k": k,
        "m": m,
        "splits": list(splits),
        "repeats": repeats,
        "warmup": warmup,
        "warm_chunks": warm_chunks,
        "threads": threads,
    }
    progress(f"layer-split bench: preset={preset} K={k} M={m} L={list(splits)} (2 processes, Gloo)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, spec, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in procs:
        rank, res, err = queue.get(timeout=1800)
        results[rank] = res
        if err:
            errors.append(f"rank {rank}: {err}")
    for p in procs:
        p.join(timeout=60)
    if errors:
        raise RuntimeError("; ".join(errors))
    old = results[0]
    whole = {label: bench.summarize(v) for label, v in old["whole"].items()}
    whole_b = whole["B"]["p50"]
    split_rows = {}
    table = {}
    width = DTYPE_BYTES[cfg.dtype]
    tokens = cfg.tokens_per_frame * cfg.frames_per_chunk
    steps = cfg.denoising_steps
    act_bytes = m * tokens * cfg.dim * width
    lat_bytes = m * cfg.frames_per_chunk * cfg.latent_channels * cfg.latent_height * cfg.latent_width * 4
    for key, row in old["split"].items():
        moved = bench.summarize(row["moved"])
        own = bench.summarize(row["own"])
        hand = bench.summarize(results[1]["handoff"][key])
        table[int(key)] = moved["p50"]
        split_rows[key] = {
            "moved_chunk_s": moved,
            "own_chunk_s": own,
            "handoff_s_per_chunk": hand,
            "handoff_bytes_per_chunk": (steps + 1) * act_bytes + steps * lat_bytes,
            "kv_move_bytes": row["kv_move_bytes"],
            "kv_move_s": row["kv_move_s"],
            "equal_to_whole": row["equal"],
            "max_abs_diff": row["max_abs_diff"],
        }
    prefix, blocks, suffix = block_bytes(preset)
    timeline = load_timeline(
        prefix_bytes=prefix,
        blocks=blocks,
        suffix_bytes=suffix,
        bytes_per_s=link_mbps * 1e6 / 8,
        whole_b=whole_b,
        split_latency=_interp(table, cfg.blocks),
    )
    return {
        "bench": "layersplit",
        "preset": preset,
        "config": asdict(cfg),
        "k": k,
        "m": m,
        "b": k + m,
        "splits": list(splits),
        "repeats": repeats,
        "warmup": warmup,
        "threads_per_process": threads,
        "link_mbps": link_mbps,
        "activation_bytes_per_handoff": act_bytes,
        "latent_bytes_per_return": lat_bytes,
        "whole_chunk_s": whole,
        "split": split_rows,
        "weights": {
            "before_blocks_bytes": prefix,
            "block_bytes": blocks,
            "after_blocks_bytes": suffix,
            "total_bytes": prefix + sum(blocks) + suffix,
        },
        "timeline": timeline,
        "projection_wan_1_3b": projection_wan(),
        "pid": os.getpid(),
    }


def _ms(summary: dict[str, Any]) -> str:
    v = summary.get("p50")
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1000:.1f} ms"


def format_layersplit(report: dict[str, Any]) -> str:
    w = report["whole_chunk_s"]
    lines = [
        f"layer-split bench: preset={report['preset']} K={report['k']} M={report['m']} "
        f"(B={report['b']}), {report['threads_per_process']} thread/process, link {report['link_mbps']} Mbit/s",
        f"whole chunk step (old worker): B={_ms(w['B'])}  K={_ms(w['K'])}  M alone={_ms(w['M'])}",
        f"hand-off per pass: {report['activation_bytes_per_handoff']:,} B activations "
        f"+ {report['latent_bytes_per_return']:,} B latents back",
        "",
        f"{'L':>3} {'moved chunk':>12} {'own chunk':>10} {'hand-off':>10} {'bytes/chunk':>13} "
        f"{'KV move':>12} {'equal':>6}",
    ]
    for key, row in report["split"].items():
        lines.append(
            f"{key:>3} {_ms(row['moved_chunk_s']):>12} {_ms(row['own_chunk_s']):>10} "
            f"{_ms(row['handoff_s_per_chunk']):>10} {row['handoff_bytes_per_chunk']:>13,} "
            f"{row['kv_move_bytes']:>10,} B {row['equal_to_whole']!s:>6}"
        )
    t = report["timeline"]
    lines += [
        "",
        f"load window {t['load_window_s']:.3f} s (first block usable at {t['first_block_ready_s']:.3f} s): "
        f"{t['chunk_steps_in_window_wait']:.2f} chunk steps at B; split saves {t['latency_saved_s']:.3f} s "
        f"over {t['chunk_steps_in_window_split']} moved chunks",
    ]
    p = report["projection_wan_1_3b"]
    lines += [
        "",
        f"wan-1.3b {p['label']}: profile {p['profile']} K={p['k']} M={p['m']}, step at B "
        f"{p['chunk_step_s_at_B'] * 1000:.0f} ms, at K {p['chunk_step_s_at_K'] * 1000:.0f} ms",
        f"  activations {p['activation_bytes_per_handoff']:,} B/hand-off, {p['handoff_bytes_per_chunk']:,} B/chunk; "
        f"KV {p['kv_bytes_per_block_per_session']:,} B per block per session; DiT {p['dit_weights_bytes']:,} B",
    ]
    for name, row in p["links"].items():
        lines.append(
            f"  load over {name:>22} {row['link_gbps']:>6} GB/s: DiT {row['dit_load_window_s'] * 1000:>6.0f} ms "
            f"= {row['chunk_steps_in_dit_window_at_B']:.2f} steps; full {row['full_load_window_s'] * 1000:>6.0f} ms "
            f"= {row['chunk_steps_in_full_window_at_B']:.2f} steps; at most {row['max_saved_s_per_session'] * 1000:.0f} ms "
            "saved per session"
        )
    for name, row in p["between_workers"].items():
        lines.append(
            f"  old↔new over {name}: hand-off {row['handoff_s_per_chunk'] * 1000:.1f} ms/chunk; KV move "
            f"{row['kv_move_s_per_session_per_block'] * 1000:.1f} ms per block per session "
            f"({row['kv_move_s_per_session_all_blocks'] * 1000:.0f} ms all blocks)"
        )
    return "\n".join(lines)
