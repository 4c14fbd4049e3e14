"""conf/config.yaml's run directories through `${pace.rank0_dir:…}` (pace/rundir.py): rank 0's as
configured; a rank ≥ 1's Hydra output in a temporary directory of its own, gone when it exits.
The run directory every rank writes into is rank 0's, sent at start-up: tests/integration/
test_multiprocess.py starts rank 1 two seconds late and finds one run directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

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
    env = {k: v for k, v in os.environ.items() if k != "RANK"} | ({"RANK": rank} if rank else {})
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
