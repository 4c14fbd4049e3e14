"""The trainer side of a paper run, checked on one GPU before a cluster is booked.

    python scripts/gpu_smoke.py            # one H100 or H200, ≤ 8 minutes by estimate (not yet run: README)
    python scripts/gpu_smoke.py --tiny     # CPU, tiny models, ~1 minute (the test suite runs this)

Needs only torch (2.11+), transformers (5.17+) and accelerate: no vLLM, no Hydra, no model hub. It
writes two random models to a work folder, each shaped like a preset's model with fewer layers:
Qwen3-8B's layers, head and vocabulary (`--layers` of its 36) and a 2-layer Qwen3-30B-A3B (128
experts, top 8). Then three cases, each in its own process as `train.py` runs — on a GPU under
`accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 1` (Accelerate's FSDP2
plugin from the yaml, its bf16 mixed precision); on CPU the yaml's plugin is set on Accelerate's state
over a gloo group of one (Accelerate picks FSDP only on accelerators), as tests/integration/fsdp_prepare.py:

- ``fsdp``: the 8B-shaped model with the +exp=pace_qwen3_8b trainer settings (`DAPOTrainer`, as
  train.py builds it): fp32 shards and bf16 compute; the engine's view of the weights (the weight
  sync's cast-and-gather, pace/weights/source.py) against the HF checkpoint, names, shapes and bits,
  and its time; one DAPO step on a 24,576-token sequence (a 22,528-token response): finite loss, the
  weights moved at lr 1e-6, peak memory; chunked vs full log-probs on a 4,096-token row of its own
  (the full path's logits of the 24,576-token row would not fit an H100); an `algo=m2po` and an
  `algo.ratio_ref=proximal` step; `SHARDED_STATE_DICT` save, a step, load: bit-exact weights and AdamW.
- ``pure``: the same step without mixed precision (bf16 weights and AdamW state, what train.py's
  `mixed_precision` prevents on GPUs): the update rounds away on nearly every weight.
- ``moe``: the 30B-A3B-shaped model with +exp=pace_qwen3_30b_a3b's settings: one step, and its
  experts as the engine receives them (transformers 5's fused [E, 2I, H] / [E, H, I], which vLLM's
  FusedMoE loads) equal to the checkpoint's per-expert tensors.

Each case's peak memory is predicted for its shapes by pace/algo/memory_budget.py (`predicted_peak`:
41.9 / 26.5 / 36.9 GiB for fsdp / pure / moe with the default `--layers 4`; tests/unit/
test_memory_budget.py holds them to 74 GiB, what an H100 leaves) and, on a GPU, compared with the
largest `torch.cuda.max_memory_allocated` of the case: a table row each.

Prints one `SMOKE {json}` line per measurement as it goes, then a table of the checks; exit status 1
if any fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FSDP_YAML = ROOT / "conf" / "accelerate" / "fsdp.yaml"

QWEN3_8B = dict(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
                tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
QWEN3_30B_A3B = dict(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40_960,
                     tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1, norm_topk_prob=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# (prompt, response) tokens of the step's sequence: the presets' micro-batch budget, 24,576 tokens
LENGTHS = {"fsdp": (2048, 22_528), "pure": (2048, 22_528), "moe": (1024, 7168)}
TINY_LENGTHS = {"fsdp": (64, 704), "pure": (64, 704), "moe": (32, 224)}
# the chunked = full check's row: the full path's logits of 24,576 tokens would take ~69 GB
# (pace.algo.memory_budget.full_logprobs_bytes), so it runs on a 4,096-token row
AGREE_LENGTHS, TINY_AGREE_LENGTHS = (256, 3840), (32, 224)
PEAK_LIMIT_GIB = 74.0  # an H100's ~78 GiB less the CUDA context, NCCL and the allocator's slack (tested)
PRESETS = {"fsdp": "pace_qwen3_8b", "pure": "pace_qwen3_8b", "moe": "pace_qwen3_30b_a3b"}


# --- the presets' trainer settings, without Hydra -----------------------------------------------
def preset_values(name: str) -> dict:
    """The `model`, `algo` and `trainer` keys `+exp=<name>` sets: its defaults chain of conf/exp/
    files and the `override /model` and `/algo` files they name, merged as Hydra does (a file's own
    keys after its defaults). Hydra's composition is the reference; test_gpu_smoke checks they agree."""
    import yaml

    out: dict = {}

    def merge(into: dict, new: dict) -> None:
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    def walk(path: Path) -> None:
        node = yaml.safe_load(path.read_text()) or {}
        for entry in node.pop("defaults", []):
            if isinstance(entry, str) and entry != "_self_":
                walk(path.parent / f"{entry}.yaml")
            elif isinstance(entry, dict):
                (key, value), = entry.items()
                group = key.removeprefix("override ").strip("/")
                if group in ("model", "algo"):
                    merge(out, {group: yaml.safe_load((ROOT / "conf" / group / f"{value}.yaml").read_text()) or {}})
        merge(out, {k: v for k, v in node.items() if k in ("model", "algo", "trainer")})

    walk(ROOT / "conf" / "exp" / f"{name}.yaml")
    return {k: out.get(k, {}) for k in ("model", "algo", "trainer")}


