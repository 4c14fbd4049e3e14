"""conf/config.yaml's run directories through `${pace.rank0_dir:…}` (pace/rundir.py): rank 0's as
configured; a rank ≥ 1's Hydra output in a temporary directory of its own, gone when it exits.
The run directory every rank writes into is rank 0's, sent at start-up: tests/integration/
test_multiprocess.py starts rank 1 two seconds late and finds one run directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK",
             "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


SHOW = """
from omegaconf import OmegaConf
from hydra.core.utils import setup_globals
from pace import rundir
setup_globals(); rundir.register()
hydra = OmegaConf.load("conf/config.yaml").hydra
hydra.job = {"num": 0, "override_dirname": "x"}
cfg = OmegaConf.create({"exp_name": "e", "hydra": hydra})
import os
for d in (cfg.hydra.run.dir, cfg.hydra.sweep.dir, cfg.hydra.sweep.dir):
    print(d, os.path.isdir(d))
"""


def _dirs(rank: str | None) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS} | ({"RANK": rank, "WORLD_SIZE": "2"} if rank else {})
    out = subprocess.run([sys.executable, "-c", SHOW], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [line.split() for line in out.stdout.splitlines()]


def test_rank_0_names_the_run_directory_by_exp_name_and_time():
    for rank in (None, "0"):
        (run, made), (sweep, _), _ = _dirs(rank)
        assert run.startswith("runs/e/20") and sweep.startswith("runs/multirun/e/20") and made == "False"


def test_other_ranks_put_hydras_output_in_one_temporary_directory_removed_at_exit():
    (run, made), (sweep, _), (again, _) = _dirs("1")
    assert run == sweep == again and made == "True" and "runs/" not in run
    assert Path(run).name.startswith("pace-rank1-") and not Path(run).exists()


def _launched(monkeypatch, **env):
    for name in RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_the_rank_is_read_from_the_variables_accelerate_reads(monkeypatch):
    """mpirun (Open MPI, MPICH/Intel MPI, MVAPICH) sets no RANK: its own variables name the rank and
    the world size, in accelerate's order (accelerate/utils/environment.py)."""
    from pace import rundir

    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE"), ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")):
        _launched(monkeypatch, **{rank_var: "3", size_var: "4"})
        assert (rundir.rank(), rundir.world_size()) == (3, 4), rank_var
        assert rundir.rank0_dir("runs/e/t") != "runs/e/t", rank_var
    _launched(monkeypatch)
    assert (rundir.rank(), rundir.world_size()) == (0, 1)


def test_a_single_process_with_a_stray_rank_keeps_its_run_directory(monkeypatch):
    """A RANK left in the environment of a one-process run (no world size above 1) is not a rank ≥ 1:
    its Hydra output stays in the run directory rather than a temporary one removed at exit."""
    from pace import rundir

    for env in ({"RANK": "2"}, {"RANK": "2", "WORLD_SIZE": "1"}, {"OMPI_COMM_WORLD_RANK": "1"}):
        _launched(monkeypatch, **env)
        assert rundir.rank0_dir("runs/e/t") == "runs/e/t", env
