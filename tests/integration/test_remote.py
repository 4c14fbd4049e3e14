"""Rollout engines as vLLM HTTP servers (`rollout.engine_process=server`): two servers in processes
of their own on 127.0.0.1, reached only through vLLM's routes (token-in/token-out generation with
per-token weight versions, the RL weight-update routes) and weights through the gloo backend, the
path a server on another host takes.

The module's two servers are started once and shared (a run pushes θ_0 to them at its start);
the test that kills one of them runs last. The test of a failure with `continue` has `train.py`
start servers of its own, so that the launch path is exercised too."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests

from tests.helpers import ROOT, _check_accounting, check_staleness, run_train, wait_for_rows

pytestmark = pytest.mark.integration

SMALL = ["data.batch_prompts=4", "rollout.max_inflight_groups=12", "eval.every=0",
         "logger.mode=disabled", "rollout.engine_process=server"]


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    from hydra import compose, initialize_config_dir

    from pace.config import register
    from pace.placement import Placement
    from pace.rollout import server

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["+exp=async_tiny", "rollout.engine_process=server", "rollout.engines=2"])
    placement = Placement.of(cfg.rollout, "cpu", world=1)
    assert placement.backend == "gloo"  # a server's weights over the network
    started = server.launch_local(tiny_model_path, cfg, placement, tmp_path_factory.mktemp("servers"))
    yield started
    for s in started:
        s.kill()


def _read(run_dir):
    import pandas as pd

    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics, pd.read_parquet(run_dir / "groups")


def _alive_changes(metrics: list[dict]) -> list[int]:
    """The number of engines in service, each time it changed (from the first step's)."""
    alive = [m["rollout/engines_alive"] for m in metrics]
    return [a for i, a in enumerate(alive) if i == 0 or a != alive[i - 1]]


def _server_logprobs(url: str, ids: list[int]) -> list[float]:
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}}
    out = requests.post(url + "/inference/v1/generate", json=body, timeout=60).json()
    return [out["prompt_logprobs"][t][str(ids[t])]["logprob"] for t in range(1, len(ids))]


