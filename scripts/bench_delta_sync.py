"""Weight sync, full vs delta (`rollout.weight_delta`), side by side, through a real vLLM CPU engine.

    python scripts/bench_delta_sync.py                              # the tiny model and a random Qwen3-0.6B-shaped one
    python scripts/bench_delta_sync.py --models tiny --steps 2      # the smoke test's run
    python scripts/bench_delta_sync.py --models random --layers 14  # a smaller random model

For each model: fp32 master weights trained by AdamW with a paper preset's `trainer.lr`,
`weight_decay`, `betas` and `grad_clip` (`--preset`, default pace_qwen3_8b; constant lr, the warm-up
left out) on real gradients (a forward/backward of random tokens per step), and one vLLM engine in
a child process in the preset's `model.dtype` (bfloat16), joined to the trainer by the gloo weight
transfer with a mirror for patches (pace/weights/gloo.py). Version 0 is sent whole; then after each
step θ_step is sent twice: as the delta (pace/weights/delta.py: `DeltaTracker.plan` diffs the cast
against what the engine holds, every patch sent with `send_patches`), then whole (`send_weights`).
After each sync the engine's fingerprints of what it loaded must equal the trainer's cast's
(pace/weights/fingerprint.py; after a delta, the plan's fingerprints too), else the script stops.

Printed per step: the changed fraction of the cast's elements, bytes to the engine worker full and
delta, their ratio, seconds of `plan()` (the diff, done while the engines serve), and for each way
the trainer's blocking seconds (send: start, broadcast, finish) and the engine's pause (paused to
resumed). The bytes are `Plan.bytes` (values, and int32 indices for a delta); the trainer's time
inside the broadcasts is timed too (bcast): for a delta it is the wire alone, for a full sync it
includes the engine's loading of each tensor as it arrives. On CPU the engine reloads every tensor
from its mirror after a delta (its packed kernels cannot be patched in place: pace/weights/gloo.py):
a delta's pause is that reload whatever the changed fraction (shorter than a full sync's, which
also waits for the trainer's cast and the wire, but it does not shrink with the delta); the wire does.

The random model (`--hidden`, `--layers`, …; Qwen3-0.6B's shape by default, 0.6 B parameters,
tied embeddings) is saved once in bfloat16, as released checkpoints are, under data/cache/, with
the tiny model's tokenizer (the engine needs one; no text is generated). Its fp32 masters therefore
start on the bf16 grid, as a run from such a checkpoint does. Its run peaks at ~11 GB in the trainer
(fp32 weights, gradients, AdamW's moments, two bf16 casts) and ~6–7 GB in the engine's processes:
~17 GB in all (fewer `--layers`, less). Measure with nothing else running.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Row:
    step: int
    changed_frac: float
    full_bytes: int
    delta_bytes: int
    plan_s: float
    full: dict = field(default_factory=dict)  # send_s, pause_s, bcast_s
    delta: dict = field(default_factory=dict)


def preset(name: str):
    from hydra import compose, initialize_config_dir

    from pace.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=[f"+exp={name}"])


def tiny_path(given: str | None = None) -> Path:
    from pace.tiny import TinySpec, build_tiny

    return Path(given) if given else build_tiny(TinySpec(), ROOT / "data" / "cache", progress=False)


def random_path(args) -> Path:
    """A random Qwen3 of the given shape, saved in bfloat16 once (scripts/smoke_setup.py's seeded
    writer: the same every time)."""
    from scripts.smoke_setup import write_model

    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
                 vocab_size=args.vocab, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 head_dim=args.head_dim)
    target = ROOT / "data" / "cache" / ("bench-qwen3-" + "-".join(str(v) for v in shape.values()))
    if (target / "config.json").exists():
        return target
    print(f"building {target.name} …", file=sys.stderr, flush=True)
    arch = dict(shape, tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6, eos_token_id=1,
                pad_token_id=0, bos_token_id=None)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_model(tmp, arch, args.layers, tiny=True)  # on the CPU
    for f in ("tokenizer.json", "tokenizer_config.json"):  # vLLM loads a tokenizer; ids past it are never sampled
        shutil.copy(tiny_path(args.tiny_model) / f, tmp / f)
    tmp.rename(target)  # whole or not at all
    return target


class Client:
    """vLLM's four trainer-engine calls onto one fleet, each update labelled with its version (so the
    worker's mirror knows the base of the next patches), the engine's pause timed."""

    def __init__(self, fleet):
        self.fleet, self.version, self.pause_s, self._t0 = fleet, None, 0.0, 0.0

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.fleet.init_weight_transfer_engine(info)
        self.fleet.fingerprint_updates()

    def start_weight_update(self) -> None:
        self._t0 = time.perf_counter()
        self.fleet.begin_update()

    def update_weights(self, info: dict) -> None:
        self.fleet.load({**info, "version": self.version} if info.get("version") is None else info)

    def finish_weight_update(self, weight_version=None) -> None:
        self.fleet.end_update(self.version)
        self.pause_s = time.perf_counter() - self._t0


class Wire:
    """The trainer's seconds inside gloo broadcasts (pace/weights/gloo.py's `_broadcast`, wrapped here:
    the trainer's side only, the engine worker is another process)."""

    def __init__(self):
        from pace.weights import gloo

        self.seconds, inner = 0.0, gloo._broadcast

        def timed(group, tensor):
            t0 = time.perf_counter()
            inner(group, tensor)
            self.seconds += time.perf_counter() - t0

        gloo._broadcast = timed


