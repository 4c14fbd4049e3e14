"""Building a fleet's out-of-process engines one after another vs at once (`build_engines`).

    python scripts/bench_engine_build.py [--engines 2] [--model PATH]

Builds `--engines` child engines of the tiny model (or ``--model``) with `build_engine` one after
another, shuts them down, then builds them with `build_engines` at once (as on GPUs of their own),
and prints both wall times. On a CPU the builds share its cores: on 2 busy cores at once was the
slower (85-100 s against 73 s), which is why a run builds at once only on GPUs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from pace.config import RolloutConfig
    from pace.placement import Placement
    from pace.rollout import engine as engine_lib
    from pace.tiny import TinySpec, build_tiny

    model = args.model or str(build_tiny(TinySpec(), ROOT / "data" / "cache", progress=False))
    cfg = RolloutConfig(engines=args.engines)
    engine_lib.configure_environment(cfg, "cpu")
    dtype = "float32" if args.model is None else "auto"
    t0 = time.monotonic()
    llms = [engine_lib.build_engine(model, cfg, dtype, e, "child", None) for e in range(args.engines)]
    one_by_one = time.monotonic() - t0
    for llm in llms:
        engine_lib.shutdown(llm)
    t0 = time.monotonic()
    # GPU ids make them build at once (a CPU build of vLLM ignores CUDA_VISIBLE_DEVICES)
    placement = Placement(device="cpu", world=1, mode="child", backend="shm", gpus=tuple((e,) for e in range(args.engines)))
    llms = engine_lib.build_engines(model, cfg, dtype, 0, placement, transfer=False)
    at_once = time.monotonic() - t0
    for llm in llms:
        engine_lib.shutdown(llm)
    print(f"{args.engines} child engines: one after another {one_by_one:.1f} s, at once {at_once:.1f} s")


if __name__ == "__main__":
    main()
