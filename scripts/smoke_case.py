"""One case of scripts/gpu_smoke.py, in its own process (`gpu_smoke.py --case fsdp|pure|moe`), as
train.py runs its trainer: the accelerator train.py would build (the yaml's FSDP2 plugin; on CPU set on
Accelerate's state over a gloo group of one), `DAPOTrainer` with the preset's settings, then the
case's measurements, each printed as one `SMOKE {json}` line for the parent to check:

    setup        FSDP2, mixed precision, the shards' and the compute dtypes, the wrapped units
    source       the weight sync's view of the weights against the checkpoint (not in ``pure``)
    step         one DAPO step: finite, how much of the weights moved, time, peak memory
    agreement    chunked vs full-vocabulary log-probs on a row of its own (``fsdp``)
    m2po, proximal   a step of each loss variant (``fsdp``)
    checkpoint   SHARDED_STATE_DICT save, a step, load: bit-exact weights and AdamW (``fsdp``)
    memory       the case's peak: predicted (smoke_setup.predicted_peak) and, on a GPU, measured

Its helpers (the accelerator, a random batch, a timed step, the engine's view) are also
scripts/bench_trainer_gpu.py's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from smoke_setup import (AGREE_LENGTHS, LENGTHS, PEAK_LIMIT_GIB, PRESETS, TINY_AGREE_LENGTHS, TINY_LENGTHS,
                         fsdp_plugin, predicted_peak, trainer_config)


def emit(case: str, what: str, **values) -> None:
    print("SMOKE " + json.dumps({"case": case, "what": what, **values}), flush=True)


def accelerator(case: str, model_dtype: str, tiny: bool):
    """train.py's mixed precision on a GPU (pace.algo.precision: bf16 for a bf16 model, whatever the
    launcher says); "no" for the pure case. On CPU, the yaml's FSDP2 plugin set on Accelerate's state."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType

    from pace.algo.precision import mixed_precision

    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")  # the launcher's (the yaml's bf16; "no": pure); unset on CPU
    mixed = "no" if case == "pure" else mixed_precision("cuda", model_dtype, launcher)
    if not tiny:  # under accelerate launch: the yaml's FSDP2 plugin
        return Accelerator(step_scheduler_with_optimizer=False, mixed_precision=mixed)
    acc = Accelerator(cpu=True, step_scheduler_with_optimizer=False, mixed_precision=mixed)
    plugin = fsdp_plugin()
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return acc


def batch_of(trainer, prompt: int, response: int, vocab: int, seed: int = 1, rows: int = 1):
    """One group of ``rows`` random sequences (one prompt); behaviour log-probs = the current
    policy's (ratio 1)."""
    import numpy as np
    import torch

    from pace.records import Batch, Group, Trajectory

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (prompt + rows * response,), generator=gen).tolist()
    trajs = [Trajectory(ids[prompt + i * response : prompt + (i + 1) * response], [0.0] * response, [0] * response, 0,
                        "stop", advantage=1.0) for i in range(rows)]
    pairs = [(ids[:prompt], traj) for traj in trajs]
    for _, _, logp in trainer._score([pairs]):
        for traj, part in zip(trajs, np.split(logp.float().cpu().numpy(), rows)):
            traj.logprobs[:] = part
    return Batch(step=0, groups=[Group(0, "smoke", ids[:prompt], "", 0, trajs)])


def local_shards(model) -> dict:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().to("cpu", copy=True) for n, p in model.named_parameters()
            if p.dtype.is_floating_point}


def moved(before: dict, model) -> tuple[float, float]:
    """Fractions of the elements that differ from ``before``: of the decoder layers', and of all."""
    counts = {"layers": [0, 0], "all": [0, 0]}
    for n, p in model.named_parameters():
        if n not in before:
            continue
        now = (p.to_local() if hasattr(p, "to_local") else p).detach().cpu()
        changed = int((now != before[n]).sum())
        for key in ("layers", "all") if ".layers." in n else ("all",):
            counts[key][0] += changed
            counts[key][1] += now.numel()
    return tuple(c / max(t, 1) for c, t in counts.values())


