"""Helpers shared by test modules (imported as ``from tests.helpers import ...``); fixtures and the
suite's tiers are in tests/conftest.py. A test module imports from here, never from another test module."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

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


# ---------------------------------------------------------------- the grader's test hook

# ``_test_fn`` is the hook passed as ``Grader(fn=...)``: it hangs, crashes, raises or sleeps on a
# sentinel response, so production code carries no test-only sentinels.
HANG, CRASH, RAISE, SLOW = "__test_hang__", "__test_crash__", "__test_raise__", "__test_slow__"


def _test_fn(responses: list[str], golds: list[str]) -> list[bool]:
    """Worker-side test hook: must be a top-level function so spawn can pickle it by name."""
    from pace.reward import grade_batch

    if HANG in responses:
        time.sleep(3600)
    if CRASH in responses:
        os._exit(1)
    if RAISE in responses:
        raise RuntimeError("grading bug")
    if SLOW in responses:
        time.sleep(1.5)
    return grade_batch(responses, golds)


# ---------------------------------------------------------------- adversarial model outputs

ADVERSARIAL = {
    "empty": "",
    "no_answer": "I refuse to answer.",
    "million_chars": "a" * 1_000_000,
    "million_chars_then_answer": "(" * 1_000_000 + "\nAnswer: 25",
    "huge_number": "Answer: 9" + "9" * 10_000,
    "huge_number_in_tail": "Answer: 9" + "9" * 3_000,
    "latex_soup": "Answer: " + "\\frac{" * 150,
    "latex_soup_long": "Answer: " + "\\frac{\\frac{\\frac{" * 2_000,
    "boxed_soup": "\\boxed{" * 600,
    "tower": "Answer: 10^{10^{10^{10}}}",
    "unicode": "Answer: \ud800\udfff ☃ 𝔸 \u202e ﷽",
    "null_bytes": "Answer: \x00\x00 25 \x00",
    "dollars": "Answer: " + "$" * 3_990,
    "only_marker": "Answer:",
}
