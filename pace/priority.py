"""The CPU priority of the rollout's processes (`rollout.engine_nice`): on a CPU the trainer keeps its core.

On a CPU run the trainer and the rollout share the cores. The rollout's processes (child engine
cores, servers this run starts, the stream reader, grading workers) run ``engine_nice`` lower than
the trainer: while the trainer computes it gets a core whenever it asks, and the rollout gets every
cycle it leaves (a synchronous run's generation phase still has both cores). Unlike core pinning
nothing idles: measured in docs/benchmarks.md "Process layouts on 2 cores".

`configure_environment` (pace/rollout/engine.py) puts the value in the environment
(``PACE_ENGINE_NICE``), which every process rank 0 starts inherits; each such process lowers itself
as it starts (`lower`). A child engine core, which vLLM spawns, inherits the priority of the thread
that starts it: `build_engine` starts it from a thread of its own lowered first (`lower_thread`), so
the client threads vLLM starts beside it in rank 0 (its output reader) run lowered too. Raising a
priority back needs privileges a user lacks: nothing here lowers the calling thread of the trainer.
"""
from __future__ import annotations

import os

ENV = "PACE_ENGINE_NICE"


def niceness() -> int:
    """The niceness the rollout's processes add (0: none)."""
    return int(os.environ.get(ENV, "0") or 0)


def lower() -> None:
    """This process (and whatever it starts from here on) ``niceness()`` lower."""
    if niceness() > 0:
        os.nice(niceness())


def lower_thread() -> None:
    """The calling thread (and the threads and processes it starts from here on) ``niceness()`` lower:
    Linux keeps a priority per thread. Call it only on a thread of the rollout's own."""
    if niceness() > 0:
        import threading

        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness())