def record_routes(trainer, batch, noise: float = 0.2, seed: int = 3) -> dict:
    """The engine's side of routing replay, stood in for: a no-grad forward of each sequence whose
    routers route to the top-k of their logits perturbed by Gaussian noise (``noise`` × the logits'
    std), with the gate weights of those experts from the unperturbed logits (as the replay
    computes them), so that a share of the tokens is routed otherwise than the trainer's own router
    would route it. Its routes are stored on the trajectories as vLLM returns them (every position
    but the last: `Trajectory.add_routes`) and its log-probs become ℓ^μ. Returns the share of
    (position scoring a response token, layer) pairs it routed otherwise ("planted_share")."""
    import numpy as np
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    gen = torch.Generator().manual_seed(seed)
    routes, differ = {}, {}

    def perturbed(layer):
        def hook(module, args, output):
            logits, _, live = output
            noisy = logits.float() + noise * logits.float().std() * torch.randn(logits.shape, generator=gen).to(logits.device)
            idx = noisy.topk(module.top_k, dim=-1).indices
            weights = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            routes[layer] = idx.cpu()
            differ[layer] = (idx.sort(-1).values != live.sort(-1).values).any(-1).cpu()
            return logits, weights.to(logits.dtype), idx

        return hook

    unwrapped = trainer.acc.unwrap_model(trainer.model)
    handles = [m.register_forward_hook(perturbed(int(name.split("layers.")[1].split(".")[0])))
               for name, m in unwrapped.named_modules() if isinstance(m, Qwen3MoeTopKRouter)]
    n_layers = unwrapped.config.num_hidden_layers
    planted = []
    trainer.model.eval()
    try:
        for group in batch.groups:
            for traj in group.trajectories:
                b = trainer._collate([(group.prompt_ids, traj)])  # one sequence: rows = its positions
                with torch.no_grad():
                    logp, _ = trainer._logprobs(b)  # outside the trainer's replay: the hooks above route
                n_p, n = len(group.prompt_ids), len(group.prompt_ids) + len(traj)
                rows = torch.stack([routes[i] for i in range(n_layers)], 1).numpy().astype(np.uint8)
                traj.add_routes(rows[: n - 1], 0, n_p)
                traj.logprobs[:] = logp.float().cpu().numpy()
                planted.append(torch.stack([differ[i][n_p - 1 : n - 1] for i in range(n_layers)]))  # [layers, tokens]
    finally:
        trainer.model.train()
        for handle in handles:
            handle.remove()
    return {"planted_share": float(torch.cat(planted, 1).float().mean(1).mean())}  # per layer, then their mean


PEAKS: list[float] = []  # this case's measured peaks (GiB): every step's, the agreement check's


def timed_step(trainer, batch, cuda: bool) -> dict:
    import math

    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    stats = trainer.step(batch)
    if cuda:
        torch.cuda.synchronize()
    out = {"loss": stats["train/loss"], "grad_norm": stats["train/grad_norm"], "seconds": time.perf_counter() - t0,
           "finite": math.isfinite(stats["train/loss"]) and math.isfinite(stats["train/grad_norm"])
           and stats["train/nonfinite_skipped"] == 0}
    for key in ("moe/route_diff_share", "moe/replayed_share", "mismatch/abs_logp_diff"):  # routing replay (the moe case)
        if key in stats:
            out[key.split("/")[1]] = stats[key]
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if "m2po/m2" in stats:
        out["m2"] = stats["m2po/m2"]
    return out


