"""In-training validation pieces without an engine: metric names, the best checkpoint, and the
eval grading path (`EvalRun`) fed malformed model outputs.

`EvalRun` is given hand-made engine outputs here (a recorder stands in for the engine's
`add_request`) so that outputs no tiny model would write reach the real grader: no answer, huge
numbers, LaTeX soup, megabyte strings, and a grader that hangs.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from test_grading import HANG, _test_fn
from test_reward import ADVERSARIAL

from pace.evaluation import EvalRun, summarize
from pace.grading import Grader
from pace.rollout.worker import Validation
from pace.tasks.base import Prompt
from pace.validation import BestCheckpoint, save_weights, val_metrics


def _validation(version, results, weights=None):
    return Validation(version=version, results=results, seconds=1.5, response_len=20.0, weights=weights)


def test_val_metric_names_follow_design():
    m = val_metrics(_validation(7, {"arith_l1": [[True, False]], "arith_l2": [[False, False]]}), k=2)
    assert m == {"val/arith_l1/mean@2": 0.5, "val/arith_l2/mean@2": 0.0, "val/avg": 0.25,
                 "val/version": 7, "val/response_len": 20.0, "time/validate": 1.5}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"original weights")
    (d / "model.safetensors.index.json").write_text("{}")
    return d


def _weights(value: float):
    return [("a.weight", torch.full((2, 3), value)), ("b.bias", torch.arange(3.0)[::2])]  # a non-contiguous view


def test_save_weights_writes_a_loadable_directory(tmp_path, model_dir):
    from safetensors.torch import load_file

    out = tmp_path / "run" / "best"
    out.parent.mkdir()
    save_weights(out, _weights(1.0), str(model_dir))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = load_file(out / "model.safetensors")
    assert torch.equal(loaded["a.weight"], torch.ones(2, 3)) and torch.equal(loaded["b.bias"], torch.tensor([0.0, 2.0]))
    save_weights(out, _weights(2.0), str(model_dir))  # replaced whole, no leftovers beside it
    assert torch.equal(load_file(out / "model.safetensors")["a.weight"], torch.full((2, 3), 2.0))
    assert sorted(p.name for p in out.parent.iterdir()) == ["best"]


def test_best_checkpoint_keeps_the_highest_average_within_n(tmp_path, model_dir):
    from safetensors.torch import load_file

    best = BestCheckpoint(tmp_path, str(model_dir), within=20)
    offers = [(0, 0.30, None), (10, 0.50, _weights(10.0)), (15, 0.50, _weights(15.0)),  # a tie keeps 10
              (20, 0.45, _weights(20.0)), (25, 0.90, _weights(25.0))]  # 25 is past N = 20
    kept = [best.offer(_validation(v, {}, w), avg) for v, avg, w in offers]
    assert kept == [True, True, False, False, False]
    assert best.best == {"version": 10, "val/avg": 0.50, "path": str(tmp_path / "best")}
    assert torch.equal(load_file(tmp_path / "best" / "model.safetensors")["a.weight"], torch.full((2, 3), 10.0))
    assert json.loads((tmp_path / "best.json").read_text()) == best.best
    s = best.summary()
    assert s["best_within"] == 20 and [h["version"] for h in s["validations"]] == [0, 10, 15, 20, 25]


def test_best_checkpoint_version_0_names_the_model_on_disk(tmp_path, model_dir):
    best = BestCheckpoint(tmp_path, str(model_dir), within=None)
    assert best.offer(_validation(0, {}), 0.4)
    assert best.offer(_validation(5, {}, _weights(5.0)), 0.3) is False
    assert best.best["path"] == str(model_dir) and not (tmp_path / "best").exists()


def test_without_a_host_copy_the_best_is_its_checkpoint_and_outlives_keep_checkpoints(tmp_path, model_dir, monkeypatch):
    """NCCL/IPC/gloo: no `best/` copy; θ_v's checkpoint names it, and pruning keeps it while it is the best."""
    from safetensors.torch import load_file

    from pace import checkpoint

    class _Trainer:
        version = 0

        def save(self, path):
            path.mkdir(parents=True)

        def state_dict(self):
            return {}

    monkeypatch.setattr(checkpoint, "capture", lambda parts: b"")
    run, trainer = tmp_path / "run", _Trainer()
    acc = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    ck = checkpoint.Checkpointer(run, acc, trainer, {}, keep=2, model_path=str(model_dir))
    ck.weights = lambda v: _weights(float(v))
    best = BestCheckpoint(run, str(model_dir), within=None)
    ck.protect, ck.on_saved = best.protected, best.saved

    def step(version, avg=None):  # θ_v checkpointed (every 10 here), then published and validated
        trainer.version = version
        if version % 10 == 0:
            ck.save("every 10 steps", None)
        if avg is not None:
            best.offer(_validation(version, {}), avg)

    def on_disk():
        return [p.name for p in checkpoint.list_checkpoints(run)]

    step(10, 0.5)
    assert best.best["path"] == str(run / "checkpoints" / "step-000010" / "model")
    assert torch.equal(load_file(f"{best.best['path']}/model.safetensors")["a.weight"], torch.full((2, 3), 10.0))
    step(15, 0.9)  # the best, never checkpointed: nothing to name
    assert best.best == {"version": 15, "val/avg": 0.9, "path": None} and best.protected() is None
    step(20), step(30)
    assert on_disk() == ["step-000020", "step-000030"]  # 10 is no longer the best: pruned
    step(40, 0.95)
    step(50), step(60), step(70, 0.2)
    assert on_disk() == ["step-000040", "step-000060", "step-000070"]  # the best's checkpoint stays
    assert json.loads((run / "best.json").read_text())["path"].endswith("step-000040/model")
    trainer.version = 80
    best.offer(_validation(80, {}), 0.99)  # the final version: validated before its checkpoint exists
    assert best.best["path"] is None
    ck.save("end of training", None)
    assert best.best["path"] == str(run / "checkpoints" / "step-000080" / "model") == best.summary()["best"]["path"]
    assert on_disk() == ["step-000070", "step-000080"] and not (run / "best").exists()


