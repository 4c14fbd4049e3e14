"""One run directory for every process of a run: rank 0's.

`hydra.run.dir` (`runs/<exp_name>/<time>`) is resolved in each process a launcher starts, and
Hydra's `now` is each process's own clock: ranks whose start-ups straddle a second (often on one
node, always across nodes) would each write their checkpoint shards into a directory of their own.
So a run's directory is rank 0's on every rank (train.py broadcasts it over the control group
before anything is written), and ranks ≥ 1 leave Hydra's own output (`.hydra/`, `train.log`,
its sweep folder) in a temporary directory removed when the process exits: `${pace.rank0_dir:…}`
in conf/config.yaml. Their log records still reach the console, which the launcher keeps.
A directory given on the command line (`hydra.run.dir=…`, `hydra.sweep.dir=…`) replaces that
resolver: rank 0 uses it as written, and on ranks ≥ 1 train.py points it at the same temporary
directory before Hydra reads it (`own_argv`), so no rank ≥ 1 makes a directory of its own there
(with a `${now:…}` in it, each would name its own).

The rank and world size are read as Accelerate reads them (`get_cpu_distributed_information` in
accelerate/utils/environment.py): torchrun and `accelerate launch` set RANK and WORLD_SIZE, mpirun
its own (Open MPI's OMPI_COMM_WORLD_*, MPICH's PMI_*, MVAPICH's MV2_COMM_WORLD_*). Only a process
of a world above one is redirected: a one-process run with a stray RANK keeps its run directory.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

RESOLVER = "pace.rank0_dir"
DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir")  # where Hydra writes its output (run; multirun)
_scratch: str | None = None


_RANK = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_WORLD_SIZE = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def rank() -> int:
    """This process's rank as the launcher set it (torchrun, `accelerate launch`, mpirun); 0 without one."""
    from accelerate.utils import get_int_from_env

    return get_int_from_env(_RANK, 0)


def world_size() -> int:
    """The number of processes the launcher started; 1 without one."""
    from accelerate.utils import get_int_from_env

    return get_int_from_env(_WORLD_SIZE, 1)


def _redirected() -> bool:
    """A rank ≥ 1 of a world above one: its Hydra output goes to a temporary directory."""
    return rank() != 0 and world_size() > 1


def _scratch_dir() -> str:
    """This process's temporary directory for Hydra's output (one per process), removed at exit."""
    global _scratch
    if _scratch is None:
        _scratch = tempfile.mkdtemp(prefix=f"pace-rank{rank()}-hydra-")
        atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
    return _scratch


def rank0_dir(path: str) -> str:
    """``path`` on rank 0 or in a one-process world; on ranks ≥ 1 one temporary directory per
    process, removed at exit."""
    return _scratch_dir() if _redirected() else path


def own_argv(argv: list[str]) -> list[str]:
    """The command line Hydra reads in this process (``argv`` without the program): as given on
    rank 0 and in a one-process world; on ranks ≥ 1 each `hydra.run.dir=` / `hydra.sweep.dir=`
    (also `+`/`++`) set to this process's temporary directory, in place (Hydra's overrides are one
    run of arguments). The configured default needs nothing: it resolves there already."""
    if not _redirected():
        return list(argv)
    out = []
    for arg in argv:
        key, sep, _ = arg.partition("=")
        out.append(f"{key}={_scratch_dir()}" if sep and key.lstrip("+") in DIR_KEYS else arg)
    return out


def register() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, rank0_dir)

