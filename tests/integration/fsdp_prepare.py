"""Accelerate's FSDP2 preparation with the plugin of conf/accelerate/fsdp.yaml on CPU (gloo), on a
tiny random model of a preset's architecture: dense Qwen3 or the Qwen3-MoE of the 30B-A3B presets.
Run by test_multiprocess.py under `torchrun --nproc_per_node 2`.

`Accelerator.prepare` selects FSDP only on accelerators (Accelerate 1.15 keeps `MULTI_CPU` for a
CPU run, with DDP), so the model goes through the function `prepare` calls for FSDP2,
`accelerate.utils.fsdp_utils.fsdp2_prepare_model`, with the yaml's plugin: the auto-wrap policy
(where `Qwen3DecoderLayer` failed on the MoE model) and `fully_shard` of each unit are Accelerate's
and torch's own. Prints, from rank 0, the number of processes and the classes sharded as units.
"""
import json
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def tiny_config(arch: str):
    from transformers import Qwen3Config, Qwen3MoeConfig

    # vocab 127 (odd): the embedding's rows split unevenly over 2 ranks (a delta sync's shard offsets)
    common = dict(vocab_size=127, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    if arch == "moe":  # Qwen3-30B-A3B's layout: every layer sparse, 128 experts top-8 → 8 experts top-2
        return Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              decoder_sparse_step=1, norm_topk_prob=True)
    return Qwen3Config(**common)


def plugin_from_yaml(path: Path):
    from scripts.smoke_setup import fsdp_plugin

    if yaml.safe_load(path.read_text())["fsdp_config"].get("fsdp_offload_params", False):
        raise SystemExit("offload_params in the yaml: not what the presets use")
    return fsdp_plugin(path)


def main(arch: str) -> None:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    plugin = plugin_from_yaml(ROOT / "conf/accelerate/fsdp.yaml")
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    acc = Accelerator(cpu=True)
    acc.state.fsdp_plugin = plugin
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}  # as the checkpoint (and the engine) names them
    model = fsdp2_prepare_model(acc, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # FSDP2's fully_shard swaps each wrapped module's class for a subclass named FSDP<class>
    units = sorted({type(m).__name__.removeprefix("FSDP") for m in model.modules() if type(m).__name__.startswith("FSDP")})
    # the delta sync's baseline (pace/weights/delta.py: each rank its shard's bf16 cast)
    from pace.weights.delta import DeltaTracker

    tracker = DeltaTracker(model, torch.bfloat16, full_every=0, max_frac=1.0)
    before = whole_casts(model)
    tracker.sent(tracker.plan(1), {n: tensor_fingerprint(t) for n, t in before.items()})
    # one forward/backward and a full-state gather of one parameter, as the weight sync does
    ids = torch.randint(0, 127, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    delta = delta_check(tracker.plan(2), before, whole_casts(model))
    name, p = next(iter(model.named_parameters()))
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    # the weight sync's source over the sharded model: every parameter, full shape, engine dtype
    from pace.weights.transfer import CastSource

    sent = {n: (tuple(t.shape), str(t.dtype), type(t).__name__) for n, t in CastSource(model, torch.bfloat16)}
    source_ok = sent == {n: (shape, "torch.bfloat16", "Tensor") for n, shape in names.items()}
    if acc.is_main_process:
        print("PREPARED " + json.dumps({"processes": acc.num_processes, "state_dict_type": str(plugin.state_dict_type),
                                        "units": units, "loss": float(loss), "first": [name, list(full.shape)],
                                        "sharded": type(p).__name__, "source_ok": source_ok, "arch": arch,
                                        "delta": delta}))


def whole_casts(model) -> dict:
    """Every parameter whole in bf16 (each `full_tensor()` a collective), by checkpoint name."""
    from pace.weights import source

    return {n: source.engine_tensor(p, torch.bfloat16).clone() for n, p in source.named_parameters(model)}


def tensor_fingerprint(t):
    from pace.weights.fingerprint import tensor_fingerprint as fp

    return fp(t)


def delta_check(plan, before: dict, after: dict) -> dict | None:
    """Rank 0: the delta gathered from both ranks' shards, applied to θ_1's whole casts, gives θ_2's
    bit for bit; it holds exactly the changed elements; its fingerprints (from the change) are θ_2's."""
    if torch.distributed.get_rank() != 0:
        return None
    rebuilt = {n: t.clone() for n, t in before.items()}
    for patch in plan.patches:
        rebuilt[patch.name].view(-1).index_copy_(0, patch.indices.long(), patch.values)
    changed = sum(int((before[n].view(torch.int16) != after[n].view(torch.int16)).sum()) for n in after)
    return {"exact": all(torch.equal(rebuilt[n].view(torch.int16), after[n].view(torch.int16)) for n in after),
            "count": plan.changed == changed == sum(p.indices.numel() for p in plan.patches),
            "prints": plan.prints == {n: tensor_fingerprint(t) for n, t in after.items()},
            "changed": changed, "total": plan.total, "full": plan.full}


def replicated(kind: str) -> None:
    """A delta sync where each rank holds a copy (HSDP: 2 replicas of 1 shard, fully_shard on a 2-D
    mesh; or plain tensors, as without FSDP): each element reported once, not once per replica."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from pace.weights.delta import DeltaTracker

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("dense"), dtype=torch.float32)
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracker = DeltaTracker(model, torch.bfloat16, full_every=0, max_frac=1.0)
    before = whole_casts(model) if kind == "hsdp" else {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    tracker.sent(tracker.plan(1), {n: tensor_fingerprint(t) for n, t in before.items()})
    ids = torch.randint(0, 127, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    for p in model.parameters():  # the same update on both ranks (no DDP here: the copies must agree)
        torch.distributed.all_reduce(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    optimizer.step()
    after = whole_casts(model) if kind == "hsdp" else {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    delta = delta_check(tracker.plan(2), before, after)
    if delta is not None:
        print("REPLICATED " + json.dumps({"kind": kind, **delta}))


if __name__ == "__main__":
    for arch in sys.argv[1:]:  # one launch for several architectures (each prepared on its own)
        replicated(arch) if arch in ("hsdp", "plain") else main(arch)
    from pace.teardown import end_processes

    end_processes(0, barrier=torch.distributed.barrier)  # no interpreter finalisation under gloo's threads
