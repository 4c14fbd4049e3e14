"""scripts/bench_delta_sync.py runs end to end on the tiny model: a real vLLM CPU engine in a child
process, every sync full and delta checked bit-exact by fingerprints (the script stops otherwise),
the bytes as the delta plan counts them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def test_bench_delta_sync_tiny_two_steps(tiny_model_path, tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench_delta_sync.py"), "--models", "tiny", "--steps", "2",
           "--tiny-model", tiny_model_path, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["tiny"]
    params, rows = result["params"], result["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["full_bytes"] == 2 * params  # every element in bfloat16
        changed = round(r["changed_frac"] * params)
        assert 0 < changed < 0.2 * params  # lr 1e-6 moves few bf16 casts, but some
        assert r["delta_bytes"] == changed * (4 + 2)  # an int32 index and a bf16 value each
        for way in (r["full"], r["delta"]):
            assert way["send_s"] >= way["pause_s"] > 0 and way["bcast_s"] > 0
    assert "| tiny | 0.4 M | 2 |" in proc.stdout
