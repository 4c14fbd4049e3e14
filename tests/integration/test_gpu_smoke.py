"""scripts/gpu_smoke.py on CPU with `--tiny`: the same cases and checks as on a GPU (FSDP2 from
conf/accelerate/fsdp.yaml over a gloo group of one, tiny models of the presets' architectures)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from tests.helpers import PAPER_PRESETS, ROOT, compose_cfg

pytestmark = pytest.mark.integration


def test_gpu_smoke_tiny_passes_every_check():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_smoke.py"), "--tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {(r["case"], r["what"]): r for r in (json.loads(line[6:]) for line in proc.stdout.splitlines()
                                               if line.startswith("SMOKE "))}
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "| check |" not in line]
    assert len(table) == 17 and all(" | yes | " in line for line in table), "\n".join(table)
    # what the checks rest on, read here too: the cases ran as the trainer runs on GPUs
    setup = got[("fsdp", "setup")]
    assert setup["fsdp2"] and setup["shards"] == ["torch.float32"] and setup["compute"] == "torch.bfloat16"
    assert "Qwen3DecoderLayer" in setup["units"] and "Qwen3MoeDecoderLayer" in got[("moe", "setup")]["units"]
    assert got[("pure", "setup")]["shards"] == ["torch.bfloat16"]
    assert got[("fsdp", "step")]["changed_layers"] > 0.99 > 0.1 > got[("pure", "step")]["changed_layers"]
    assert got[("moe", "source")]["fused"] == 4 and got[("fsdp", "checkpoint")]["dcp"]
    # each case reports its predicted peak (pace.algo.memory_budget, the tiny shapes here) and the
    # chunked = full check ran on its own shorter row
    assert all(0 < got[(case, "memory")]["predicted"]["peak"] < 0.01 for case in ("fsdp", "pure", "moe"))
    assert got[("fsdp", "agreement")]["tokens"] == 224
    # a delta sync of the step (pace/weights/delta.py) against θ_0's cast, over the FSDP2 shards
    assert all(0 < got[(case, "delta")]["changed_frac"] < 0.2 for case in ("fsdp", "moe"))


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_the_smokes_preset_reader_agrees_with_hydra(preset):
    """gpu_smoke reads the presets without Hydra (not installed on the device machine): its model,
    algo and trainer values must be Hydra's composition of the same preset."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import smoke_setup
    from omegaconf import OmegaConf

    cfg = compose_cfg([f"+exp={preset}"])
    mine = smoke_setup.trainer_config(preset, cfg.model.path, tiny=False)
    for group in ("model", "algo", "trainer"):
        want = OmegaConf.to_container(cfg[group], resolve=True)
        have = asdict(getattr(mine, group))
        if group == "trainer":
            have["warmup_steps"] = want["warmup_steps"]  # the smoke runs its one step at the full lr
        assert have == want, group
