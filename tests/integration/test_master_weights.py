"""fp32 master weights for a bf16 model (train.mixed_precision → pace.algo.trainer): under
Accelerate's bf16 mixed precision the trainer keeps float32 parameters and AdamW state, so one
step at lr 1e-6 moves the weights; trained as bf16 weights the same step rounds away on most
elements. On CPU (bf16 autocast), each case in a fresh process: Accelerate's state is per process."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from accelerate import Accelerator
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from pace.algo.trainer import DAPOTrainer
    from pace.config import Config
    from tests.helpers import _batch

    path, mixed = sys.argv[1], sys.argv[2]
    cfg = OmegaConf.structured(Config)
    cfg.model.dtype, cfg.trainer.lr, cfg.trainer.warmup_steps = "bfloat16", 1e-6, 0
    trainer = DAPOTrainer(path, cfg, Accelerator(cpu=True, mixed_precision=mixed))
    model = trainer.acc.unwrap_model(trainer.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.step(_batch(AutoTokenizer.from_pretrained(path), model, 1.0))
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in model.named_parameters())
    total = sum(p.numel() for p in model.parameters())
    moments = {str(v.dtype) for s in trainer.optimizer.state_dict()["state"].values() for k, v in s.items() if k != "step"}
    print(json.dumps({"params": sorted({str(p.dtype) for p in model.parameters()}), "moments": sorted(moments),
                      "changed": changed / total}))
""")


def _run(path: str, mixed: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, path, mixed], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bf16_mixed_precision_keeps_fp32_master_weights_that_move_at_lr_1e_6(tiny_model_path):
    mixed = _run(tiny_model_path, "bf16")
    assert mixed["params"] == ["torch.float32"] and mixed["moments"] == ["torch.float32"]
    assert mixed["changed"] > 0.5  # Adam's first step moves every element with a gradient by ~lr
    pure = _run(tiny_model_path, "no")  # what a bf16 GPU run got before train.mixed_precision
    assert pure["params"] == ["torch.bfloat16"]
    assert pure["changed"] < 0.2 * mixed["changed"]  # most of the update rounds away