def trainer_config(preset: str, model_path: str, tiny: bool):
    """pace.config.Config with the preset's model/algo/trainer values; warm-up off, so that the one
    step runs at the preset's lr (1e-6); on CPU the tiny model's short chunk."""
    from pace.config import Config

    cfg = Config()
    for group, values in preset_values(preset).items():
        section = getattr(cfg, group)
        for key, value in values.items():
            if not hasattr(section, key):
                raise KeyError(f"conf/exp/{preset}.yaml: {group}.{key} is not in pace.config's schema")
            setattr(section, key, value)
    cfg.model.path, cfg.trainer.warmup_steps = model_path, 0
    if tiny:
        cfg.trainer.logprob_chunk, cfg.trainer.max_tokens_per_micro_batch = 64, 1024
    return cfg


def predicted_peak(case: str, layers: int = 4, tiny: bool = False) -> dict[str, float]:
    """The case's peak GPU memory (GiB) by pace/algo/memory_budget.py for its shapes, by phase:
    the states (fp32 weights, gradients and AdamW moments; bf16 in ``pure``), a training step's
    forward and backward above them, AdamW's foreach step, and (``fsdp``) the no-grad chunked =
    full check (weights and moments; gradients freed). "peak" is the largest."""
    from pace.algo import memory_budget as mb

    arch = {**(QWEN3_30B_A3B if case == "moe" else QWEN3_8B), **((TINY_MOE if case == "moe" else TINY) if tiny else {})}
    shapes = mb.Shapes.of({**arch, "num_hidden_layers": 2 if case == "moe" or tiny else layers})
    cfg = trainer_config(PRESETS[case], "", tiny)
    compute = cfg.model.dtype
    master = mb.BYTES[compute] if case == "pure" else mb.BYTES[cfg.trainer.master_dtype]
    reduce = compute if case == "pure" else cfg.trainer.reduce_dtype
    params = shapes.params()
    prompt, response = (TINY_LENGTHS if tiny else LENGTHS)[case]
    step = mb.step_bytes(shapes, prompt + response, response, cfg.trainer.logprob_chunk, compute,
                         cfg.model.gradient_checkpointing, fsdp=True, reduce=reduce)
    states = mb.states_bytes(params, 1, master)
    out = {"states": states, "step": states + step["total"], "optimizer": mb.optimizer_bytes(params, 1, master)}
    if case == "fsdp":
        prompt, response = TINY_AGREE_LENGTHS if tiny else AGREE_LENGTHS
        out["agreement"] = states * 3 // 4 + mb.full_logprobs_bytes(shapes, prompt + response, response, compute)
    out = {k: v / mb.GIB for k, v in out.items()}
    return {**out, "peak": max(out.values())}


# --- the parent: models, launches, checks -------------------------------------------------------
def write_model(path: Path, arch: dict, layers: int, tiny: bool) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    if (path / "config.json").exists():
        return path
    kind = Qwen3MoeConfig if "num_experts" in arch else Qwen3Config
    config = kind(**{**arch, "num_hidden_layers": layers})
    torch.manual_seed(0)
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def launch(case: str, model: Path, work: Path, tiny: bool) -> list[dict]:
    """Run one case in its own process and collect its SMOKE lines (echoed as they come)."""
    args = ["--case", case, "--model", str(model), "--work", str(work)] + (["--tiny"] if tiny else [])
    out = run_child(Path(__file__).resolve(), args, tiny, "no" if case == "pure" else "bf16", "SMOKE ")
    return [{"case": case, **r} if "failed" in r else r for r in out]


def run_child(script: Path, args: list[str], tiny: bool, mixed: str, prefix: str) -> list:
    """Run ``script`` in a process of its own as train.py runs (GPU: `accelerate launch` with
    conf/accelerate/fsdp.yaml and one process; CPU: a gloo world of one, as torchrun sets it up) and
    return the JSON of its lines that start with ``prefix`` (echoed as they come), and {"failed": ...}
    if it exited with an error."""
    args = [str(script), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tiny:  # a gloo world of one, as torchrun would set it up
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"))
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML), "--num_processes", "1",
               "--mixed_precision", mixed, *args]
    out, tail = [], []
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if line.startswith(prefix):
            out.append(json.loads(line[len(prefix):]))
            print(line, end="", flush=True)
    if proc.wait() != 0:
        print("".join(tail), file=sys.stderr)
        out.append({"failed": f"exit status {proc.returncode}"})
    return out


