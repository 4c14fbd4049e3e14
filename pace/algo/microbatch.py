"""How one mini-batch is split over ranks and micro-batches. Pure: lengths in, index lists out.

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
