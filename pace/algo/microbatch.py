"""How one mini-batch is split over ranks and micro-batches (pure: lengths in, index lists out), and
one micro-batch's tensors (`collate`: trajectories in, model inputs and per-token tensors out).

Two modes, as in verl (`use_dynamic_bsz`/`ppo_max_token_len_per_gpu`) and AReaL (`max_tokens_per_mb`):

- by count (`trainer.max_tokens_per_micro_batch: null`): rank r takes trajectories r, r + N, …
  and cuts its share into consecutive micro-batches of `trainer.micro_batch_size` sequences;
- by tokens (`trainer.max_tokens_per_micro_batch: M`): trajectories go to ranks longest first,
  each to the rank with the fewest tokens so far (balanced work), and each rank's share, sorted
  by length, is cut into micro-batches that cost at most M tokens: Σ lengths when sequences are
  packed into one row, rows × longest when they are right-padded (neighbours in length order
  share a micro-batch, so little is padding). A sequence longer than M is a micro-batch alone.

Every rank runs the same number of micro-batches, because under FSDP each forward and backward
is collective: a rank with fewer splits its largest micro-batches, and where it cannot (fewer
trajectories than micro-batches) it gets empty ones, which the trainer runs as a zero-weight
pass. The token-level loss is a sum over tokens divided by the mini-batch's token count, so none
of this changes the loss or its gradient (up to float summation order).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pace.records import Trajectory


def assign_ranks(lengths: list[int], n_ranks: int, by_tokens: bool) -> list[list[int]]:
    """Indices of each rank's share of the mini-batch."""
    if not by_tokens:
        return [list(range(r, len(lengths), n_ranks)) for r in range(n_ranks)]
    shares: list[list[int]] = [[] for _ in range(n_ranks)]
    load = [0] * n_ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(n_ranks), key=lambda r: (load[r], len(shares[r]), r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def cost(lengths: list[int], packed: bool) -> int:
    """Tokens a micro-batch of sequences of these lengths occupies."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def split_by_tokens(items: list[int], lengths: list[int], max_tokens: int, packed: bool) -> list[list[int]]:
    """Micro-batches of ``items`` (indices into ``lengths``) costing at most ``max_tokens`` each."""
    order = sorted(items, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    if packed:  # first fit decreasing
        room: list[int] = []
        for i in order:
            k = next((k for k, free in enumerate(room) if lengths[i] <= free), None)
            if k is None:
                bins.append([i])
                room.append(max_tokens - lengths[i])
            else:
                bins[k].append(i)
                room[k] -= lengths[i]
        return bins
    for i in order:  # next fit over decreasing lengths: the first of a bin is its longest
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def equalize(per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """Every rank the same number of micro-batches: split the largest, then pad with empty ones."""
    target = max(len(mbs) for mbs in per_rank)
    out = []
    for mbs in per_rank:
        mbs = [list(mb) for mb in mbs]
        while len(mbs) < target:
            k = max(range(len(mbs)), key=lambda k: len(mbs[k]), default=None)
            if k is None or len(mbs[k]) < 2:
                mbs.append([])
                continue
            mb = mbs.pop(k)
            half = len(mb) // 2
            mbs[k:k] = [mb[:half], mb[half:]]
        out.append(mbs)
    return out


def plan(lengths: list[int], n_ranks: int, *, max_seqs: int, max_tokens: int | None = None,
         packed: bool = False) -> list[list[list[int]]]:
    """Per rank, its micro-batches as lists of indices into ``lengths`` (full sequence lengths)."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"trainer.max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    shares = assign_ranks(lengths, n_ranks, by_tokens=max_tokens is not None)
    if max_tokens is None:
        per_rank = [[s[i : i + max_seqs] for i in range(0, len(s), max_seqs)] for s in shares]
    else:
        per_rank = [split_by_tokens(s, lengths, max_tokens, packed) for s in shares]
    return equalize(per_rank)


def collate(trajs: list[Trajectory], prompts: list[list[int]], packed: bool = False,
            route_shape: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Model inputs for one micro-batch, and flat per-response-token tensors [T] (T = Σ responses).

    Right-padded rows (``input_ids``, ``attention_mask`` [R, L]), or with ``packed`` one row of the
    sequences end to end with ``position_ids`` restarting at each (no padding; transformers then
    masks attention within each sequence: varlen flash-attention, or a block mask for SDPA).
    Position p predicts token p+1, so response token t of a sequence with prompt length n_p is
    scored by the hidden state at n_p − 1 + t: ``index`` holds those positions in the flattened
    [R·L] layout. ``targets``, ``loss_mask`` (the action mask), ``logp_behavior``, ``advantages``,
    ``versions`` (v_t), ``engines`` (the engine that served each token's response, −1: several or
    unknown) and ``seq_ids`` (the sequence of each token, 0..``n_seqs``−1) are aligned
    with ``index``; ``pad_tokens``/``slots`` count the padding.

    With ``route_shape`` (layers, top-k: MoE routing replay, pace/algo/routing_replay.py) also the
    recorded routes in the flattened [R·L] order: ``routes`` [R·L, layers, k] (int64), ``route_mask``
    [R·L] (the position has a recorded route: the prompt's from ``Trajectory.prompt_routes``, response
    token t's as an input from ``Trajectory.routes[t]``; False for padding and unrecorded positions)
    and ``route_measure`` (recorded positions whose hidden state scores a loss token: the metrics').
    """
    seqs = [np.concatenate([np.asarray(p, dtype=np.int64), t.response_ids.astype(np.int64)]) for p, t in zip(prompts, trajs)]
    lengths = np.array([len(s) for s in seqs])
    n_prompt = np.array([len(p) for p in prompts])
    n_resp = np.array([len(t) for t in trajs])
    if packed:
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        input_ids = np.concatenate(seqs)[None]
        model_inputs = {"position_ids": torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])[None])}
    else:
        width = int(lengths.max())
        starts = np.arange(len(seqs)) * width
        input_ids = np.zeros((len(seqs), width), dtype=np.int64)
        attention = np.zeros((len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            input_ids[i, : len(s)] = s
            attention[i, : len(s)] = 1
        model_inputs = {"attention_mask": torch.from_numpy(attention)}
    index = np.concatenate([start + n_p - 1 + np.arange(n_r) for start, n_p, n_r in zip(starts, n_prompt, n_resp)])
    mask = np.concatenate([np.ones(len(t), dtype=bool) if t.action_mask is None else t.action_mask for t in trajs])
    routed = {} if route_shape is None else _routes(trajs, starts, n_prompt, input_ids.size, route_shape, index[mask])
    return {
        **routed,
        "input_ids": torch.from_numpy(input_ids),
        **model_inputs,
        "index": torch.from_numpy(index),
        "targets": torch.from_numpy(np.concatenate([t.response_ids for t in trajs]).astype(np.int64)),
        "loss_mask": torch.from_numpy(mask.astype(np.float32)),
        "logp_behavior": torch.from_numpy(np.concatenate([t.logprobs for t in trajs]).astype(np.float32)),
        "advantages": torch.from_numpy(np.repeat(np.array([t.advantage for t in trajs], dtype=np.float32), n_resp)),
        "versions": torch.from_numpy(np.concatenate([t.versions for t in trajs]).astype(np.int64)),
        # each token's response's first version (the mismatch guard's on-policy tokens: correction.on_policy_tokens)
        "first_versions": torch.from_numpy(np.repeat(np.array([int(t.versions[0]) if len(t.versions) else -1
                                                               for t in trajs], dtype=np.int64), n_resp)),
        "seq_ids": torch.from_numpy(np.repeat(np.arange(len(trajs)), n_resp)),
        # each token's response's engine (−1: several, or unknown): the per-engine mismatch
        "engines": torch.from_numpy(np.repeat(np.array([t.engine for t in trajs], dtype=np.int64), n_resp)),
        "n_seqs": torch.tensor(len(trajs)),
        "pad_tokens": torch.tensor(float(input_ids.size - lengths.sum())),
        "slots": torch.tensor(float(input_ids.size)),
    }


def _routes(trajs: list[Trajectory], starts: np.ndarray, n_prompt: np.ndarray, slots: int,
            shape: tuple[int, int], scoring: np.ndarray) -> dict[str, torch.Tensor]:
    """`collate`'s route tensors: each sequence's recorded rows copied to its positions of the
    flattened layout (``starts``: where each sequence begins in it; ``scoring``: the flat
    positions whose hidden state scores a loss token)."""
    routes = np.zeros((slots, *shape), dtype=np.int64)
    mask = np.zeros(slots, dtype=bool)
    for t, start, n_p in zip(trajs, starts, n_prompt):
        for rows, at, room in ((t.prompt_routes, start, n_p), (t.routes, start + n_p, len(t))):
            if rows is None:
                continue
            if rows.shape[1:] != shape:
                raise ValueError(f"algo.routing_replay: a trajectory's routes have [layers, top-k] {list(rows.shape[1:])}, "
                                 f"the model {list(shape)}")
            rows = rows[:room]
            routes[at : at + len(rows)] = rows
            mask[at : at + len(rows)] = True
    measure = np.zeros(slots, dtype=bool)
    measure[scoring] = True
    return {"routes": torch.from_numpy(routes), "route_mask": torch.from_numpy(mask),
            "route_measure": torch.from_numpy(measure & mask)}
