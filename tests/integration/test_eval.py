"""eval.py on the tiny model: mean@k per arithmetic level and their average, in eval.json and tables."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, make_run

pytestmark = pytest.mark.integration


def test_eval_writes_mean_at_k_and_the_tables(tiny_model_path, tmp_path):
    cmd = [sys.executable, str(ROOT / "eval.py"), "data.arithmetic.n_val=8", "eval.k=3",
           "logger.progress=false", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    scores, correct = result["mean@3"], result["correct"]
    assert set(scores) == {"arith_l1", "arith_l2", "arith_l3", "arith_l4", "avg"}
    # hand count: 8 val problems round-robin over 4 levels → 2 per level, 3 graded samples each
    for level in range(1, 5):
        rows = correct[f"arith_l{level}"]
        assert len(rows) == 2 and all(len(r) == 3 for r in rows)
        assert scores[f"arith_l{level}"] == pytest.approx(sum(sum(r) / 3 for r in rows) / 2)
    assert scores["avg"] == pytest.approx(sum(scores[f"arith_l{i}"] for i in range(1, 5)) / 4)
    md = (tmp_path / "results.md").read_text()
    assert "| method | Arith L1 | Arith L2 | Arith L3 | Arith L4 | Avg. |" in md
    assert f"{100 * scores['avg']:.2f}" in md
    assert (tmp_path / "results.csv").read_text().splitlines()[0] == "method,Arith L1,Arith L2,Arith L3,Arith L4,Avg."
    assert r"\begin{tabular}{lccccc}" in (tmp_path / "results.tex").read_text()


def test_eval_fails_in_one_line_on_an_unknown_benchmark(tmp_path):
    cmd = [sys.executable, str(ROOT / "eval.py"), "eval.benchmarks=[aime_1999]", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "unknown benchmark 'aime_1999'" in proc.stderr and "Traceback" not in proc.stderr


def test_eval_of_a_run_whose_selected_version_has_no_weights_fails_in_one_line(tmp_path):
    run = make_run(tmp_path, "pace0", "pace", 0, 30, None, checkpoint=False)
    cmd = [sys.executable, str(ROOT / "eval.py"), f"model.path={run}", f"hydra.run.dir={tmp_path / 'eval'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f"error: {run}: the selected version θ_30 has no checkpoint "
                                                    f"({run / 'best'} is not a model directory)")


def test_eval_fails_in_one_line_on_a_chat_template_with_no_turn_end_to_stop_on(tiny_model_path, tmp_path):
    """`data.chat_template=true` with a template that ends a turn with plain text: the stop tokens
    (pace/rollout/stopping.py) cannot be found, and eval.py says so in one line before any engine."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    cmd = [sys.executable, str(ROOT / "eval.py"), f"model.path={model}", "data.chat_template=true",
           f"hydra.run.dir={tmp_path / 'eval'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data.chat_template: the chat template ends "
                                                           "an assistant turn with '\\n'")
