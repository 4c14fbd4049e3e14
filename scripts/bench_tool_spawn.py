"""What tool calls cost the trainer living in the same process, side by side.

    python scripts/bench_tool_spawn.py                 # ~2 GB parent, 4 calling threads, 20 s per row
    python scripts/bench_tool_spawn.py --seconds 30 --parent-gb 3

A training-like thread (matmuls and fresh allocations over a ~`--parent-gb` heap, as the trainer
does) runs alone, then with `--threads` threads making sandbox calls back to back, spawned
(a) as `Sandbox` does (vfork: no preexec_fn; `python -I -S`), (b) with a `preexec_fn`, which makes
Python fork the whole parent (page tables copied, every page the trainer writes afterwards faults
once), (c) as (a) but with `site` imported by the tool interpreter (`python -I`). Printed: trainer
iterations per second and calls per second in each case, and the ratios to the trainer alone.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pace.tools.sandbox import Sandbox  # noqa: E402

PROGRAM = "print(sum(i * i for i in range(1000)))\n"


class ForkingSandbox(Sandbox):
    """(b): the same sandbox, started with a preexec_fn (Python then forks instead of vforking)."""

    def _start(self):
        proc = subprocess.Popen(self._command(None), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                preexec_fn=lambda: None)
        return proc, None


class SiteSandbox(Sandbox):
    """(c): the tool interpreter imports `site` (its .pth files) at start-up."""

    def _command(self, cgroup=None):
        cmd = super()._command(cgroup)
        i = cmd.index("-S")
        return cmd[:i] + cmd[i + 1 :]


def trainer(stop: threading.Event, heap: list, counts: list) -> None:
    torch.set_num_threads(1)
    w = torch.randn(256, 256)
    n = 0
    while not stop.is_set():
        x = torch.randn(512, 256)
        for _ in range(4):
            x = torch.tanh(x @ w)
        heap[n % len(heap)].add_(1.0)  # writes into the big heap, as optimizer steps do
        n += 1
    counts.append(n)


def measure(sandbox: Sandbox | None, seconds: float, threads: int, heap: list) -> tuple[float, float]:
    stop, counts, calls = threading.Event(), [], [0]

    def caller():
        while not stop.is_set():
            r = sandbox.run(PROGRAM)
            assert r.ok, r.output
            calls[0] += 1

    workers = [threading.Thread(target=trainer, args=(stop, heap, counts))]
    if sandbox is not None:
        workers += [threading.Thread(target=caller) for _ in range(threads)]
    for t in workers:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in workers:
        t.join()
    return counts[0] / seconds, calls[0] / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--parent-gb", type=float, default=2.0)
    ap.add_argument("--backend", default="bwrap")
    args = ap.parse_args()
    chunk = 64 << 20  # 64 MiB tensors
    heap = [torch.ones(chunk // 4) for _ in range(max(1, int(args.parent_gb * (1 << 30) / chunk)))]
    rows = [("trainer alone", *measure(None, args.seconds, args.threads, heap))]
    for label, cls in (("(a) vfork, python -I -S (as used)", Sandbox), ("(b) fork (preexec_fn)", ForkingSandbox),
                       ("(c) vfork, python -I (site)", SiteSandbox)):
        with cls(args.backend) as sb:
            rows.append((label, *measure(sb, args.seconds, args.threads, heap)))
    alone = rows[0][1]
    print(f"parent heap {args.parent_gb:g} GB, {args.threads} calling threads, {args.seconds:g} s per row, backend {args.backend}\n")
    print("| tool calls | trainer it/s | trainer vs alone | calls/s |")
    print("|---|---|---|---|")
    for label, it, calls in rows:
        print(f"| {label} | {it:.1f} | {it / alone:.2f} | {calls:.1f} |")


if __name__ == "__main__":
    main()
