"""Two DAPO steps on a fixed batch, run under `torchrun --nproc_per_node N` by test_multiprocess.py.

Prints, from rank 0, the number of processes Accelerate sees and each step's metrics as JSON: loss,
pre-clip gradient norm and learning rate must not depend on N (the loss is normalised by the token
count of the whole mini-batch across ranks; the LR schedule steps once per update).
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
    cfg.trainer.mini_batches = 2
    cfg.trainer.warmup_steps = 3  # the LR still rises over the two steps
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
    if acc.is_main_process:
        print(f"PROCESSES {acc.num_processes} {torch.distributed.get_world_size() if acc.num_processes > 1 else 1}")
    for step in range(2):
        metrics = trainer.step(Batch(step=step, groups=groups) if acc.is_main_process else None)
        if acc.is_main_process:
            print("METRICS " + json.dumps(metrics))


if __name__ == "__main__":
    main(sys.argv[1])
    if torch.distributed.is_initialized():  # gloo's threads must stop before the interpreter does (else SIGABRT at exit)
        torch.distributed.destroy_process_group()
