"""Tool-sandbox throughput: calls per second with cold and warm sandboxes, side by side.

    python scripts/bench_sandbox.py                  # 200 calls each: cold, warm=4, process fallback
    python scripts/bench_sandbox.py --calls 500 --threads 4 --warm 8

Each call runs a small tool program (a sum and a print, as ReTool-style code does) in a fresh
sandbox. Cold: every call starts its own bubblewrap sandbox and interpreter. Warm: `--warm`
sandboxes are kept started and waiting for their program (each runs one program, then is
replaced in the background). `--threads` callers run concurrently, as trajectories' tool calls do.
The bare-process fallback (no isolation) is timed the same way for reference.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pace.tools.sandbox import Sandbox  # noqa: E402

PROGRAM = "total = sum(i * i for i in range(10_000))\nprint(total)\n"


def bench(sb: Sandbox, calls: int, threads: int) -> tuple[float, float]:
    sb.run(PROGRAM)  # warm the page cache
    latencies = []

    def one(_):
        t0 = time.perf_counter()
        r = sb.run(PROGRAM)
        latencies.append(time.perf_counter() - t0)
        assert r.ok and r.output == "333283335000\n", (r.status, r.exit_code, r.output)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(calls)))
    wall = time.perf_counter() - t0
    latencies.sort()
    return calls / wall, latencies[len(latencies) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for label, backend, warm in (("bwrap, cold", "bwrap", 0), (f"bwrap, warm={args.warm}", "bwrap", args.warm),
                                 ("process fallback, cold", "process", 0)):
        with Sandbox(backend, warm=warm) as sb:
            rows.append((label, *bench(sb, args.calls, args.threads)))
    base = rows[0][1]
    print(f"{args.calls} calls, {args.threads} concurrent callers\n")
    print("| sandbox | calls/s | median latency ms | calls/s vs cold bwrap |")
    print("|---|---|---|---|")
    for label, rate, median in rows:
        print(f"| {label} | {rate:.1f} | {1000 * median:.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
