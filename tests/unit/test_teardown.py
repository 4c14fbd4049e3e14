"""pace/teardown.py: a program ended by `end_processes` exits with its status after Python's own
exit steps, without the interpreter's finalisation (what lets a gloo worker thread abort it; the
two-process case is test_multiprocess.py's)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.unit

PROGRAM = textwrap.dedent("""
    import atexit, ctypes, os, sys, threading, time
    sys.path.insert(0, {root!r})
    from pace.teardown import end_processes

    class Finalised:
        def __init__(self):
            self.write = os.write
        def __del__(self):  # runs only if the interpreter finalises
            self.write(1, b"FINALISED\\n")

    keep = Finalised()
    atexit.register(lambda: print("ATEXIT"))
    threading.Thread(target=lambda: (time.sleep(0.3), print("THREAD DONE"))).start()  # not a daemon
    sys.stdout.write("BUFFERED ")  # a pipe: held in Python's buffer
    ctypes.CDLL(None).printf(b"C-BUFFERED ")  # held in C's stdio buffer
    end_processes(3)
    print("AFTER")
""")


def test_end_processes_exits_with_its_status_after_the_exit_steps_and_without_finalising():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as outside torchrun's `-u`
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(root=str(ROOT))], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 3, proc.stderr
    out = proc.stdout
    assert "THREAD DONE" in out and "ATEXIT" in out, out  # non-daemon threads joined, then the atexit handlers
    assert out.index("THREAD DONE") < out.index("ATEXIT"), out  # in the interpreter's order
    assert "BUFFERED" in out and "C-BUFFERED" in out, out  # nothing left in a buffer
    assert "FINALISED" not in out and "AFTER" not in out, out  # os._exit: no finalisation, nothing after it