def engine_view(trainer, model_path: str, cuda: bool) -> dict:
    """The weight sync's tensors (pace/weights/source.py: cast to bf16, gathered) against the files:
    the values of a "source" record."""
    import torch
    from safetensors import safe_open

    from pace.weights import source

    files = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        handle = safe_open(str(f), "pt")
        files.update({k: (handle, k) for k in handle.keys()})
    t0, nbytes, names_ok, bits_ok, fused, n = time.perf_counter(), 0, True, True, 0, 0
    for name, p in source.named_parameters(trainer.model):
        full = source.engine_tensor(p, torch.bfloat16)
        if cuda:
            torch.cuda.synchronize()
        nbytes, n = nbytes + full.numel() * full.element_size(), n + 1
        if name in files:
            ref = files[name][0].get_tensor(name)
            names_ok &= tuple(ref.shape) == tuple(full.shape)
            bits_ok &= names_ok and torch.equal(ref, full.cpu())
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # transformers 5's fused experts
            fused += 1
            stem, kind = name.rsplit(".", 1)
            for e in range(full.shape[0]):
                parts = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
                keys = [f"{stem}.{e}.{part}.weight" for part in parts]
                names_ok &= all(k in files for k in keys)
                if names_ok:
                    ref = torch.cat([files[k][0].get_tensor(k) for k in keys])
                    bits_ok &= tuple(ref.shape) == tuple(full[e].shape) and torch.equal(ref, full[e].cpu())
        else:
            names_ok = False
    return dict(tensors=n, fused=fused, names_equal=bool(names_ok), bits_equal=bool(bits_ok),
                gib=nbytes / 2**30, seconds=time.perf_counter() - t0)


def child(args) -> None:
    """One case, then its peak memory: predicted (pace.algo.memory_budget) and, on a GPU, measured."""
    run_case(args)
    emit(args.case, "memory", predicted=predicted_peak(args.case, args.layers, args.tiny),
         measured_gib=max(PEAKS) if PEAKS else None, limit_gib=PEAK_LIMIT_GIB)