@pytest.mark.parametrize("preset, steps, sync_every", [("async_tiny", 5, 1), ("pace_tiny", 8, 2)])
def test_a_run_on_two_servers(preset, steps, sync_every, servers, tiny_model_path, tmp_path):
    """A short run on two servers: exact per-token versions (the servers' own labels, Lemma 1 on every
    logged group), the fates add up, each server's weight syncs timed; after the run both servers
    hold the trainer's final weights (their log-probs are the checkpoint's). The PACE run has the
    servers prefill their requests in flight again at each update (rollout.kv_on_update=recompute);
    its steps take ~0.5 s, and a stale-KV probe that has not returned when the next update comes is
    dropped (all 133 of one run, with the cores shared): it updates every 2 steps, 4 times."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    urls = [s.url for s in servers]
    kv = "recompute" if preset == "pace_tiny" else "keep"  # the servers preempt their requests at each update
    proc = run_train([f"+exp={preset}", *SMALL, f"trainer.steps={steps}", f"rollout.servers=[{','.join(urls)}]",
                      f"trainer.save_every={steps}", f"rollout.sync_every={sync_every}", f"rollout.kv_on_update={kv}",
                      "rollout.kv_probe=1.0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary, metrics, groups = _read(tmp_path)
    assert (summary["status"], summary["steps"], summary["engine_process"]) == ("finished", steps, "server")
    check_staleness(groups, kv=kv)  # versions from the servers' weight_versions (the last chunk of each stream)
    assert (sum(m["rollout/reprefill_tokens"] for m in metrics) > 0) == (kv == "recompute")
    # the probe: tokens generated after an update within one request, against a fresh prefill under
    # the same weights — a stale context's error under keep, none when the servers prefilled them again
    probed = [(m["mismatch/kv_abs_logp_diff"], m["mismatch/kv_tokens"]) for m in metrics if m.get("mismatch/kv_tokens")]
    assert probed, "no response spanned an update and was probed"
    if kv == "recompute":
        assert all(err < 1e-6 for err, _ in probed), probed
    else:
        assert max(err for err, _ in probed) > 1e-6, probed
    _check_accounting(groups, summary)
    assert (groups.versions_spanned > 1).any()  # updates landed while responses were generated
    assert all(m["rollout/engines_alive"] == 2 for m in metrics)
    # a step's wall time counts the publish of its θ (the servers' pause, transfer, resume: long enough to show)
    steps_ = [m for m in metrics if "train/loss" in m]
    assert sum(m["time/publish"] for m in steps_) > 0
    parts = sum(m["time/wait_data"] + m["time/train"] + m["time/sync"] + m["time/publish"] for m in steps_)
    assert sum(m["time/step"] for m in steps_) >= parts
    for e in range(2):  # each server took part in the weight syncs
        assert sum(m[f"rollout/sync_s/engine{e}"] for m in metrics) > 0
    # every sync judged, θ_0's at the start included: each server's fingerprints (over HTTP) were the sent ones
    assert summary["rollout"]["weights_checked"] == summary["rollout"]["syncs"]
    assert {e for engines in groups.engine for e in engines} == {0, 1}  # each response served by one server
    # the reload probe at θ_0's publish (pace/rollout/reload_probe.py): a server fresh from disk is probed and
    # computes the same (dense, float32: exactly); one the module's earlier run updated is named, not probed
    warned = re.findall(r"warning: reload probe: rollout engine (\d) \(http\S+\) has loaded weight updates", proc.stderr)
    assert summary["rollout"]["reload_probe_engines"] + len(warned) == 2, proc.stderr[-3000:]
    if summary["rollout"]["reload_probe_engines"]:
        assert summary["rollout"]["reload_probe_shift"] == 0.0
    assert "error: reload probe" not in proc.stderr
    if preset == "pace_tiny":
        assert summary["rollout"]["rescored"] > 0  # PACE's prefix scoring ran on the servers
        return
    # each server's on-policy tokens at the float floor (float32). An async run has them at step 0
    # only (later, every consumed token is stale), measured on its first mini-batch: maybe one server's
    per_engine = [(k, v) for m in metrics for k, v in m.items() if k.startswith("mismatch/abs_logp_diff/engine")]
    assert per_engine and all(v < 1e-5 for _, v in per_engine), per_engine
    assert {k.rsplit("/", 1)[1] for k, _ in per_engine} <= {"engine0", "engine1"}
    for m in metrics:  # every on-policy token of a response served by one server, counted as that server's
        assert sum(m.get(f"mismatch/tokens/engine{e}", 0) for e in range(2)) == m["mismatch/tokens"], m
    versions = {requests.get(u + "/weight_info", timeout=10).json()["weight_version"] for u in urls}
    version = summary["rollout"]["syncs"] - 1  # θ_0 at the start, then one per update
    assert versions == {str(version)}, versions
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / f"step-{version:06d}" / "model",
                                                 dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(tiny_model_path)("Q: 17+25=? A: 42. 6*7=42", add_special_tokens=False).input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    trainer = [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]
    for url in urls:
        assert _server_logprobs(url, ids) == pytest.approx(trainer, abs=2e-4), url


def _fleet(run_dir) -> list[dict]:
    """The run's servers as its control endpoint describes them (pace/rollout/control.py)."""
    url = json.loads((run_dir / "fleet.json").read_text())["control"]
    return requests.get(url + "/fleet", timeout=10).json()["servers"]


