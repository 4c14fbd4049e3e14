"""The abort that pace/teardown.py explains, made certain: rank 0's gloo worker thread must take the
GIL to free a collective's tensors while rank 0's interpreter finalises. Run by
test_multiprocess.py under `torchrun --nproc_per_node 2`.

    python teardown_race.py destroy|end_processes

Rank 0 starts an all-gather and lets go of its tensors (the work keeps them, and their Python
objects with them); rank 1 joins it when rank 0 is ready. Rank 0's main thread keeps the GIL from
then on (a switch interval of an hour: the stand-in for a worker thread that waits for a core while
the main thread ends), so its worker thread, done, waits for the GIL to free the tensors. Rank 0
then ends as the multi-process programs did (`destroy`: `destroy_process_group`, the group still
held as FSDP holds it, then the interpreter's exit) or with `pace.teardown.end_processes`.
"""
import atexit
import ctypes
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class SlowExit:
    """Cleared with __main__ once the interpreter is finalising: its sleep hands the GIL on, and the
    worker thread waiting for it is ended there (`pthread_exit` through a noexcept destructor)."""

    def __init__(self):
        self.sleep = time.sleep

    def __del__(self):
        self.sleep(0.5)


def rank_1(ending: str, ready: Path) -> None:
    while not ready.exists():
        time.sleep(0.01)
    outs = [torch.zeros(4) for _ in range(2)]
    dist.all_gather(outs, torch.full((4,), 2.0))
    globals()["kept"] = outs  # kept to the end: rank 1's worker frees no Python object
    print(f"GATHERED {torch.stack(outs)[:, 0].tolist()}", flush=True)
    if ending == "destroy":
        dist.destroy_process_group()
        return
    from pace.teardown import end_processes

    end_processes(0, barrier=dist.barrier)


def rank_0(ending: str, ready: Path) -> None:
    globals()["group"] = dist.group.WORLD  # held to the end, as an FSDP module or a device mesh holds it
    outs = [torch.zeros(4) for _ in range(2)]
    peer = ctypes.c_float.from_address(outs[1].data_ptr())  # rank 1's part, read without the tensor
    work = dist.all_gather(outs, torch.full((4,), 1.0), async_op=True)
    del outs, work  # the worker thread holds the only references now
    if ending == "destroy":
        globals()["slow_exit"] = SlowExit()
        dist.destroy_process_group()  # the group and its worker threads live on
        threading._shutdown()  # the exit's steps that run Python code, now: none hands the GIL on later
        atexit._run_exitfuncs()
    ready.touch()
    sys.setswitchinterval(3600)  # from here on the main thread keeps the GIL while it runs
    t0 = time.monotonic()
    while peer.value != 2.0 and time.monotonic() - t0 < 60:  # rank 1's part arrived
        pass
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # the worker marks the work done and waits for the GIL to free it
        pass
    if ending == "destroy":
        return  # the interpreter's exit
    from pace.teardown import end_processes

    end_processes(0, barrier=dist.barrier)


if __name__ == "__main__":
    from accelerate import PartialState

    state = PartialState(cpu=True)  # the process group as the programs set it up (gloo, from torchrun's env)
    print(f"STARTED rank {state.process_index} of {state.num_processes}", flush=True)
    (rank_0 if state.process_index == 0 else rank_1)(sys.argv[1], Path(os.environ["TEARDOWN_READY"]))
