"""CUDA streams on the weight path: work done inside another's stream context, done on the default stream.

vLLM 0.32's packed NCCL transfer (vllm/distributed/weight_transfer/packed_tensor.py) runs the code
we hand it inside `torch.cuda.stream(side)`, with side streams of its own (`_get_streams`, one per
buffer): the sender (`packed_nccl_broadcast_producer`) pulls the next (name, tensor) from the
trainer's iterator there, behind the transfer group's broadcasts of earlier chunks on those
streams, and the receiver (`packed_nccl_broadcast_consumer`) calls the engine's loader there. What
such code makes on the current stream is therefore made on a side stream:
- a collective is queued behind the other group's broadcasts on trainer rank 0 only (ranks ≥ 1
  iterate on their default stream with nothing ahead): with more than 2 trainer ranks the two NCCL
  groups' orders cross and the sync hangs (huggingface/trl#6797, fixed by PR #6798 so; #7103);
- a tensor kept past that code (a cache) is written on a side stream, and another stream may read
  it before the write has run.

`on_default_stream` makes such a tensor on the device's default stream and waits for it: the
caller gets a finished tensor whatever stream it is on. On CPU (or meta) it makes no CUDA call.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def on_default_stream(device: torch.device | str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` with ``device``'s default CUDA stream current, finished before this returns (the
    host waits for that stream: one sync), and marked as used by the caller's current stream
    (`Tensor.record_stream`: the caching allocator, which ties a block to the stream it was made on,
    then does not hand its memory to the default stream's next allocation until the caller's work
    queued on it has run). On any other device: ``make()``, no CUDA call."""
    device = torch.device(device)
    if device.type != "cuda":
        return make()
    default = torch.cuda.default_stream(device)
    caller = torch.cuda.current_stream(device)
    with torch.cuda.stream(default):
        tensor = make()
    default.synchronize()
    if caller != default:
        tensor.record_stream(caller)
    return tensor
