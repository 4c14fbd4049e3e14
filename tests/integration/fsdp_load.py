"""The trainer's load under FSDP2 as `accelerate launch` with conf/accelerate/fsdp.yaml runs it
(`fsdp_cpu_ram_efficient_loading`: FSDP_CPU_RAM_EFFICIENT_LOADING set by the caller, ACCELERATE_USE_FSDP
here; bf16 mixed precision), on 2 CPU processes over gloo (scripts/smoke_case.py's accelerator: the yaml's
plugin on Accelerate's state). Run by test_multiprocess.py under `torchrun --nproc_per_node 2`
with bf16 checkpoints (a dense one, a MoE one), each in turn.

Two `DAPOTrainer`s of the checkpoint: the trainer's load (pace/algo/model_load.py), and the load
before it (every rank `from_pretrained`, as the trainer did: transformers fills ranks >= 1 with
zeros, `prepare` broadcasts rank 0's weights). For each: the parameters each rank holds when
Accelerate's `fsdp2_prepare_model` starts (devices, bytes not on meta); after `prepare`, whether
every rank's full weights are the checkpoint's upcast to fp32 bit for bit and its buffers a direct
load's; then one DAPO step on the same batch, and the full weights after it. Rank 0 prints one
`LOADED {json}` line a checkpoint.
"""
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main(paths: list[str]) -> None:
    import accelerate.accelerator
    import smoke_case
    from omegaconf import OmegaConf

    from pace.config import Config

    acc = smoke_case.accelerator("fsdp", "bfloat16", tiny=True)  # the yaml's plugin; bf16 mixed precision
    # what `accelerate launch` also sets, read by transformers (`is_fsdp_enabled`): set after the
    # Accelerator, which would otherwise build an FSDP plugin of its own and refuse it on CPU
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    plugin = acc.state.fsdp_plugin
    assert acc.is_fsdp2 and plugin.cpu_ram_efficient_loading and acc.num_processes == 2
    seen = {}
    prepare = accelerate.accelerator.fsdp2_prepare_model

    def recording(accelerator, model):  # what this rank holds as Accelerate's FSDP2 preparation starts
        params = list(model.parameters())
        seen["devices"] = sorted({p.device.type for p in params})
        seen["bytes"] = sum(p.numel() * p.element_size() for p in params if not p.is_meta)
        seen["whole"] = sum(p.numel() * p.element_size() for p in params)
        return prepare(accelerator, model)

    accelerate.accelerator.fsdp2_prepare_model = recording
    cfg = OmegaConf.structured(Config)
    cfg.model.dtype, cfg.trainer.warmup_steps = "bfloat16", 0
    for path in paths:
        load_both(path, acc, cfg, seen)


def load_both(path: str, acc, cfg, seen: dict) -> None:
    import smoke_case
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from pace.algo import model_load
    from pace.algo.trainer import DAPOTrainer

    os.environ.pop("ACCELERATE_USE_FSDP")  # the checkpoint, directly (not transformers' zeros on rank 1)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    vocab = reference.config.vocab_size
    out = {}
    old_load = model_load.load
    for name in ("meta", "before"):
        if name == "before":  # every rank reads the checkpoint, as the trainer did
            model_load.load = lambda p, a, **kw: AutoModelForCausalLM.from_pretrained(p, dtype="auto", **kw)
        acc.state.fsdp_plugin = fresh_plugin(acc)  # the wrapped layer class is the plugin's first model's
        trainer = DAPOTrainer(path, cfg, acc)
        model_load.load = old_load
        model = acc.unwrap_model(trainer.model)
        exact = all([torch.equal(_full(p), reference.get_parameter(n).float()) for n, p in model.named_parameters()])
        buffers = dict(model.named_buffers())
        buffers_ok = all(torch.equal(b, buffers[n]) and b.dtype == buffers[n].dtype for n, b in reference.named_buffers())
        batch = smoke_case.batch_of(trainer, 16, 48, vocab, rows=4)  # every rank: its forward is collective
        metrics = trainer.step(batch if acc.is_main_process else None)
        after = {n: _full(p) for n, p in model.named_parameters()}
        rank = [None] * 2
        dist.all_gather_object(rank, {**seen, "exact": exact, "buffers": buffers_ok})
        out[name] = {"ranks": rank, "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"], "after": after}
        acc.free_memory()  # Accelerate forgets this model: clip_grad_norm_ finds the next one among those it holds
    same = all(torch.equal(out["meta"]["after"][n], out["before"]["after"][n]) for n in out["meta"]["after"])
    if acc.is_main_process:
        runs = {k: {kk: vv for kk, vv in v.items() if kk != "after"} for k, v in out.items()}
        print("LOADED " + json.dumps({"path": path, "same_after_step": same, **runs}), flush=True)


def fresh_plugin(acc):
    """The yaml's FSDP2 plugin with the accelerator's mixed precision (as smoke_case.accelerator)."""
    from smoke_setup import fsdp_plugin

    plugin = fsdp_plugin()
    plugin.set_mixed_precision(acc.mixed_precision)
    return plugin


def _full(p) -> torch.Tensor:
    """The whole parameter (a collective for a sharded one), detached on the CPU."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", copy=True)


if __name__ == "__main__":
    main(sys.argv[1:])
    from pace.teardown import end_processes

    end_processes(0, barrier=torch.distributed.barrier)  # no interpreter finalisation under gloo's threads
