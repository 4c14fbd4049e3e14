"""The trainer's weights as the engines load them: torch only, so that the trainer side runs (and
scripts/gpu_smoke.py checks it) where vLLM is not installed. `pace.weights.transfer.CastSource`
is vLLM's `WeightSource` over these two functions."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from pace.weights.streams import on_default_stream

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean(name: str) -> str:
    """Parameter names as the HF model has them: no DDP/FSDP/compile/checkpointing wrappers."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(clean name, parameter) once per parameter: tied weights (lm_head = embed_tokens) travel once,
    as the checkpoint has them."""
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield clean(name), p


def engine_tensor(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``p`` whole, in ``dtype``: the local shard is cast first (the all-gather moves engine-dtype
    bytes, not fp32), then gathered if sharded (`full_tensor()`, a collective on every rank).

    On a GPU the cast and the gather run on the default stream and are finished before the tensor
    is returned (pace/weights/streams.py): vLLM's packed NCCL sender pulls each tensor inside its
    side-stream context, where trainer rank 0's gather would queue behind the transfer group's
    broadcasts while ranks ≥ 1 gather with nothing ahead, and with more than 2 trainer ranks the
    sync hangs. One host sync a parameter. On CPU nothing changes (no CUDA call)."""
    def whole() -> torch.Tensor:
        with torch.no_grad():
            t = p.detach().to(dtype)
            return t.full_tensor() if hasattr(t, "full_tensor") else t

    return on_default_stream(p.device, whole)
