"""The servers a run starts go with it however it ends (pace/rollout/server.py `Reaper`): a process that
started them and is then SIGKILLed (a launcher's kill at the end of its grace period) leaves none of
their process groups behind; a group killed and forgotten is not killed again (its number may be reused)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

# a "run": starts two stand-in servers (sleepers in sessions of their own, each with a child in its group,
# as a server's engine core), forgets the second after killing it itself, prints the groups and waits
RUN = """
import os, signal, subprocess, sys, time
sys.path.insert(0, {root!r})
from pace.rollout.server import reaper
groups = []
for _ in range(2):
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"],
                         start_new_session=True)
    reaper().watch(p.pid)
    groups.append(p.pid)
os.killpg(groups[1], signal.SIGKILL)
reaper().forget(groups[1])
print(" ".join(map(str, groups)), flush=True)
time.sleep(600)
"""


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_run_leaves_no_server_behind():
    run = subprocess.Popen([sys.executable, "-c", RUN.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True)
    try:
        groups = [int(g) for g in run.stdout.readline().split()]
        time.sleep(0.5)  # the sleepers' children started
        assert _alive(groups[0]) and len(groups) == 2
        run.kill()  # SIGKILL: no finally, no atexit
        run.wait(5)
        deadline = time.monotonic() + 5
        while _alive(groups[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(groups[0])  # the server and its child, with the run
    finally:
        if run.poll() is None:
            run.kill()
        for g in groups if "groups" in locals() else []:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
