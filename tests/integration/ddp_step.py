"""Two DAPO steps on a fixed batch, once per layout, run under `torchrun --nproc_per_node N` by
test_multiprocess.py.

    python ddp_step.py MODEL LAYOUT [LAYOUT ...]

Layouts: `count` (2 sequences per micro-batch), `tokens` (a 30-token budget, padded), `packed`
(the budget, packed), and under FSDP2 `fsdp_every` (reduce-scatter after every micro-batch, the
default) and `fsdp_last` (`no_sync` until the last one). The batch has one long response, so the
token-budget plans give ranks different needs and a rank runs an empty (zero-weight) micro-batch.

Prints, from rank 0, the number of processes Accelerate sees, each step's metrics as JSON, and a
checksum of the weights after the steps: loss, pre-clip gradient norm, learning rate and weights
must not depend on N or on the layout (the loss is normalised by the token count of the whole
mini-batch across ranks; the LR schedule steps once per update), nor must the per-engine mismatch
(every rank sums every engine's keys, also those of engines its share has no response of).

FSDP2 on CPU: `Accelerator.prepare` chooses FSDP only on accelerators (Accelerate 1.15 keeps
MULTI_CPU, i.e. DDP, for a CPU run), so the FSDP layouts set the plugin of conf/accelerate/fsdp.yaml
and the distributed type on the accelerator's state before the trainer prepares its model (and again
after: the preparation resets the type on CPU); the sharding, hooks and collectives are torch's own.
"""
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pace.algo.trainer import DAPOTrainer  # noqa: E402
from pace.config import Config  # noqa: E402
from pace.records import Batch, Group, Trajectory  # noqa: E402
from tests.integration.fsdp_prepare import plugin_from_yaml  # noqa: E402

LAYOUTS = {
    "count": {"micro_batch_size": 2},
    "tokens": {"max_tokens_per_micro_batch": 30},
    "packed": {"max_tokens_per_micro_batch": 30, "packing": True},
    "fsdp_every": {"max_tokens_per_micro_batch": 30, "packing": True, "grad_sync": "every"},
    "fsdp_last": {"max_tokens_per_micro_batch": 30, "packing": True, "grad_sync": "last"},
    # M2PO (Algorithm 1): its mask decided over the mini-batch of every rank
    "m2po_count": {"micro_batch_size": 2, "algo.name": "m2po", "algo.m2_threshold": 2.0},
    "m2po_tokens": {"max_tokens_per_micro_batch": 30, "algo.name": "m2po", "algo.m2_threshold": 2.0},
}


def batch() -> list[Group]:
    gen = torch.Generator().manual_seed(0)
    groups = []
    for g in range(2):
        trajs = []
        for i in range(4):
            n = 40 if (g, i) == (1, 3) else 5 + 3 * i + g  # different lengths: token-level normalisation matters
            resp = torch.randint(3, 60, (n,), generator=gen).tolist()
            lp = (-torch.rand(n, generator=gen) * 3).tolist()
            # served by engines 0-2, one by several (-1): ranks get different engines' responses (the
            # mismatch is measured on the first mini-batch, group 0)
            engine = [[0, 1, 2, -1], [1, 0, 1, 2]][g][i]
            trajs.append(Trajectory(resp, lp, [0] * n, 0, "stop", advantage=[1.5, -0.5, 0.5, -1.5][i], engine=engine))
        groups.append(Group(g, f"p{g}", torch.randint(3, 60, (6,), generator=gen).tolist(), "0", 0, trajs))
    return groups


def trainer(model_path: str, layout: str, acc: Accelerator) -> DAPOTrainer:
    cfg = OmegaConf.structured(Config)
    cfg.trainer.mini_batches = 2
    cfg.trainer.warmup_steps = 3  # the LR still rises over the two steps
    for key, value in LAYOUTS[layout].items():
        OmegaConf.update(cfg, key if "." in key else f"trainer.{key}", value)
    fsdp = layout.startswith("fsdp")
    if fsdp:
        acc.state.fsdp_plugin = plugin_from_yaml(ROOT / "conf/accelerate/fsdp.yaml")
        acc.state.distributed_type = DistributedType.FSDP
    torch.manual_seed(0)
    out = DAPOTrainer(model_path, cfg, acc)
    if fsdp:
        acc.state.distributed_type = DistributedType.FSDP
        out.grad_sync_every = cfg.trainer.grad_sync == "every"
        assert type(out.model).__name__.startswith("FSDP") and acc.is_fsdp2
    return out


def checksum(model) -> float:
    """Σ_p Σ w·c over every full parameter (c: a fixed pseudo-random pattern), collective under FSDP."""
    total = 0.0
    for name, p in sorted((n.removeprefix("module."), p) for n, p in model.named_parameters()):  # DDP's prefix
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        c = torch.sin(torch.arange(full.numel(), dtype=torch.float64) * 0.37 + len(name))
        total += float((full.detach().double().reshape(-1) * c).sum())
    return total


def main(model_path: str, layouts: list[str]) -> None:
    acc = Accelerator(cpu=True)
    if acc.is_main_process:
        print(f"PROCESSES {acc.num_processes} {torch.distributed.get_world_size() if acc.num_processes > 1 else 1}")
        from pace.algo import microbatch

        for layout in layouts:  # how many micro-batches of the plans are empty (zero-weight passes)
            o = LAYOUTS[layout]
            plans = [microbatch.plan([len(g.prompt_ids) + len(t) for t in g.trajectories], acc.num_processes,
                                     max_seqs=o.get("micro_batch_size", 64), max_tokens=o.get("max_tokens_per_micro_batch"),
                                     packed=o.get("packing", False)) for g in batch()]
            print("EMPTY " + json.dumps({"layout": layout, "empty": sum(not mb for p in plans for mbs in p for mb in mbs)}))
    for layout in layouts:
        t = trainer(model_path, layout, acc)
        for step in range(2):
            metrics = t.step(Batch(step=step, groups=batch()) if acc.is_main_process else None)
            if acc.is_main_process:
                print("METRICS " + json.dumps({"layout": layout, "step": step, **metrics}))
        total = checksum(t.model)
        if acc.is_main_process:
            print("WEIGHTS " + json.dumps({"layout": layout, "checksum": total}))
        acc.state.distributed_type = DistributedType.MULTI_CPU if acc.num_processes > 1 else DistributedType.NO
        acc._models.clear()  # the next layout's trainer is the accelerator's only model (clip_grad_norm_ looks it up)
        acc._optimizers.clear()
        del t


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["count"])
    from pace.teardown import end_processes

    end_processes(0, barrier=torch.distributed.barrier)  # no interpreter finalisation under gloo's threads