def _when_generating(proc, run_dir, engine: int, timeout: float = 300) -> None:
    """Until server ``engine`` holds requests (a sync run: it generates, no weight update is under way:
    a kill in a broadcast stops any run, README)."""
    deadline = time.monotonic() + timeout
    while not any(s["index"] == engine and s["state"] == "serving" and s["requests"] > 0 for s in _fleet(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_server_is_started_again_and_rejoins_caught_up(tiny_model_path, tmp_path):
    """`train.py` starts two servers; one is SIGKILLed while it generates: its requests go to the
    other, it is started again, joins at the next weight update, caught up with θ whole, and serves
    from there with the trainer's weights (its on-policy mismatch at the float floor from its first
    step back); killed again, the restart budget is spent and the run goes on with the other (its steps
    are many, so that a slow restart cannot outlast them: the test stops it by SIGTERM once it has
    trained a step with the one server left). Lemma 1 holds and the fates add up; its servers are gone after it."""
    cmd = [sys.executable, str(ROOT / "train.py"), "+exp=sync_tiny", *SMALL, "trainer.steps=400", "rollout.engines=2",
           "rollout.max_engine_restarts=1", "rollout.restart_backoff_s=0.5", f"hydra.run.dir={tmp_path}",
           "rollout.weight_delta=true", "rollout.delta_max_frac=1.0",  # float32: ~all elements change a step
           "logger.progress=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = tmp_path / "engines" / "engine1.pid"
    try:
        wait_for_rows(proc, tmp_path, 3)
        first = int(pid_file.read_text())
        _when_generating(proc, tmp_path, 1)
        os.killpg(first, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while not sum(1 for m in _rows(tmp_path) if m.get("mismatch/tokens/engine1", 0) > 0 and
                      m["rollout/engine_restarts"] == 1) >= 2:  # back, and served two steps
            assert proc.poll() is None and time.monotonic() < deadline, "engine 1 did not serve again: " + \
                proc.communicate()[1][-3000:]
            time.sleep(0.2)
        second = int(pid_file.read_text())
        _when_generating(proc, tmp_path, 1)
        os.killpg(second, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while _alive_changes(_rows(tmp_path)) != [2, 1, 2, 1]:  # a step trained with the one server left
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not go on with engine 0: " + \
                proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert second != first
    assert re.search(r"rollout engine 1 \(http://127.0.0.1:\d+\) started again \(restart 1 of at most 1\) at θ_\d+", err), err[-3000:]
    assert "restart budget spent (rollout.max_engine_restarts=1" in err, err[-3000:]
    summary, metrics, groups = _read(tmp_path)
    assert summary["status"] == "interrupted" and summary["steps"] == len(metrics) < 400
    assert summary["rollout"]["engine_failures"] == 2 and summary["rollout"]["engine_restarts"] == 1
    assert summary["rollout"]["engine_joins"] == 1
    assert _alive_changes(metrics) == [2, 1, 2, 1], [m["rollout/engines_alive"] for m in metrics]
    joined = [i for i, m in enumerate(metrics) if m["rollout/engine_join_s"] == m["rollout/engine_join_s"]]
    assert len(joined) == 1 and metrics[joined[0]]["rollout/engine_join_s"] > 0
    # the update it joined at sent θ whole (a delta would find nothing to patch: DeltaMismatch), the
    # next ones deltas again, to it too (each fingerprint-checked on every worker)
    assert metrics[joined[0] - 1]["sync/full"] == 1 and metrics[joined[0]]["sync/full"] == 0
    # from its first step back its tokens are on policy and match the trainer's log-probs (float32)
    back = next(m for m in metrics[joined[0]:] if m.get("mismatch/tokens/engine1", 0) > 0)
    assert metrics.index(back) <= joined[0] + 1, "engine 1 took no request in the step after it joined"
    assert back["mismatch/abs_logp_diff/engine1"] < 1e-5, back["mismatch/abs_logp_diff/engine1"]
    assert max(m.get("mismatch/abs_logp_diff/engine1", 0.0) for m in metrics) < 1e-5
    assert summary["rollout"]["weights_checked"] == summary["rollout"]["syncs"] > 0
    check_staleness(groups)
    _check_accounting(groups, summary, checkpointed=True)
    moved = [int(n) for n in re.findall(r"its (\d+) requests sent to them", err)]
    assert len(moved) == 2 and summary["rollout"]["failover_requests"] == sum(moved)
    # none of the killed server's requests was left behind: at the end every unfinished response
    # still had a request in a live engine
    assert summary["rollout"]["orphaned_responses"] == 0
    # the run stopped its servers; the killed ones are gone (a SIGKILLed engine core's memory takes a
    # moment to free on a loaded machine: up to 10 s)
    for pid in (first, second, int((tmp_path / "engines" / "engine0.pid").read_text())):
        deadline = time.monotonic() + 10
        while True:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process group {pid} outlived the run by 10 s"
            time.sleep(0.2)


def _fleetctl(*args) -> str:
    out = subprocess.run([sys.executable, "-m", "pace.rollout.fleetctl", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_server_joins_a_running_job_and_drains_out(servers, tmp_path):
    """A run on the module's first server; the second joins by the documented command once the run is
    going: it is caught up at the first update that starts after it answers and serves from there (its first step
    at the float floor), then drains out at the next update with nothing dropped, left running and
    resumed (a URL server is not the run's); the run goes on with the first (stopped by SIGTERM two steps
    later). (Before the stop test, which kills the second server.)"""
    urls = [s.url for s in servers]
    cmd = [sys.executable, str(ROOT / "train.py"), "+exp=sync_tiny", *SMALL, "trainer.steps=40",
           f"rollout.servers=[{urls[0]}]", f"hydra.run.dir={tmp_path}", "logger.progress=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_rows(proc, tmp_path, 2)
        _fleetctl("join", urls[1], "--run-dir", str(tmp_path))
        deadline = time.monotonic() + 120
        while sum(1 for m in _rows(tmp_path) if m.get("mismatch/tokens/engine1", 0) > 0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        _fleetctl("drain", urls[1], "--run-dir", str(tmp_path))
        deadline = time.monotonic() + 120
        while not (_alive_changes(rows := _rows(tmp_path)) == [1, 2, 1] and rows[-2]["rollout/engines_alive"] == 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # two steps trained on the first server alone again: enough (40 would be)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    ready = re.search(r"rollout engine 1 \(.*\) answers at θ_(\d+): it joins", err)
    caught_up = re.search(r"rollout engine 1 \(.*\) serves again: caught up with θ_(\d+)", err)
    # sync_every=1: caught up at the first update that starts after it answers, θ_{v+1}; or θ_{v+2} when it
    # answered while the update to θ_{v+1} was under way (past its admission; seen with the cores shared)
    assert ready and caught_up and int(caught_up.group(1)) <= int(ready.group(1)) + 2, err[-3000:]
    assert "rollout engine 1 (" in err and "draining" in err and "left the fleet" in err, err[-3000:]
    summary, metrics, groups = _read(tmp_path)
    assert summary["status"] == "interrupted" and summary["steps"] == len(metrics) < 40
    assert summary["rollout"]["engine_failures"] == 0 and summary["rollout"]["engine_joins"] == 1
    alive = [m["rollout/engines_alive"] for m in metrics]
    assert _alive_changes(metrics) == [1, 2, 1], alive
    served = [m for m in metrics if m.get("mismatch/tokens/engine1", 0) > 0]
    assert served and max(m["mismatch/abs_logp_diff/engine1"] for m in served) < 1e-5
    check_staleness(groups)
    _check_accounting(groups, summary, checkpointed=True)
    assert summary["rollout"]["orphaned_responses"] == 0 and summary["fates"]["dropped_shutdown"] == 0
    assert summary["rollout"]["failover_lost_tokens"] == 0  # its requests finished before it left
    # a server given by URL is not the run's: left running, resumed
    assert requests.get(urls[1] + "/health", timeout=10).status_code == 200
    assert requests.get(urls[1] + "/is_paused", timeout=10).json()["is_paused"] is False
    rate = lambda rows: sum(m["rollout/tokens_per_s"] for m in rows) / max(len(rows), 1)  # noqa: E731
    first, last = alive.index(2), len(alive) - 1 - alive[::-1].index(2)
    print(f"tokens/s: one server {rate(metrics[1:first]):.0f}, two {rate(metrics[first:last + 1]):.0f}, "
          f"one again {rate(metrics[last + 1:]):.0f}")


def test_a_killed_server_stops_the_run_with_a_checkpoint(servers, tmp_path):
    """`rollout.on_engine_failure=stop`: the run stops within 30 s of the kill, naming the engine
    in one line, with a checkpoint. (Kills the module's second server: the last test here. No weight
    sync after the first, so that the kill cannot land in a broadcast, which stops any run: README.)"""
    urls = [s.url for s in servers]
    cmd = [sys.executable, str(ROOT / "train.py"), "+exp=async_tiny", *SMALL, "trainer.steps=20",
           f"rollout.servers=[{','.join(urls)}]", "rollout.on_engine_failure=stop", "rollout.sync_every=100",
           f"hydra.run.dir={tmp_path}", "logger.progress=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_rows(proc, tmp_path, 2)
        servers[1].kill(timeout=0.1)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 1 and took < 30, (took, err[-3000:])
    assert f"error: rollout engine 1 ({urls[1]}) failed:" in err and "Traceback" not in err, err[-3000:]
    summary, _, _ = _read(tmp_path)
    assert summary["status"] == "failed" and summary["checkpoint"]
    assert (tmp_path / "checkpoints" / f"step-{summary['steps']:06d}" / "run_state.pkl").exists()
