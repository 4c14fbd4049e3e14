"""Two real trainer processes on CPU (`torchrun --nproc_per_node 2`, gloo): the rank-0 batch
scattered in shares, token normalisation across ranks, the LR schedule per update, and `train.py`
with the rollout engine in its own process, weight syncs through vLLM's weight transfer,
checkpoints written by both ranks and a resume of them.

Each launched program reports how many processes it ran as (`PROCESSES`, `summary.json`
"processes"): `accelerate launch --cpu --num_processes 2` starts one, which is what the earlier
version of these tests compared with one."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from tests.helpers import ROOT, check_staleness

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess]


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]


DDP_LAYOUTS = ["count", "tokens", "packed"]
FSDP_LAYOUTS = ["fsdp_every", "fsdp_last"]
M2PO_LAYOUTS = ["m2po_count", "m2po_tokens"]  # M2PO's mask decided over every rank's micro-batches


def _steps(n: int, model: str, layouts: list[str]) -> tuple[dict, dict, dict]:
    """Per layout: the two steps' metrics, the weights' checksum after them, empty micro-batches planned."""
    cmd = [*torchrun(n), str(ROOT / "tests/integration/ddp_step.py"), model, *layouts]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert f"PROCESSES {n} {n}" in lines, proc.stdout[-2000:]
    tagged = lambda tag: [json.loads(line[len(tag) + 1:]) for line in lines if line.startswith(tag + " ")]  # noqa: E731
    metrics = {layout: [m for m in tagged("METRICS") if m["layout"] == layout] for layout in layouts}
    weights = {w["layout"]: w["checksum"] for w in tagged("WEIGHTS")}
    empty = {e["layout"]: e["empty"] for e in tagged("EMPTY")}
    return metrics, weights, empty


def test_updates_do_not_depend_on_the_number_of_processes_or_the_micro_batch_layout(tiny_model_path):
    """One process vs two (DDP, and FSDP2 with reduce-scatter after every micro-batch or `no_sync`
    until the last), micro-batches by count or by a token budget (padded, packed; a rank then runs
    an empty zero-weight micro-batch): the same losses, gradient norms, LR and weights."""
    one, one_w, _ = _steps(1, tiny_model_path, DDP_LAYOUTS + M2PO_LAYOUTS[:1])
    two, two_w, empty = _steps(2, tiny_model_path, DDP_LAYOUTS + FSDP_LAYOUTS + M2PO_LAYOUTS)
    ref = one["count"]
    assert len(ref) == 2 and ref[1]["train/lr"] > ref[0]["train/lr"]  # still warming up: a schedule stepped N times would differ
    runs = [(f"1 process, {k}", one[k], one_w[k]) for k in one] + [(f"2 processes, {k}", two[k], two_w[k]) for k in two]
    for name, steps, checksum in runs:
        base = "m2po_count" if "m2po" in name else "count"
        assert len(steps) == 2, name
        for a, b in zip(one[base], steps):
            keys = ["train/loss", "train/grad_norm", "train/entropy", "train/ratio_mean", "train/clipfrac"]
            keys += ["m2po/masked_frac", "m2po/m2", "m2po/m2_after"] if base == "m2po_count" else []
            for key in keys:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (name, key)
            assert b["train/lr"] == pytest.approx(a["train/lr"], rel=1e-9), name  # once per update, not once per process
            mismatch = sorted(k for k in a if k.startswith("mismatch/"))  # overall and per engine (step 0)
            assert sorted(k for k in b if k.startswith("mismatch/")) == mismatch, name
            for key in mismatch:
                assert b[key] == pytest.approx(a[key], rel=1e-4), (name, key)
        assert checksum == pytest.approx(one_w[base], rel=1e-6, abs=1e-6), name
    m2po = one["m2po_count"][0]
    assert 0 < m2po["m2po/masked_frac"] < m2po["m2po/trust_region_frac"] < 1, m2po  # a partial mask: the case can fail
    assert m2po["train/loss"] != pytest.approx(ref[0]["train/loss"], rel=1e-3)
    assert all(empty[k] >= 1 for k in ["tokens", "packed", *FSDP_LAYOUTS]), empty  # the zero-weight pass ran
    assert two["packed"][0]["train/pad_frac"] == 0.0 and two["count"][0]["train/pad_frac"] > 0
    # step 0 is on policy: engines 0, 1, 2 measured apart; the response of several engines only in the total
    first = ref[0]
    per_engine = [first[f"mismatch/tokens/engine{i}"] for i in range(3)]
    assert all(n > 0 for n in per_engine) and "mismatch/tokens/engine3" not in first
    assert 0 < first["mismatch/tokens"] - sum(per_engine) < first["mismatch/tokens"]


def _run(args: list[str], n: int = 2, timeout: int = 600, cwd=ROOT, script: str = "train.py", env=None):
    proc = subprocess.run([*torchrun(n), str(ROOT / script), *args, "logger.progress=false"],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_two_process_train_run_checkpoint_and_resume(tiny_model_path, tmp_path):
    """Started as launchers start ranks: rank 1 two seconds after rank 0 (another second: its own
    `now`), in the default run directory `runs/<exp_name>/<time>`, and rank 0 reading the training
    set 8 s, then forming its first batch 10 s late, while rank 1 would wait in the trainer's first
    collective under a 5 s timeout. Every rank writes into rank 0's run directory (rank 1's shards
    are in rank 0's checkpoints, none left elsewhere); rank 1 waits for the data, and for rank 0's
    slow start (engine start, first batch), in pace/control.py's own group, not under the trainer's
    collective timeout (the run died in that timeout when the decision was one)."""
    import os

    import pandas as pd

    env = {**os.environ, "PACE_FAULT": "late_rank@2,slow_data@8,slow_first_batch@10"}
    proc = _run(["+exp=async_tiny", "trainer.steps=5", "trainer.save_every=3", "data.batch_prompts=4",
                 "rollout.max_inflight_groups=12", "eval.every=3", "eval.at_start=false", "data.arithmetic.n_val=24",
                 "logger.mode=disabled", "trainer.dist_timeout_s=5", f"model.cache_dir={ROOT / 'data' / 'cache'}"],
                cwd=tmp_path, script="tests/integration/faulty_train.py", env=env)
    assert "injected: training set read 8 s late" in proc.stderr  # the faults ran (on rank 0)
    assert "injected: first batch held 10 s" in proc.stderr
    made = list((tmp_path / "runs" / "async_tiny").iterdir())
    assert len(made) == 1, made  # one run directory, rank 0's: no other rank's (nor its Hydra output)
    run = made[0]
    assert (run / ".hydra" / "config.yaml").exists() and (run / "train.log").exists()  # Hydra's output: rank 0's
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["engine_process"] == "child"
    assert summary["status"] == "finished" and summary["steps"] == 5 and summary["rollout"]["syncs"] >= 3
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [0, 1, 2, 3, 4]
    assert [m["val/version"] for m in metrics if "val/avg" in m] == [3, 5]
    ckpt = run / "checkpoints" / "step-000003"
    written = {p.name for p in ckpt.iterdir()}
    assert {"run_state.pkl", "random_states_0.pkl", "random_states_1.pkl", "optimizer.bin", "model"} <= written
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000003", "step-000005"]  # no .tmp left
    assert (ckpt / "model" / "model.safetensors").exists() and (ckpt / "model" / "config.json").exists()
    first = pd.read_parquet(run / "groups")
    check_staleness(first)  # versions from vLLM's weight_versions spans (the engine core runs in its own process)
    assert (first.versions_spanned > 1).any()  # updates landed while responses were generated

    # both ranks resume from step 3: rank 0 the pool, every rank the trainer; steps 3 and 4 run again
    _run([f"resume={ckpt}"], cwd=tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["status"] == "finished" and summary["steps"] == 5
    assert summary["resumed_from"].endswith("step-000003")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [0, 1, 2, 3, 4]
    groups = pd.read_parquet(run / "groups")
    check_staleness(groups)
    consumed = groups[groups.fate == "consumed"]
    assert consumed.id.is_unique  # no group trained twice across the resume
    assert len(consumed) == 5 * 4
    fates = summary["fates"]
    assert fates["submitted"] == sum(v for k, v in fates.items() if k != "submitted")
    # the groups in flight at the periodic checkpoint were kept, with exact versions from the engine's
    # own labels (its engine core is another process), and continued: token for token where the final
    # checkpoint holds them, versions and resumed_tokens in the records
    from tests.helpers import check_continued

    state = pickle.loads((ckpt / "run_state.pkl").read_bytes())
    later = pickle.loads((run / "checkpoints" / "step-000005" / "run_state.pkl").read_bytes())
    compared, checked = check_continued(state, groups, 3, later)
    assert compared + checked > 0 and summary["rollout"]["resumed_groups"] == len(state["rollout"]["inflight"])


def test_fsdp_config_prepares_the_presets_architectures():
    """conf/accelerate/fsdp.yaml (FSDP2, wrap by `_no_split_modules`, sharded state dict) prepares a
    tiny model of the dense and of the 30B-A3B presets' MoE architecture on 2 CPU processes through
    Accelerate's FSDP2 preparation (fsdp_prepare.py says why not `Accelerator.prepare` itself); each
    decoder layer is its own FSDP unit, one update and one full-tensor gather run, and the weight
    sync's source yields every parameter in full. A delta sync of that update, planned from each
    rank's shard (the embedding split unevenly), rebuilds the whole bf16 casts bit for bit; so does
    one where both ranks hold copies (HSDP replicas, plain tensors), each element reported once."""
    proc = subprocess.run([*torchrun(2), str(ROOT / "tests/integration/fsdp_prepare.py"), "dense", "moe", "hsdp", "plain"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = [json.loads(line[len("PREPARED "):]) for line in proc.stdout.splitlines() if line.startswith("PREPARED ")]
    assert [o["arch"] for o in outs] == ["dense", "moe"]
    for out, unit in zip(outs, ["Qwen3DecoderLayer", "Qwen3MoeDecoderLayer"]):
        assert out["processes"] == 2 and "SHARDED_STATE_DICT" in out["state_dict_type"]
        assert unit in out["units"], out["units"]
        assert out["sharded"] == "DTensor" and out["source_ok"]  # the weight sync gathers every parameter in full
        # a delta sync (pace/weights/delta.py): each rank diffed its shard, rank 0 gathered the changes
        delta = out["delta"]
        assert not delta["full"] and 0 < delta["changed"] < delta["total"], delta
        assert delta["exact"] and delta["count"] and delta["prints"], delta
    # each element once where the ranks hold copies: HSDP's replicas of a shard, plain tensors without FSDP
    copies = [json.loads(line[len("REPLICATED "):]) for line in proc.stdout.splitlines() if line.startswith("REPLICATED ")]
    assert [c["kind"] for c in copies] == ["hsdp", "plain"]
    assert all(c["exact"] and c["count"] and c["prints"] and not c["full"] for c in copies), copies


def test_fsdp2_ranks_above_0_build_the_model_on_meta_and_train_as_before(tmp_path):
    """Under FSDP2 with `fsdp_cpu_ram_efficient_loading` (conf/accelerate/*.yaml, as `accelerate
    launch` sets it), rank 1 builds the model on the meta device: when Accelerate's preparation
    starts it holds no parameter bytes, where the trainer's load before (every rank
    `from_pretrained`) held the whole model (transformers' zeros: bf16 for the 30B-A3B, 61 GB on
    each rank >= 1). After `prepare` both ranks hold the checkpoint's weights upcast to fp32, bit for
    bit, and a direct load's buffers; a DAPO step gives the load before's loss, gradient norm and
    weights, bit for bit. A tiny dense and a tiny MoE (the 30B-A3B's architecture) bf16 checkpoint
    (fsdp_load.py)."""
    import os

    sys.path.insert(0, str(ROOT / "scripts"))
    import smoke_setup

    paths = [smoke_setup.write_model(tmp_path / "dense", {**smoke_setup.QWEN3_8B, **smoke_setup.TINY}, 2, tiny=True),
             smoke_setup.write_model(tmp_path / "moe", {**smoke_setup.QWEN3_30B_A3B, **smoke_setup.TINY_MOE}, 2, tiny=True)]
    env = dict(os.environ, FSDP_CPU_RAM_EFFICIENT_LOADING="true", OMP_NUM_THREADS="1")  # as accelerate launch sets it
    proc = subprocess.run([*torchrun(2), str(ROOT / "tests/integration/fsdp_load.py"), *map(str, paths)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = [json.loads(line[len("LOADED "):]) for line in proc.stdout.splitlines() if line.startswith("LOADED ")]
    assert [o["path"] for o in outs] == list(map(str, paths))
    for out in outs:
        meta, before = out["meta"], out["before"]
        rank0, rank1 = meta["ranks"]
        assert rank1["devices"] == ["meta"] and rank1["bytes"] == 0, rank1  # nothing materialised on rank 1
        assert rank0["devices"] == ["cpu"] and rank0["bytes"] == rank0["whole"] > 0, rank0  # rank 0 loads it, in bf16
        assert before["ranks"][1]["devices"] == ["cpu"] and before["ranks"][1]["bytes"] == rank0["whole"]  # as it was
        assert all(r["exact"] and r["buffers"] for r in meta["ranks"] + before["ranks"]), out
        assert (meta["loss"], meta["grad_norm"]) == (before["loss"], before["grad_norm"]) and out["same_after_step"], out
        assert meta["grad_norm"] > 0


@pytest.mark.parametrize("ending", ["destroy", "end_processes"])
def test_a_gloo_worker_freeing_tensors_at_the_end_aborts_the_exit_but_not_end_processes(tmp_path, ending):
    """The flaky teardown abort ("terminate called without an active exception" after a program's
    results) made certain (teardown_race.py): rank 0's gloo worker waits for the GIL to free a
    collective's tensors while the main thread ends. Ended as the programs were (the process group
    destroyed, then the interpreter's exit), rank 0 aborts; ended with pace.teardown.end_processes,
    which every multi-process program now uses, both ranks exit 0. If torch ever frees those tensors
    without the GIL, the first case fails: the cause is gone."""
    import os

    env = {**os.environ, "TEARDOWN_READY": str(tmp_path / "ready")}
    proc = subprocess.run([*torchrun(2), str(ROOT / "tests/integration/teardown_race.py"), ending], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, env=env)
    assert "GATHERED [1.0, 2.0]" in proc.stdout, proc.stderr[-3000:]  # the all-gather ran on both ranks
    if ending == "destroy":
        assert proc.returncode != 0, proc.stderr[-3000:]
        assert "terminate called without an active exception" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "terminate called" not in proc.stderr


# (one trainer process with two child engines over gloo: test_delta_sync.py's runs, on policy at every sync)
@pytest.mark.parametrize("processes, engines", [(2, 2)])
def test_several_child_engines_take_weights_over_gloo_and_stay_on_policy(tiny_model_path, tmp_path, processes, engines):
    """The NCCL protocol over TCP (rollout.weight_transfer=gloo): trainer rank 0 and every engine
    worker in one group, each engine's workers at their own ranks, every engine called at once.
    A sync run's tokens are all on-policy, so its mismatch says every engine computes with the
    trainer's weights after each sync. With the engines' ranks equal, or called one after another,
    the rendezvous never completes (the run hangs: this test's timeout).
    No host copy of θ reaches the validation over gloo: the trainer copies each validated version
    for <run>/best (every rank gathers it), here θ_2 (the best within 2 updates), checkpointed too."""
    launcher = [*torchrun(processes)] if processes > 1 else [sys.executable]
    cmd = [*launcher, str(ROOT / "train.py"), "+exp=sync_tiny", "trainer.steps=3", "data.batch_prompts=8", f"rollout.engines={engines}",
           "rollout.engine_process=child", "rollout.weight_transfer=gloo", "logger.mode=disabled",
           "eval.every=2", "eval.at_start=false", "eval.k=2", "data.arithmetic.n_val=8", "eval.best_within=2",
           "trainer.save_every=2", "logger.progress=false", f"hydra.run.dir={tmp_path}"]
    import os
    import signal

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a hang is killed whole, engines too
    try:
        _, err = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the run hung (a rendezvous or broadcast that never completes)")
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["processes"], summary["engine_process"], summary["status"]) == (processes, "child", "finished")
    assert summary["rollout"]["syncs"] == 3
    assert summary["rollout"]["weights_checked"] == 3  # every worker's fingerprints (child processes) were the sent ones
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    mismatch = [m["mismatch/abs_logp_diff"] for m in metrics if "mismatch/abs_logp_diff" in m]
    assert len(mismatch) == 3 and max(mismatch) < 5e-6, mismatch  # float32 rounding: ~4e-7 measured
    import torch
    from safetensors.torch import load_file

    assert json.loads((tmp_path / "best.json").read_text()) == {"version": 2, "val/avg": summary["best"]["val/avg"],
                                                                 "path": str(tmp_path / "best")}
    best = load_file(tmp_path / "best" / "model.safetensors")
    saved = load_file(tmp_path / "checkpoints" / "step-000002" / "model" / "model.safetensors")
    assert best.keys() == saved.keys() and all(torch.equal(best[k], saved[k]) for k in best)
    assert json.loads((tmp_path / "best" / "version.json").read_text()) == {"version": 2}  # what best/ holds, in it
    assert not (tmp_path / "best-candidates").exists()  # θ_2's copy became best/; none other left at the end
    assert summary["best_copies"]["count"] == 1  # θ_3 is past eval.best_within: not copied


def _signal(proc, target: str) -> None:
    """SIGTERM as a launcher or a cluster sends it: to torchrun alone (it signals each rank's process
    group, the engines and graders included), or to every process of the job (Slurm's scancel)."""
    import os
    import signal

    import psutil

    if target == "torchrun":
        os.kill(proc.pid, signal.SIGTERM)
        return
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in family:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass


@pytest.mark.parametrize("target, rows", [("torchrun", 3), ("everyone", 5)])
def test_a_sigterm_to_a_two_process_run_always_checkpoints(tiny_model_path, tmp_path, target, rows):
    """A preemption signals every process; the engine (in its own process) and the grading workers
    leave the signal to the run (pace/signals.py), which finishes the step in progress, checkpoints
    and exits within torchrun's grace period (30 s, then SIGKILL). Before, the engine's worker died
    on the signal and rank 0 could hang on it until the SIGKILL: no checkpoint, no summary.json.
    The checkpoint keeps the groups in flight at the stop whole: none dropped, none of their tokens
    cut for want of the engine's version labels. (A resume of such a checkpoint continues them: the
    one-process run of test_resume.py; a two-process run from a periodic checkpoint: the test above.)"""
    import os
    import signal
    import time

    from tests.helpers import wait_for_rows

    run = tmp_path / "run"
    cmd = [*torchrun(2), str(ROOT / "train.py"), "+exp=async_tiny", "trainer.steps=40", "data.batch_prompts=8",
           "rollout.max_inflight_groups=32", "eval.every=0", "trainer.save_every=0", "logger.mode=disabled",
           "logger.progress=false", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_rows(proc, run, rows)
        _signal(proc, target)
        t0 = time.time()
        _, err = proc.communicate(timeout=90)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads((run / "summary.json").read_text())  # written, not lost to a SIGKILL
    assert summary["processes"] == 2 and summary["engine_process"] == "child"
    assert summary["status"] == "interrupted" and summary["checkpoint"], err[-3000:]
    assert took < 30 and "forcefully exiting via 9" not in err, (took, err[-3000:])
    # the engine outlived the signal: no engine core or worker failed, and the rollout thread stopped
    for death in ("Process EngineCore:", "died unexpectedly", "EngineCore encountered a fatal error", "did not stop within"):
        assert death not in err, (death, err[-3000:])
    ckpt = run / "checkpoints" / f"step-{summary['steps']:06d}"
    assert (ckpt / "run_state.pkl").exists() and summary["steps"] >= rows
    state = pickle.loads((ckpt / "run_state.pkl").read_bytes())
    assert state["rollout"]["inflight"] and summary["fates"]["inflight"] == len(state["pool"]["inflight"])
    assert summary["fates"]["dropped_shutdown"] == 0 and summary["rollout"]["resume_unlabelled_tokens"] == 0


def test_a_rollout_failure_on_rank_0_stops_every_rank_with_a_checkpoint_and_resume_finishes(tiny_model_path, tmp_path):
    """Rank 0's rollout thread dies — an injected fault once θ_3 exists (in training), and in the resumed run
    once θ_6, the last, exists (inside the final validation): each time every rank leaves the run with rank 0
    and writes the checkpoint with it (rank 1's shard beside rank 0's), each exits naming the cause, and a
    last `resume=` finishes the run (the final validation redone). Before, rank 1 went on to its exit while
    rank 0 waited for it in the checkpoint's first barrier (no checkpoint, rank 0 held until the control
    timeout); a final validation that could not run lost the end-of-training checkpoint."""
    import os

    run = tmp_path / "run"
    args = ["+exp=async_tiny", "trainer.steps=6", "data.batch_prompts=4", "rollout.max_inflight_groups=12", "eval.every=3",
            "data.arithmetic.n_val=24", "eval.at_start=false", "trainer.save_every=0", "logger.mode=disabled",
            "logger.progress=false", "trainer.control_timeout_s=120", f"hydra.run.dir={run}",
            f"model.cache_dir={ROOT / 'data' / 'cache'}"]

    def stopped(fault: str, args: list[str]) -> dict:
        proc = subprocess.run([*torchrun(2), str(ROOT / "tests/integration/faulty_train.py"), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, env={**os.environ, "PACE_FAULT": fault})
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "error: stopped with trainer rank 0 (rollout failure: RuntimeError)" in proc.stderr, proc.stderr[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["processes"] == 2 and summary["checkpoint"]
        ckpt = run / "checkpoints" / f"step-{summary['steps']:06d}"
        written = {p.name for p in ckpt.iterdir()}
        assert {"run_state.pkl", "random_states_0.pkl", "random_states_1.pkl"} <= written, written  # by both ranks
        assert json.loads((ckpt / "meta.json").read_text())["reason"] == "rollout failure: RuntimeError"
        return summary

    in_training = stopped("rollout@3", args)
    assert in_training["steps"] in (3, 4)  # θ_3 exists; a batch ready may train
    in_validation = stopped("rollout@6", [f"resume={run}", "logger.progress=false"])
    assert in_validation["steps"] == 6 and in_validation["resumed_from"].endswith(f"step-{in_training['steps']:06d}")
    resumed = subprocess.run([*torchrun(2), str(ROOT / "train.py"), f"resume={run}", "logger.progress=false"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((run / "summary.json").read_text())
    assert after["status"] == "finished" and after["steps"] == 6 and after["processes"] == 2
    fates = after["fates"]
    assert fates["submitted"] == sum(v for k, v in fates.items() if k != "submitted")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 6 in [m["val/version"] for m in metrics if "val/avg" in m]  # θ_6's, which the failure cut, redone
