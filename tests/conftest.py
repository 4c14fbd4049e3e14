"""Shared fixtures. The engine environment must be set before vLLM or torch are imported."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
BENCH = SHARED / "benchmarks"


def needs_shared(*paths: Path) -> pytest.MarkDecorator:
    """Skip a test that reads ``paths`` (copies in ../shared) when they are missing on a developer's
    machine; in CI (``CI`` set) they must be there, so the test runs and fails instead of skipping."""
    missing = [p for p in paths if not p.exists()]
    return pytest.mark.skipif(bool(missing) and not os.environ.get("CI"),
                              reason=f"shared copies not found: {', '.join(map(str, missing))}")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The default tiny model, built once into the repo cache (the same one `python train.py` uses)."""
    from pace.tiny import TinySpec, build_tiny

    return str(build_tiny(TinySpec(), ROOT / "data" / "cache", progress=False))


@pytest.fixture(scope="session")
def tiny_tool_model_path() -> str:
    """The tiny tool-use model of conf/model/tiny_tool.yaml (what the *_tiny_tool presets build)."""
    from omegaconf import OmegaConf

    from pace.tiny import TinySpec, build_tiny

    spec = OmegaConf.merge(OmegaConf.structured(TinySpec), OmegaConf.load(ROOT / "conf/model/tiny_tool.yaml").tiny)
    return str(build_tiny(OmegaConf.to_object(spec), ROOT / "data" / "cache", progress=False))


def run_train(args: list[str], run_dir: Path, timeout: float = 600, **kw):
    """Run train.py in a subprocess with its run directory at ``run_dir``."""
    import subprocess

    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}", "logger.progress=false"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def wait_for_rows(proc, run_dir: Path, rows: int, timeout: float = 300) -> None:
    """Wait until a train.py started with Popen has logged ``rows`` metrics rows (fails if it exits)."""
    import time

    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)


def pytest_collection_modifyitems(items):
    """Every test not marked `integration` is a fast `unit` test."""
    for item in items:
        if "integration" not in item.keywords:
            item.add_marker(pytest.mark.unit)


def check_staleness(groups) -> None:
    """Every decided, complete group: the logged staleness equals the recomputed one, no token is
    newer than its response's completion, and no response completed after the step it was decided."""
    from analysis.runs import recomputed_staleness

    decided = groups.dropna(subset=["k"])
    assert len(decided) > 0
    for _, row in decided.iterrows():
        k, k_gen, k_wait = recomputed_staleness(row)
        assert abs(row.k - k) < 1e-9 and abs(row.k_gen - k_gen) < 1e-9 and abs(row.k_wait - k_wait) < 1e-9, row.id
        for spans, c in zip(row.version_spans, row.completed_at):
            assert max(spans[0::2]) <= c <= row.step and list(spans[0::2]) == sorted(spans[0::2]), row.id


def check_continued(state: dict, groups, version: int, later: dict | None = None) -> tuple[int, int]:
    """The groups a checkpoint kept in flight (``state``: its run_state.pkl) were continued by the
    resumed run from θ_``version``, which logged ``groups`` (and wrote the checkpoint ``later``).
    Each is logged once (decided, or in flight at the end). Every response cut short keeps its
    tokens: in ``later`` (pooled or still in flight there) token for token, ids, ℓ^μ and versions;
    in the logged records its versions and `resumed_tokens`; the tokens after them come from
    θ_version or later. Returns (responses compared token for token, responses checked in the records)."""
    import numpy as np

    kept = state["rollout"]["inflight"]
    assert kept and {getattr(k, "group", k).id for k in kept} == {g.id for g in state["pool"]["inflight"]}
    after = {}
    for item in ([] if later is None else [*later["pool"]["pooled"], *later["rollout"]["inflight"]]):
        group = getattr(item, "group", item)
        responses = item.responses if hasattr(item, "group") else dict(enumerate(item.trajectories))
        after.update({(group.id, i): t for i, t in responses.items()})
    rows = groups.set_index("id")
    assert rows.loc[[getattr(k, "group", k).id for k in kept]].index.is_unique
    compared = checked = 0
    for item in kept:
        if not hasattr(item, "group"):  # it was being graded: complete already
            continue
        row = rows.loc[item.group.id]
        for i, traj in item.responses.items():
            if traj.completed_at >= 0 or len(traj) == 0:
                continue
            n = len(traj)
            t = after.get((item.group.id, i))
            if t is not None and len(t) > n:
                assert t.response_ids[:n].tolist() == traj.response_ids.tolist()
                assert t.logprobs[:n].tolist() == traj.logprobs.tolist() and t.resumed == n
                assert t.versions[:n].tolist() == traj.versions.tolist() and (t.versions[n:] >= version).all()
                compared += 1
            if row.fate != "inflight":  # a record with its tokens' versions
                spans = row.version_spans[i]
                versions = np.repeat(spans[0::2], spans[1::2])
                assert row.resumed_tokens[i] == n, (item.group.id, i)
                assert versions[:n].tolist() == traj.action_versions.tolist()
                assert (versions[n:] >= version).all() and row.completed_at[i] >= version
                checked += 1
    return compared, checked
