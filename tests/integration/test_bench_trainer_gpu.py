"""scripts/bench_trainer_gpu.py runs end to end on CPU with `--tiny`: the presets' trainer (FSDP2 from
conf/accelerate/fsdp.yaml over a gloo group of one, fp32 master weights, chunked log-probs), as the
GPU run uses it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def test_bench_trainer_gpu_tiny_runs_the_presets_trainer():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_trainer_gpu.py"), "--tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
    setup = next(r["setup"] for r in records if "setup" in r)
    # the trainer train.py builds on a GPU: FSDP2 from the yaml, bf16 compute on fp32 shards, chunks
    assert setup["fsdp2"] and setup["mixed"] == "bf16" and setup["shards"] == ["torch.float32"] and setup["chunk"] == 64
    steps = [r for r in records if "tokens" in r]
    assert [r["tokens"] for r in steps] == [384, 768]
    assert all(not r["oom"] and r["finite"] and r["seconds"] > 0 and r["predicted_gib"] > 0 for r in steps)
    assert steps[1]["predicted_gib"] > steps[0]["predicted_gib"]  # more tokens, more activations
    assert [r["budget"] for r in records if "budget" in r] == [768, 1536]
    assert all(r["tokens_per_s"] > 0 for r in records if "budget" in r)
    assert next(r for r in records if "agreement_tokens" in r)["max_abs_logp_diff_chunked_vs_full"] < 1e-3
    source = next(r for r in records if r.get("what") == "source")
    assert source["names_equal"] and source["bits_equal"]  # gathered before any step: the checkpoint's bits
    assert "| tokens | peak GiB | predicted GiB | s |" in proc.stdout
