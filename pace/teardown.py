"""The end of a multi-process program (torchrun, gloo): every rank at one point, the process group
destroyed, Python's own exit steps, then `os._exit`, never the interpreter's finalisation.

Why. A gloo worker thread frees each collective's work object after it has marked the work
complete, so after the caller's `wait()` has returned. When the work holds tensors whose Python
objects Python has already let go, freeing them takes the GIL. If the main thread, holding the
GIL, goes on into `Py_FinalizeEx` meanwhile, `take_gil` ends the waiting worker with `pthread_exit`,
and that unwind through the work's noexcept destructor calls `std::terminate`: "terminate called
without an active exception", SIGABRT, after the program's results. A barrier does not prevent it
(it waits for earlier works to complete, not to be freed), nor does `destroy_process_group`:
gloo's `shutdown()` does nothing, and the group and its threads live on while any object (an FSDP
module, a device mesh) still holds it. A rank that goes from its last collective straight to the
exit hits it when its worker thread waits for a core: 8 runs in 53 of a two-process FSDP program
on two busy cores.

`os._exit` skips the finalisation, so no thread is made to take the GIL of a dying interpreter.
Before it, what the interpreter's exit does for Python code runs, in its order: the non-daemon
threads joined (`threading._shutdown`, concurrent.futures' executors with them), the `atexit`
handlers (logging's flush, wandb, multiprocessing's children), then the streams flushed, C's too.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
from typing import Callable, NoReturn


def end_processes(code: int = 0, barrier: Callable[[], None] | None = None) -> NoReturn:
    """Ends this rank with exit status ``code``. With ``barrier`` (a collective every rank calls,
    e.g. `torch.distributed.barrier`) no rank leaves before all have arrived: pass it on the
    normal path only, where every rank gets here: a rank that stopped alone would wait out the timeout.
    Runs without torch.distributed too (one process): the same exit."""
    dist = sys.modules.get("torch.distributed")  # never imported: no process group to end
    if dist is not None and dist.is_available() and dist.is_initialized():
        if barrier is not None:
            barrier()
        dist.destroy_process_group()
    threading._shutdown()  # what Py_FinalizeEx runs first: non-daemon threads end as they would
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    ctypes.CDLL(None).fflush(None)  # C stdio buffers (native libraries' output): exit() would flush them
    os._exit(code)
