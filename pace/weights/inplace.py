"""Weight patches applied in place by an engine worker (`pace_nccl`, `rollout.weight_delta`): received
and applied in bounded chunks, each patch through the model's own loader.

vLLM 0.32's sparse engine (`vllm/distributed/weight_transfer/sparse_nccl_engine.py`,
`SparseNCCLWeightTransferEngine.receive_weights`) receives every patch of an update onto the GPU and
only then applies them: near `rollout.delta_max_frac` (a third of the elements in bf16, an int32 index
and a value each) that is the size of the model again — ~16 GB for an 8B — beside the engine's
weights and KV cache. Here a worker receives at most `chunk_bytes` of indices and values (a tensor
whose patch alone is larger: that patch), applies them, and receives the next chunk: the trainer
broadcasts them in order either way, so only the worker's side changes.

Each patch is applied by its own call of vLLM's `load_checkpoint_weight_patches`
(`vllm/model_executor/model_loader/checkpoint_weight_patch.py`), which stages it as a NaN-masked
tensor of the checkpoint tensor's full shape and passes it to the model's `load_weights`: one such
staging tensor at a time (the largest, an 8B's embedding: 1.2 GB in bf16) on top of the chunk.

Each call reports the model's parameters it wrote (`load_weights`' names: the engine's, e.g. a fused
`qkv_proj.weight` for the checkpoint's `q_proj.weight`), so the names are audited per tensor sent
(`untrusted`): a patch that reached no parameter (a name the loader skips without a word, as vLLM's
`AutoWeightsLoader` skips a tied alias or an unexpected bias), or one that wrote a parameter the
worker's last whole update did not load, makes the update untrusted — the worker holds θ_version's
patches as far as they went, and the trainer's next sync sends θ whole (pace/weights/sync.py).

Fingerprints (pace/weights/fingerprint.py). The engine cannot fingerprint what it holds after a
patch (fused, TP-sharded runtime tensors), but a fingerprint is a sum of per-position terms, so the
worker advances its fingerprints of what it received for θ_base (a whole update's, or those advanced
by earlier patches): each patched tensor's moves by the terms of the values received less θ_base's
terms at the same positions, which the trainer sends with the patches (one integer a tensor:
`Plan.base_sums`, pace/weights/delta.py). So after a delta the worker reports θ_version's fingerprints
as after a whole sync, and the trainer judges them the same way: an engine whose θ_base was not the
trainer's, or that received other values or positions, differs from the trainer's θ_version. As for a
whole sync, what is judged is what the loader received, not what it wrote (that is the name audit).
"""
from __future__ import annotations

import torch

INDEX_BYTES = 4  # int32 flat indices (vLLM's sparse patches)
CHUNK_BYTES = 512 << 20  # without a bound from the trainer: vLLM's loader's own batching target


def wire_bytes(n: int, dtype: torch.dtype) -> int:
    """Bytes of a patch of ``n`` elements as received: its int32 indices and its values."""
    return n * (INDEX_BYTES + torch.empty((), dtype=dtype).element_size())


def chunks(sizes: list[int], bound: int) -> list[range]:
    """Consecutive runs of the patches (``sizes``: each one's bytes) whose bytes add up to at most
    ``bound``; a patch larger than ``bound`` makes a run of its own. Every patch is in one run, in order."""
    if bound <= 0:
        raise ValueError(f"a chunk's bound must be positive, got {bound}")
    runs, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > bound:
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


def apply(model: torch.nn.Module, patches: list) -> dict[str, set[str]]:
    """Each of ``patches`` (vLLM `CheckpointWeightPatch`es) through the model's loader, one call each;
    per patch's name, the parameter names that call reported written."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    written: dict[str, set[str]] = {}
    for patch in patches:
        written.setdefault(patch.name, set()).update(load_checkpoint_weight_patches(model, [patch]))
    return written


def advance(prints: dict[str, int] | None, terms: dict[str, int], names: list[str],
            base_sums: list[int] | None) -> dict[str, int] | None:
    """θ_version's fingerprints from θ_base's as this worker received them (``prints``): each patched
    tensor's (``names``) less θ_base's terms at its positions (``base_sums``, the trainer's) plus the
    terms of the values received (``terms``, pace/weights/fingerprint.py `terms_at`). None when they
    cannot be told: no fingerprints of θ_base here, or patches sent without base sums."""
    if prints is None or base_sums is None:
        return None
    out = dict(prints)
    for name, base in zip(names, base_sums, strict=True):
        out[name] = out.get(name, 0) - base + terms[name]
    return out


def untrusted(written: dict[str, set[str]], loaded: set[str] | None, base: int | None, version: int | None,
              limit: int = 3) -> str | None:
    """Why a patch update is not to be trusted as the base of the next (one line), or None.
    ``written``: per tensor sent, the parameters its loader call reported written (`apply`);
    ``loaded``: the parameters the worker's last whole update loaded (pace/weights/reload.py's
    `Audit.loaded`; None: the model's loader does not report names)."""
    head = f"weight patches θ_{base} → θ_{version}"
    if loaded is None:
        return f"{head}: the model's loader does not report the parameters it writes, so no patch can be audited"
    missing = sorted(name for name, params in written.items() if not params)
    extra = sorted({p for params in written.values() for p in params} - loaded)
    parts = []
    if missing:
        parts.append(f"{len(missing)} of {len(written)} tensors sent were written into no parameter ({_first(missing, limit)})")
    if extra:
        parts.append(f"{len(extra)} parameters were written that the last whole update did not load ({_first(extra, limit)})")
    return f"{head}: {'; '.join(parts)}" if parts else None


def _first(names: list[str], limit: int) -> str:
    more = f", and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
