"""A run directory given on the command line under a multi-process launcher (pace/rundir.py): rank 0
makes it as written, a rank ≥ 1 makes nothing there, whether the directory names its own `${now:…}`
(run) or is a multirun's sweep directory. train.py runs as the launcher starts rank 1 and rank 0
(RANK / WORLD_SIZE) and stops at its device check (`device=cuda` on this CPU machine: exit 2), after
Hydra has made its output directory and before any process group is joined."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK",
             "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def _start(rank: int, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS} | {"RANK": str(rank), "WORLD_SIZE": "2",
                                                                         "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "device=cuda", "logger.progress=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA GPU is available here" in proc.stderr, proc.stderr[-2000:]
    return proc


def _made(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_rank_above_0_makes_nothing_in_a_run_directory_given_on_the_command_line(tmp_path):
    given = f"hydra.run.dir={tmp_path}/runs/${{now:%H-%M-%S-%f}}"  # each process's own clock
    _start(1, given)
    assert _made(tmp_path) == []  # before: runs/<rank 1's time>/{.hydra/…, train.log}
    _start(1, "-m", f"hydra.sweep.dir={tmp_path}/sweep", "seed=1")
    assert _made(tmp_path) == []  # before: sweep/{multirun.yaml, 0_…/{.hydra/…, train.log}}
    _start(0, given)  # rank 0 keeps it as written
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / ".hydra" / "config.yaml").is_file()
