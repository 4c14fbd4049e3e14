"""The trainer side of a paper run, checked on one GPU before a cluster is booked.

    python scripts/gpu_smoke.py            # one H100 or H200, ≤ 8 minutes by estimate (not yet run: README)
    python scripts/gpu_smoke.py --tiny     # CPU, tiny models, ~1 minute (the test suite runs this)

Needs only torch (2.11+), transformers (5.17+) and accelerate: no vLLM, no Hydra, no model hub. It
writes two random models to a work folder, each shaped like a preset's model with fewer layers:
Qwen3-8B's layers, head and vocabulary (`--layers` of its 36) and a 2-layer Qwen3-30B-A3B (128
experts, top 8). Then three cases, each in its own process as `train.py` runs — on a GPU under
`accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 1` (Accelerate's FSDP2
plugin from the yaml, its bf16 mixed precision; the trainer's allocator setting, pace/allocator.py); on CPU the yaml's plugin is set on Accelerate's state
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
  FusedMoE loads) equal to the checkpoint's per-expert tensors. The step replays routes
  (`algo.routing_replay`, on in the preset; pace/algo/routing_replay.py): the engine's stood in for by
  a no-grad forward whose routers take the top-k of noise-perturbed logits (smoke_case.record_routes),
  so that a share of the tokens is routed otherwise than the trainer's router would; the step's
  `moe/route_diff_share` must find that share, and its on-policy |ℓ − ℓ^μ| against that forward stay
  below 1e-3 a token (0 on the tiny CPU model; 3e-3 there with the replay switched off by hand).

Each case's peak memory is predicted for its shapes by pace/algo/memory_budget.py (`predicted_peak`:
41.9 / 26.5 / 36.9 GiB for fsdp / pure / moe with the default `--layers 4`; tests/unit/
test_memory_budget.py holds them to 74 GiB, what an H100 leaves) and, on a GPU, compared with the
largest `torch.cuda.max_memory_allocated` of the case: a table row each.

Prints one `SMOKE {json}` line per measurement as it goes, then a table of the checks; exit status 1
if any fails.
"""
from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT / "scripts"))

import smoke_case  # noqa: E402  (a case, in its own process)
from smoke_setup import (FSDP_YAML, PEAK_LIMIT_GIB, PRESETS, QWEN3_8B, QWEN3_30B_A3B, TINY,  # noqa: E402
                         TINY_MOE, write_model)


# --- the parent: models, launches, checks -------------------------------------------------------
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
    else:  # the trainer's allocator as train.py sets it (expandable segments unless the user set one)
        from pace.allocator import trainer_env

        env.update(trainer_env(env, "cuda", None))
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
    for case in ("fsdp", "moe"):  # pace/weights/delta.py on the step's update at lr 1e-6
        row(f"{case}: delta sync of the step", case, "delta", lambda r: not r["full"] and 0 < r["changed_frac"] < 1 / 3,
            lambda r: f"{100 * r['changed_frac']:.2f}% of the bf16 casts changed: {100 * r['bytes_ratio']:.1f}% of a whole "
                      f"sync's bytes; planned in {r['seconds']:.2f} s, {r['host_gib']:.1f} GiB of host memory")
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
    nan = float("nan")
    row("MoE step with replayed routes", "moe", "step",
        lambda r: 0 < r.get("route_diff_share", 0) and abs(r["route_diff_share"] - r["planted_share"]) < 0.02
        and r["replayed_share"] > 0.99 and r["abs_logp_diff"] < 1e-3,
        lambda r: f"{100 * r.get('route_diff_share', nan):.1f}% of the loss tokens' routes (mean over layers) replayed otherwise "
                  f"than the trainer's router would route them ({100 * r.get('planted_share', nan):.1f}% planted); "
                  f"{100 * r.get('replayed_share', nan):.2f}% of the positions replayed; |ℓ − ℓ^μ| "
                  f"{r.get('abs_logp_diff', nan):.1e} a token")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny models (a smoke test of this script)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen3-8B-shaped model (of 36)")
    ap.add_argument("--work", help="folder for the models and the checkpoint (default: a new temporary one)")
    ap.add_argument("--case", choices=sorted(PRESETS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        smoke_case.child(args)
    else:
        sys.exit(parent(args))


if __name__ == "__main__":
    main()
