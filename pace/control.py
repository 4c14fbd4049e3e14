"""Decisions and barriers that wait on rank 0's long work, over a process group of their own.

Rank 0 alone builds the engines, fills the first batch, downloads a hub model and writes the pool
side of a checkpoint, and holds a weight update (nccl, gloo, ipc) while an in-training validation
runs; the other ranks wait meanwhile. Waiting in a collective of the trainer's process group (NCCL on GPUs) puts
them under its watchdog, 10 minutes by default: longer work on rank 0 kills them. These waits go
over a gloo group with a timeout of their own (`trainer.control_timeout_s`), while the trainer's
collectives (all-gathers, reduce-scatters) keep the process group's (`trainer.dist_timeout_s`).
"""
from __future__ import annotations

import contextlib
import datetime


class Control:
    def __init__(self, accelerator, timeout_s: float):
        self.main = accelerator.is_main_process
        self.group = None
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            # a collective: every rank creates it, at the same point of start-up
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def decide(self, flag):
        """Rank 0's value of ``flag`` on every rank (stop or go, taken together)."""
        if self.group is None:
            return flag
        import torch.distributed as dist

        box = [flag]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value) -> list:
        """Every rank's ``value``, in rank order, on every rank (each node's finding, taken together)."""
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out = [None] * dist.get_world_size(group=self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (a download, the tiny model's build), the others after it."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()
