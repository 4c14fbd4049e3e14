"""One DAPO step on a fixed batch, run under `accelerate launch --cpu --num_processes N` by test_multiprocess.py.

Prints the rank-0 metrics as JSON: loss and pre-clip gradient norm must not depend on N (the loss is
normalised by the token count of the whole mini-batch across ranks).
"""
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pace.algo.trainer import DAPOTrainer  # noqa: E402
from pace.config import Config  # noqa: E402
from pace.records import Batch, Group, Trajectory  # noqa: E402


def main(model_path: str) -> None:
    cfg = OmegaConf.structured(Config)
    cfg.trainer.micro_batch_size = 2
    acc = Accelerator(cpu=True)
    trainer = DAPOTrainer(model_path, cfg, acc)
    gen = torch.Generator().manual_seed(0)
    groups = []
    for g in range(2):
        trajs = []
        for i in range(4):
            n = 5 + 3 * i + g  # different lengths: token-level normalisation matters
            resp = torch.randint(3, 60, (n,), generator=gen).tolist()
            lp = (-torch.rand(n, generator=gen) * 3).tolist()
            trajs.append(Trajectory(resp, lp, [0] * n, 0, "stop", advantage=[1.5, -0.5, 0.5, -1.5][i]))
        groups.append(Group(g, f"p{g}", torch.randint(3, 60, (6,), generator=gen).tolist(), "0", 0, trajs))
    metrics = trainer.step(Batch(step=0, groups=groups) if acc.is_main_process else None)
    if acc.is_main_process:
        print("METRICS " + json.dumps(metrics))


if __name__ == "__main__":
    main(sys.argv[1])