# ---------------------------------------------------------------- EvalRun with malformed outputs


@dataclass
class _Recorder:
    """Stands in for the engine's add_request: EvalRun only submits to it."""

    added: list = field(default_factory=list)

    def add_request(self, rid, prompt, params, priority=0):
        self.added.append((rid, prompt, priority))


def _output(rid: str, texts: list[str]):
    comps = [SimpleNamespace(text=t, token_ids=list(range(min(len(t), 5)))) for t in texts]
    return SimpleNamespace(request_id=rid, finished=True, outputs=comps)


def _drive(run: EvalRun, outputs, deadline_s: float) -> float:
    t0 = time.monotonic()
    for out in outputs:
        assert run.owns(out.request_id)
        run.on_output(out)
        run.poll()
    while not run.poll():
        assert time.monotonic() - t0 < deadline_s, "evaluation grading hung"
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.integration
def test_malformed_outputs_grade_as_wrong_without_crashing():
    texts = list(ADVERSARIAL.values())
    golds = ["25", "\\frac{1}{2}", "2^{99}", "\\left(3,\\frac{\\pi}{2}\\right)"]
    sets = {"bench": [Prompt(f"p{i}", "q", g) for i, g in enumerate(golds)]}
    params = SimpleNamespace(n=len(texts))
    engine = _Recorder()
    with Grader(workers=1, timeout_s=5.0) as grader:
        run = EvalRun(sets, params, grader, prefix="v3", grade_answers=len(texts), answer_timeout_s=5.0 / 8)
        run.submit(engine, priority=-2, salt="v3")
        assert [(rid, p["cache_salt"], pr) for rid, p, pr in engine.added] == [
            (f"v3-bench-{i}", "v3", -2) for i in range(len(golds))]
        _drive(run, [_output(rid, texts) for rid, _, _ in engine.added], deadline_s=120)
        stats = grader.stats()
    grades = run.results["bench"]
    assert all(len(g) == len(texts) and all(isinstance(x, bool) for x in g) for g in grades)
    # the adversarial texts that do answer 25: after a megabyte of "(", and between null bytes
    right = [name for name, ok in zip(ADVERSARIAL, grades[0]) if ok]
    assert right == ["million_chars_then_answer", "null_bytes"]
    assert not any(any(g) for g in grades[1:])
    assert stats["reward/graded"] == len(texts) * len(golds)  # graded, not timed out or crashed
    assert summarize(run.results)["bench"] == pytest.approx(2 / len(texts) / len(golds))


@pytest.mark.integration
def test_a_hanging_grade_ends_at_the_per_answer_deadline():
    # The grader's own deadline is long; the eval job's deadline is answer_timeout_s × answers.
    sets = {"bench": [Prompt("p0", "q", "1"), Prompt("p1", "q", "2")]}
    engine = _Recorder()
    with Grader(workers=1, timeout_s=600.0, fn=_test_fn) as grader:
        run = EvalRun(sets, SimpleNamespace(n=2), grader, grade_answers=2, answer_timeout_s=0.5)
        run.submit(engine)
        outputs = [_output("eval-bench-0", ["Answer: 1", HANG]), _output("eval-bench-1", ["Answer: 2", "Answer: 3"])]
        elapsed = _drive(run, outputs, deadline_s=30)
        stats = grader.stats()
    assert run.results["bench"] == [[False, False], [True, False]]  # the hung job scores all-False
    assert stats["reward/timeouts"] == 2 and stats["reward/graded"] == 2
    assert elapsed < 0.5 * 2 + 5  # deadline of the 2-answer job, plus a worker restart