def checks(results: list[dict]) -> list[tuple[str, bool, str]]:
    by = {(r["case"], r["what"]): r for r in results if "what" in r}
    rows: list[tuple[str, bool, str]] = [(f"{r['case']} ran", False, r["failed"]) for r in results if "failed" in r]

    def row(name, case, what, test, detail):
        r = by.get((case, what))
        rows.append((name, r is not None and bool(test(r)), "missing" if r is None else detail(r)))

    row("FSDP2 from the yaml, bf16 mixed", "fsdp", "setup", lambda r: r["fsdp2"] and r["mixed"] == "bf16",
        lambda r: f"{r['distributed_type']}, mixed {r['mixed']}, units {r['units']}")
    row("fp32 shards, bf16 compute", "fsdp", "setup",
        lambda r: r["shards"] == ["torch.float32"] and r["compute"] == "torch.bfloat16" and r["sharded"] == ["DTensor"],
        lambda r: f"shards {r['shards']} ({r['sharded']}), q_proj runs in {r['compute']}")
    row("engine weights = checkpoint", "fsdp", "source", lambda r: r["names_equal"] and r["bits_equal"],
        lambda r: f"{r['tensors']} tensors, {r['gib']:.1f} GiB gathered in {r['seconds']:.2f} s")
    row("DAPO step, one long sequence", "fsdp", "step", lambda r: r["finite"] and r["changed_layers"] > 0.9,
        lambda r: f"{r['tokens']:,} tokens: loss {r['loss']:.4f}, {100 * r['changed_layers']:.2f}% of layer weights moved at "
                  f"lr 1e-6, peak {r.get('peak_gib', float('nan')):.1f} GiB ({r.get('above_states_gib', float('nan')):.1f} "
                  f"above the weights, gradients and AdamW state), {r['seconds']:.1f} s")
    row("chunked = full log-probs", "fsdp", "agreement", lambda r: r["max_abs"] < 0.1 and r["mean_abs"] < 0.01,
        lambda r: f"max |Δ| {r['max_abs']:.2e}, mean {r['mean_abs']:.2e} over {r['tokens']:,} tokens")
    row("algo=m2po step", "fsdp", "m2po", lambda r: r["finite"], lambda r: f"loss {r['loss']:.4f}, m2 {r.get('m2', float('nan')):.2e}")
    row("algo.ratio_ref=proximal step", "fsdp", "proximal", lambda r: r["finite"], lambda r: f"loss {r['loss']:.4f}")
    row("SHARDED_STATE_DICT save/load bit-exact", "fsdp", "checkpoint", lambda r: r["weights_equal"] and r["optimizer_equal"]
        and r["moved_between"] and r["dcp"], lambda r: f"save {r['save_s']:.1f} s, load {r['load_s']:.1f} s, {r['gib']:.1f} GiB on disk")
    row("pure bf16: the update rounds away", "pure", "step",
        lambda r: r["finite"] and r["shards"] == ["torch.bfloat16"] and r["changed_layers"] < 0.2 * by.get(("fsdp", "step"), {}).get("changed_layers", 0),
        lambda r: f"{100 * r['changed_layers']:.2f}% of layer weights moved (bf16 weights and AdamW)")
    row("MoE step", "moe", "step", lambda r: r["finite"] and r["changed_layers"] > 0.5,
        lambda r: f"{r['tokens']:,} tokens: loss {r['loss']:.4f}, {100 * r['changed_layers']:.2f}% moved, peak {r.get('peak_gib', float('nan')):.1f} GiB, {r['seconds']:.1f} s")
    for case in ("fsdp", "pure", "moe"):
        row(f"{case}: peak memory ≤ {PEAK_LIMIT_GIB:.0f} GiB", case, "memory",
            lambda r: r["predicted"]["peak"] <= r["limit_gib"] and (r["measured_gib"] is None or r["measured_gib"] <= r["limit_gib"]),
            lambda r: f"predicted {r['predicted']['peak']:.1f} GiB (states {r['predicted']['states']:.1f}, step "
                      f"{r['predicted']['step']:.1f}, AdamW {r['predicted']['optimizer']:.1f}), measured "
                      + ("– (CPU)" if r["measured_gib"] is None else f"{r['measured_gib']:.1f}"))
    row("MoE engine weights = checkpoint", "moe", "source", lambda r: r["names_equal"] and r["bits_equal"],
        lambda r: f"{r['fused']} fused expert tensors = the checkpoint's per-expert ones; {r['seconds']:.2f} s")
    return rows