def run_case(args) -> None:
    import torch

    from pace.algo.loss import build_loss
    from pace.algo.trainer import DAPOTrainer

    case, cuda = args.case, not args.tiny
    cfg = trainer_config(PRESETS[case], args.model, args.tiny)
    acc = accelerator(case, cfg.model.dtype, args.tiny)
    trainer = DAPOTrainer(args.model, cfg, acc)
    model = trainer.model
    seen = {}
    first = acc.unwrap_model(model).get_decoder().layers[0].self_attn.q_proj
    hook = first.register_forward_hook(lambda m, i, o: seen.update(compute=str(o.dtype)))  # returns None: output kept
    units = sorted({type(m).__name__.removeprefix("FSDP") for m in model.modules() if type(m).__name__.startswith("FSDP")})
    vocab = acc.unwrap_model(model).config.vocab_size
    prompt, response = (TINY_LENGTHS if args.tiny else LENGTHS)[case]

    # read before any forward: FSDP2 leaves the root module's parameters (final norm, head) unsharded
    # in the compute dtype from a forward until the backward, so a no-grad pass shows them as bf16
    shards = sorted({str(p.dtype) for p in model.parameters()})
    sharded = sorted({type(p).__name__ for p in model.parameters()})
    before = local_shards(model)
    tracker = None
    if case != "pure":  # the delta sync's baseline (pace/weights/delta.py): the bf16 cast of θ_0 on the host
        from pace.weights.delta import DeltaTracker

        tracker = DeltaTracker(model, torch.bfloat16, full_every=0, max_frac=1.0, fingerprints=False)
        tracker.sent(tracker.plan(0))
    if case != "pure":
        emit(case, "source", **engine_view(trainer, args.model, cuda))
    batch = batch_of(trainer, prompt, response, vocab)  # its no-grad forward runs q_proj once
    hook.remove()
    replay = {}
    if trainer.replay is not None:  # the moe case (+exp=pace_qwen3_30b_a3b: algo.routing_replay)
        replay = record_routes(trainer, batch)
    emit(case, "setup", distributed_type=str(acc.distributed_type), fsdp2=acc.is_fsdp2, mixed=acc.mixed_precision,
         units=units, shards=shards, sharded=sharded, compute=seen.get("compute"),
         params_b=sum(p.numel() for p in model.parameters()) / 1e9)
    step = timed_step(trainer, batch, cuda)
    states = sum(p.numel() for p in model.parameters()) * (16 if shards == ["torch.float32"] else 8)  # + grads, 2 moments
    if "peak_gib" in step:
        step["above_states_gib"] = step["peak_gib"] - states / 2**30
    changed_layers, changed_all = moved(before, model)
    emit(case, "step", tokens=prompt + response, shards=shards, changed_layers=changed_layers, changed_all=changed_all,
         **step, **replay)
    del before
    if tracker is not None:  # what a delta sync of this step would send, and what planning it costs
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = tracker.plan(1)
        if cuda:
            torch.cuda.synchronize()
        emit(case, "delta", changed_frac=plan.changed_frac, bytes_ratio=plan.bytes / (plan.total * 2), full=plan.full,
             seconds=time.perf_counter() - t0, host_gib=tracker.held_bytes / 2**30)
        del tracker, plan
    if case != "fsdp":
        return

    # chunked (the trainer's) vs full-vocabulary log-probs, on a shorter row of its own (AGREE_LENGTHS)
    agree = batch_of(trainer, *(TINY_AGREE_LENGTHS if args.tiny else AGREE_LENGTHS), vocab, seed=2)
    pairs = [(g.prompt_ids, t) for g in agree.groups for t in g.trajectories]
    b = trainer._collate(pairs)
    model.eval()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        from pace.algo.logprobs import response_logprobs

        chunked, _ = response_logprobs(model, b, 1.0, cfg.trainer.logprob_chunk, decoder=trainer._decoder, head=trainer._head)
        full, _ = response_logprobs(model, b, 1.0, None)
    model.train()
    if cuda:
        PEAKS.append(torch.cuda.max_memory_allocated() / 2**30)
    diff = (chunked.float() - full.float()).abs()
    emit(case, "agreement", max_abs=float(diff.max()), mean_abs=float(diff.mean()), tokens=int(diff.numel()))
    del chunked, full, diff, b, agree

    for what, changes in (("m2po", {"name": "m2po"}), ("proximal", {"name": "dapo", "ratio_ref": "proximal"})):
        trainer.cfg.algo = dataclasses.replace(cfg.algo, **changes)  # what DAPOTrainer.__init__ derives from cfg.algo
        trainer.loss_fn, trainer.proximal = build_loss(trainer.cfg.algo), trainer.cfg.algo.ratio_ref == "proximal"
        emit(case, what, **timed_step(trainer, batch, cuda))

    ckpt = Path(args.work) / "checkpoint"
    t0 = time.perf_counter()
    trainer.save(ckpt)
    (ckpt / "meta.json").write_text(json.dumps({"trainer": trainer.state_dict()}))
    save_s = time.perf_counter() - t0
    weights = local_shards(model)
    moments = [v.to("cpu", copy=True) for s in trainer.optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    timed_step(trainer, batch, cuda)
    moved_between = moved(weights, model)[0] > 0
    t0 = time.perf_counter()
    trainer.load(ckpt)
    load_s = time.perf_counter() - t0
    after = [v.cpu() for s in trainer.optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    emit(case, "checkpoint", weights_equal=moved(weights, model)[1] == 0.0,
         optimizer_equal=len(after) == len(moments) > 0 and all(torch.equal(a, m) for a, m in zip(after, moments)),
         moved_between=moved_between, save_s=save_s, load_s=load_s,
         dcp=any((ckpt / "pytorch_model_fsdp_0").glob("*.distcp")) and any((ckpt / "optimizer_0").glob("*.distcp")),
         gib=sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30, tensors=len(after))
