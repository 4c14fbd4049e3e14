"""pace/spawning.py: the grading worker and the stream reader do not run the main script (train.py's
imports) again; a plain spawned process does."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
with open({marker!r}, "a") as f:  # each run of this script leaves its name
    f.write(__name__ + "\\n")

if __name__ == "__main__":
    import multiprocessing as mp
    import threading
    from concurrent.futures import ProcessPoolExecutor

    from pace.grading_workers import WorkerSlot
    from pace.rollout.streams import StreamReader

    which = sys.argv[1]
    if which == "grader":
        slot, done = WorkerSlot(), threading.Event()
        slot.start(lambda fut: done.set())
        assert done.wait(60) and slot.future.result() > 0
        slot.stop()
    elif which == "streams":
        reader = StreamReader(lambda batch: None, keepalive_s=5.0)
        reader.process.join(0.5)  # it starts and waits for requests
        assert reader.process.is_alive()
        reader._kill()
    else:  # a plain spawned process
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            assert pool.submit(abs, -1).result() == 1
    print(sys.modules["__main__"].__file__)  # restored after the spawn
"""


@pytest.mark.parametrize("which, runs", [("grader", ["__main__"]), ("streams", ["__main__"]),
                                         ("plain", ["__main__", "__mp_main__"])])
def test_a_helper_process_does_not_run_the_main_script_again(tmp_path, which, runs):
    marker, script = tmp_path / "runs.txt", tmp_path / "main.py"
    script.write_text(SCRIPT.format(root=str(ROOT), marker=str(marker)))
    proc = subprocess.run([sys.executable, str(script), which], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(script)
    assert marker.read_text().split() == runs