def parent(args) -> int:
    t0 = time.perf_counter()
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny on CPU")
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_smoke_"))  # removed at the end unless given
    work.mkdir(parents=True, exist_ok=True)
    dense = write_model(work / "dense", {**QWEN3_8B, **(TINY if args.tiny else {})}, 2 if args.tiny else args.layers, args.tiny)
    moe = write_model(work / "moe", {**QWEN3_30B_A3B, **(TINY_MOE if args.tiny else {})}, 2, args.tiny)
    info = {"device": torch.cuda.get_device_name() if not args.tiny else "cpu", "torch": torch.__version__,
            "layers_8b": 2 if args.tiny else args.layers, "work": str(work), "models_s": round(time.perf_counter() - t0, 1)}
    print("SMOKE " + json.dumps({"case": "parent", "what": "setup", **info}), flush=True)
    results = []
    try:
        for case, model in (("fsdp", dense), ("pure", dense), ("moe", moe)):
            results += launch(case, model, work, args.tiny)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    rows = checks(results)
    print(f"\n{info['device']}, torch {info['torch']}: Qwen3-8B-shaped with {info['layers_8b']} layers, "
          f"Qwen3-30B-A3B-shaped with 2; {time.perf_counter() - t0:.0f} s in all\n")
    print("| check | ok | measured |\n|---|---|---|")
    for name, ok, detail in rows:
        print(f"| {name} | {'yes' if ok else '**NO**'} | {detail} |")
    return 0 if all(ok for _, ok, _ in rows) else 1


# --- a case, in its own process -----------------------------------------------------------------
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


def fsdp_plugin(path: Path = FSDP_YAML):
    """An accelerate config file's FSDP plugin, as `accelerate launch` builds it from the file (also
    the CPU tests' way to Accelerate's FSDP2 path: tests/integration/fsdp_prepare.py)."""
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp = yaml.safe_load(path.read_text())["fsdp_config"]
    kwargs = {k if k == "fsdp_version" else k.removeprefix("fsdp_"): v for k, v in fsdp.items()}
    if "transformer_layer_cls_to_wrap" in kwargs:  # the launcher's name for the plugin's field
        kwargs["transformer_cls_names_to_wrap"] = kwargs.pop("transformer_layer_cls_to_wrap").split(",")
    kwargs.pop("cpu_ram_efficient_loading", None)  # a loading mode for hub checkpoints, set by the launcher's env
    kwargs["cpu_offload"] = kwargs.pop("offload_params", False)
    return FullyShardedDataParallelPlugin(**kwargs)


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
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if "m2po/m2" in stats:
        out["m2"] = stats["m2po/m2"]
    return out


def engine_view(case: str, trainer, model_path: str, cuda: bool) -> None:
    """The weight sync's tensors (pace/weights/source.py: cast to bf16, gathered) against the files."""
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
    emit(case, "source", tensors=n, fused=fused, names_equal=bool(names_ok), bits_equal=bool(bits_ok),
         gib=nbytes / 2**30, seconds=time.perf_counter() - t0)


def child(args) -> None:
    """One case, then its peak memory: predicted (pace.algo.memory_budget) and, on a GPU, measured."""
    run_case(args)
    emit(args.case, "memory", predicted=predicted_peak(args.case, args.layers, args.tiny),
         measured_gib=max(PEAKS) if PEAKS else None, limit_gib=PEAK_LIMIT_GIB)


def run_case(args) -> None:
    import torch

    from pace.algo.trainer import DAPOTrainer, build_loss

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
    if case != "pure":
        engine_view(case, trainer, args.model, cuda)
    batch = batch_of(trainer, prompt, response, vocab)  # its no-grad forward runs q_proj once
    hook.remove()
    emit(case, "setup", distributed_type=str(acc.distributed_type), fsdp2=acc.is_fsdp2, mixed=acc.mixed_precision,
         units=units, shards=shards, sharded=sharded, compute=seen.get("compute"),
         params_b=sum(p.numel() for p in model.parameters()) / 1e9)
    step = timed_step(trainer, batch, cuda)
    states = sum(p.numel() for p in model.parameters()) * (16 if shards == ["torch.float32"] else 8)  # + grads, 2 moments
    if "peak_gib" in step:
        step["above_states_gib"] = step["peak_gib"] - states / 2**30
    changed_layers, changed_all = moved(before, model)
    emit(case, "step", tokens=prompt + response, shards=shards, changed_layers=changed_layers, changed_all=changed_all,
         **step)
    del before
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny models (a smoke test of this script)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen3-8B-shaped model (of 36)")
    ap.add_argument("--work", help="folder for the models and the checkpoint (default: a new temporary one)")
    ap.add_argument("--case", choices=sorted(PRESETS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        child(args)
    else:
        sys.exit(parent(args))


if __name__ == "__main__":
    main()