def check(fleet, model, dtype, what: str, planned: dict | None = None) -> None:
    """The engine's fingerprints of what it loaded are the trainer's cast's (and the plan's, ``planned``)."""
    from pace.weights.fingerprint import tensor_fingerprint
    from pace.weights.transfer import CastSource

    cast = {name: tensor_fingerprint(t) for name, t in CastSource(model, dtype)}
    for i, got in enumerate(fleet.fingerprints()):
        if got != cast:
            bad = [n for n in cast if not isinstance(got, dict) or got.get(n) != cast[n]]
            sys.exit(f"{what}: engine worker {i} does not hold the trainer's cast "
                     f"({got if isinstance(got, str) else f'{len(bad)} tensors differ, first {bad[:1]}'})")
    if planned is not None and planned != cast:
        sys.exit(f"{what}: the plan's fingerprints are not the cast's")


def bench(name: str, path: Path, args, cfg) -> tuple[int, list[Row]]:
    import torch
    from transformers import AutoModelForCausalLM

    from pace.config import RolloutConfig
    from pace.net import free_port
    from pace.rollout import engine as engine_lib
    from pace.rollout.fleet import EngineFleet
    from pace.weights import source as weight_source
    from pace.weights.delta import DeltaTracker
    from pace.weights.gloo import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
    from pace.weights.transfer import CastSource

    dtype, t = getattr(torch, cfg.model.dtype), cfg.trainer
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = sum(p.numel() for _, p in weight_source.named_parameters(model))
    # one tensor at a time (foreach=False): the same update without full-size temporaries (~2.4 GB at 0.6 B)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                  foreach=False)
    print(f"{name}: {params / 1e6:.1f} M parameters; starting the engine …", file=sys.stderr, flush=True)
    rollout = RolloutConfig(engine_process="child", weight_transfer="gloo", max_num_seqs=8)
    fleet = EngineFleet([engine_lib.build_engine(str(path), rollout, cfg.model.dtype, args.seed, "child", "gloo")])
    fleet.set_version(0)
    client, wire, sent = Client(fleet), Wire(), {}
    source = CastSource(model, dtype, on_sent=lambda prints: sent.update(prints=prints))
    info = GlooTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                               world_size=1 + fleet.transfer_workers(), delta=True)
    sender = GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    tracker = DeltaTracker(model, dtype, full_every=0, max_frac=1.0)

    def sync(version: int, plan=None) -> dict:
        """θ_version to the engine: whole (``plan`` None) or the plan's patches; its seconds, checked."""
        client.version, wire.seconds = version, 0.0
        t0 = time.perf_counter()
        if plan is None:
            sender.send_weights()
        else:
            sender.send_patches(plan.patches, version, tracker.version)
        seconds = {"send_s": time.perf_counter() - t0, "pause_s": client.pause_s, "bcast_s": wire.seconds}
        check(fleet, model, dtype, f"{name} θ_{version} {'full' if plan is None else 'delta'}",
              None if plan is None else plan.prints)
        return seconds

    rows = []
    try:
        plan = tracker.plan(0)  # the first sync: whole
        sync(0)
        tracker.sent(plan, sent["prints"])
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens))
            model(input_ids=tokens, labels=tokens).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            plan = tracker.plan(step)
            plan_s = time.perf_counter() - t0
            if plan.full:
                sys.exit(f"{name} step {step}: planned whole ({plan.reason}) with max_frac=1.0")
            row = Row(step, plan.changed_frac, plan.total * plan.value_bytes, plan.bytes, plan_s)
            row.delta = sync(step, plan)
            tracker.sent(plan)
            row.full = sync(step)  # θ_step again, whole: the engine's mirror holds θ_step either way
            rows.append(row)
            print(f"{name} step {step}: changed {plan.changed_frac:.4%}, plan {plan_s:.3f} s, delta {row.delta}, "
                  f"full {row.full}", file=sys.stderr, flush=True)
    finally:
        sender.shutdown()
        fleet.shutdown()
    return params, rows


