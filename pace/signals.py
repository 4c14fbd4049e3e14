"""The run's stop signals: the run's own handler (`StopSignal`), and child processes that leave
them to the run.

A preemption signals every process: torchrun sends SIGTERM to each rank's process group (the rank
and every process it started), Slurm to every process of the job step. vLLM's engine core and
workers act on SIGTERM/SIGINT by shutting down at once, and the grading workers die on them, so a
stop lost its engines before the run could checkpoint, and a rollout thread waiting on a dead
engine could hold the stop until the launcher's SIGKILL.

`deafen_children()` (rank 0, before it starts its engines and graders) makes every process the run
starts from then on ignore SIGTERM and SIGINT, including the handlers vLLM installs for them: the
run stops those processes itself after its checkpoint (vLLM's shutdown kills what ignores its
terminate; pace/rollout/fleet.py). CPython resets the signal mask of every child, so ignoring is
done in the child, as early as it runs Python: forked children by an `os.register_at_fork` hook,
spawned ones (multiprocessing's spawn and forkserver, any Python subprocess) by the
`sitecustomize` of pace/_deaf, put first on their PYTHONPATH; both act only under the environment
flag the run sets. The run's own process keeps its handlers (`StopSignal`). A child of a run
that was itself killed is ended with `kill -9`.
"""
from __future__ import annotations

import os
import signal
import sys
import time

FLAG = "PACE_DEAF_CHILD"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_deaf")


def deafen_children() -> None:
    """From now on, every child process (and theirs) ignores SIGTERM and SIGINT."""
    if os.environ.get(FLAG) == "1":
        return
    os.environ[FLAG] = "1"
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = SITE_DIR if not path else SITE_DIR + os.pathsep + path
    os.register_at_fork(after_in_child=_after_fork)


def _after_fork() -> None:
    if os.environ.get(FLAG) == "1":
        deafen_this_process()


def deafen_this_process() -> None:
    """Ignore SIGTERM and SIGINT here, and keep ignoring them when a handler is installed later."""
    install = getattr(signal.signal, "pace_original", signal.signal)

    def signal_(signum, handler):
        return install(signum, signal.SIG_IGN if signum in STOP_SIGNALS else handler)

    signal_.pace_original = install
    try:
        for signum in STOP_SIGNALS:
            install(signum, signal.SIG_IGN)
    except ValueError:  # not the main thread of a forked child: it runs no vLLM main loop
        return
    signal.signal = signal_


class StopSignal:
    """SIGTERM (preemption, `kill`) or SIGINT (Ctrl-C): the first lets the step in progress finish,
    then the run checkpoints and exits with 128 + the signal number; a second, `REPEAT_S` or more
    later, stops at once, without a checkpoint. Sooner it is the same stop arriving twice: a cluster
    signals every process and torchrun forwards what it got to each rank's process group."""

    REPEAT_S = 3.0

    def __init__(self):
        self.signum: int | None = None
        self._at = 0.0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:
            if time.monotonic() - self._at < self.REPEAT_S:
                return
            raise KeyboardInterrupt
        self.signum, self._at = signum, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: stopping after the step in progress, then checkpointing "
              "(send it again to stop at once, without a checkpoint)", file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        return self.signum is not None
