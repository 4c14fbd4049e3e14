"""The trainer's CUDA memory allocator: expandable segments (stdlib only, set before CUDA starts).

A trainer step allocates and frees tensors of many sizes (the activations of micro-batches of up to
24k tokens, chunked log-prob temporaries, FSDP2's all-gather and reduce-scatter buffers, the weight
sync's gathered tensors). torch's caching allocator cuts blocks out of fixed segments and keeps them
reserved, so memory freed in one size is often unusable for the next (fragmentation: an
out-of-memory with GiBs reserved but free). With `expandable_segments:True` a segment is mapped
page by page and grows, so that memory is reused (PyTorch's CUDA semantics notes, "Optimizing
memory usage with PYTORCH_CUDA_ALLOC_CONF"). torch reads `PYTORCH_CUDA_ALLOC_CONF` when its
allocator configuration is first used, not at `import torch` (torch 2.13: a value set after the
import is what `torch._C._accelerator_getAllocatorSettings()` returns), so train.py sets it right
after choosing the device, before the Accelerator and anything else touch the GPU.

Only the trainer's processes get it, and only where the run chose it:
- on CUDA only: on CPU nothing is set;
- never over the user's own setting: `PYTORCH_CUDA_ALLOC_CONF`, or `PYTORCH_ALLOC_CONF` (torch's
  device-generic name, which wins over it), set even to nothing, is left as it is;
- not with the ``ipc`` weight transfer (an engine on the trainer's GPU): every sync shares the
  trainer's tensors with it by CUDA IPC, several times slower on expandable segments (vLLM 0.32's
  warning, vllm/distributed/weight_transfer/sharded_rdt_trainer.py);
- engine processes the run starts (child engines, local servers) do not inherit the run's value
  (`engine_excluded`): they keep vLLM's allocator defaults (a user's own value is passed on). An
  in-process engine (`rollout.engine_process=inproc`) shares the trainer's process and allocator.
Not run on a GPU.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

VAR = "PYTORCH_CUDA_ALLOC_CONF"
USER_VARS = ("PYTORCH_ALLOC_CONF", VAR)  # either one set by the user: theirs is kept
TRAINER = "expandable_segments:True"
MARK = "PACE_TRAINER_ALLOC_CONF"  # set beside it, to the same value: the run's, not the user's


def trainer_env(environ: Mapping[str, str], device: str, backend: str | None) -> dict[str, str]:
    """The variables a trainer process on ``device`` adds to ``environ`` (empty: none); ``backend``:
    the weight transfer (`pace.placement.backend_kind`; None: no engine)."""
    if device != "cuda" or backend == "ipc" or any(v in environ for v in USER_VARS):
        return {}
    return {VAR: TRAINER, MARK: TRAINER}


def configure_trainer(device: str, backend: str | None) -> None:
    """`trainer_env` into this process's environment. Before CUDA is initialised in it."""
    os.environ.update(trainer_env(os.environ, device, backend))


def engine_excluded(environ: Mapping[str, str]) -> tuple[str, ...]:
    """What an engine process started from ``environ`` leaves out: the trainer's allocator setting
    when the run set it (still its value), and the mark."""
    if MARK not in environ:
        return ()
    return (VAR, MARK) if environ.get(VAR) == environ[MARK] else (MARK,)