def table(results: dict[str, tuple[int, list[Row]]]) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = ["| model | params | step | changed | MiB full | MiB delta | full/delta | plan s | full: send / pause s "
             "| delta: send / pause s | bcast s: full / delta |", "|---" * 11 + "|"]
    for name, (params, rows) in results.items():
        for r in rows:
            f, d = r.full, r.delta
            lines.append(f"| {name} | {params / 1e6:.1f} M | {r.step} | {r.changed_frac:.3%} | {mib(r.full_bytes)} | "
                         f"{mib(r.delta_bytes)} | {r.full_bytes / max(r.delta_bytes, 1):.1f}× | {r.plan_s:.3f} | "
                         f"{f['send_s']:.3f} / {f['pause_s']:.3f} | {d['send_s']:.3f} / {d['pause_s']:.3f} | "
                         f"{f['bcast_s']:.3f} / {d['bcast_s']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "random"], choices=["tiny", "random"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--preset", default="pace_qwen3_8b",
                    help="the preset whose trainer.lr, betas, weight_decay, grad_clip and model.dtype are used")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="random tokens per sequence in each step's forward/backward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="the trainer's torch threads (the engine has its own one)")
    ap.add_argument("--tiny-model", help="the tiny model's directory (default: pace.tiny's, built if missing)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    shape = ap.add_argument_group("the random model (default: Qwen3-0.6B's shape)")
    for flag, default in (("hidden", 1024), ("layers", 28), ("intermediate", 3072), ("vocab", 151936), ("heads", 16),
                          ("kv-heads", 8), ("head-dim", 128)):
        shape.add_argument(f"--{flag}", type=int, default=default)
    args = ap.parse_args()
    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib

    engine_lib.configure_environment(RolloutConfig(), "cpu")  # before vLLM is imported
    import torch

    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    t = cfg.trainer
    print(f"preset {args.preset}: lr {t.lr}, betas {list(t.betas)}, weight_decay {t.weight_decay}, grad_clip "
          f"{t.grad_clip}, engine dtype {cfg.model.dtype}", flush=True)
    paths = {"tiny": lambda: tiny_path(args.tiny_model), "random": lambda: random_path(args)}
    results = {m: bench(m, paths[m](), args, cfg) for m in args.models}
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps({m: {"params": params, "rows": [asdict(r) for r in rows]}
                                         for m, (params, rows) in results.items()}, indent=1))
    print("bytes: to each engine worker (a delta: an int32 index and a value per changed element); plan: the diff, "
          "while the engines serve; send: the trainer's wait (start, broadcast, finish); pause: the engine's; bcast: "
          "the trainer inside broadcasts (full: with the engine's per-tensor loads). On CPU a delta reloads every "
          "tensor from the worker's mirror: its pause does not shrink with the changed fraction, only the wire does.",
          flush=True)


if __name__ == "__main__":
    main()
