"""Memory at start, end to end: train.py refuses a trainer whose states exceed a device's memory
before any engine is built (pace/algo/memory_check.py), and the trainer loads a bf16 checkpoint in
bf16 and gets fp32 master weights from the upcast after loading: Accelerate's under FSDP2 (the
GPU runs' path, over a gloo group of one on CPU as scripts/gpu_smoke.py runs it), its own without."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def test_train_refuses_at_start_when_the_states_exceed_the_device(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from pace.algo.memory_budget import optimizer_bytes

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters())
    need = optimizer_bytes(params, shards=1, master_bytes=4)  # one CPU process, float32: 20 bytes a parameter
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "trainer.device_memory_gib=0.0001", "trainer.steps=1", "logger.mode=disabled",
                           "logger.progress=false", f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the trainer's weights, gradients and AdamW state of {params / 1e6:.2f} M parameters "
                           f"need {need / 2**20:.1f} MiB a rank")
    assert "a device has 0.1 MiB (trainer.device_memory_gib)" in last and "--config_file conf/accelerate/fsdp.yaml" in last
    assert "run directory:" not in proc.stderr  # stopped before the engines, the pool and the logger
    assert not (run_dir / "metrics.jsonl").exists()


def test_train_refuses_at_start_when_the_host_cannot_hold_the_load(tmp_path, bf16_checkpoint):
    """check_host_memory in train.py, after the device check and before the trainer loads anything:
    one process loading a bf16 checkpoint takes its fp32 copy (CPU: no mixed precision, model.dtype
    float32), 4 bytes a parameter, above a `trainer.host_memory_gib` of 1 KiB."""
    from pace.algo.memory_check import count_params

    params = count_params(str(bf16_checkpoint))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"model.path={bf16_checkpoint}",
                           f"trainer.host_memory_gib={1 / 2**20}", "logger.mode=disabled", "logger.progress=false",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"error: host memory: loading {bf16_checkpoint} ({params / 1e6:.2f} M parameters) takes "
                    f"{params * 4 / 2**20:.1f} MiB of this node's host memory (4 bytes a parameter), but 0.0 MiB is "
                    f"available (trainer.host_memory_gib): free host memory; trainer.host_memory_gib overrides the "
                    f"available size")
    assert "run directory:" not in proc.stderr


SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, "scripts")
    import smoke_case
    from pace.algo.trainer import DAPOTrainer
    from pace.config import Config

    path, mode = sys.argv[1], sys.argv[2]
    loaded = []
    load = AutoModelForCausalLM.from_pretrained
    def recording(*args, **kwargs):
        model = load(*args, **kwargs)
        loaded.extend(sorted({str(p.dtype) for p in model.parameters()}))
        return model
    AutoModelForCausalLM.from_pretrained = recording
    cfg = OmegaConf.structured(Config)
    cfg.model.dtype, cfg.trainer.warmup_steps = "bfloat16", 0
    if mode == "fsdp":  # conf/accelerate/fsdp.yaml's FSDP2 plugin and bf16 mixed precision, as on a GPU
        acc = smoke_case.accelerator("fsdp", "bfloat16", tiny=True)
    else:
        from accelerate import Accelerator
        acc = Accelerator(cpu=True, mixed_precision="bf16" if mode == "ddp" else "no")
    trainer = DAPOTrainer(path, cfg, acc)
    reference = load(path, dtype=torch.bfloat16)  # the buffers (rotary frequencies) as a direct load makes them
    buffers = dict(acc.unwrap_model(trainer.model).named_buffers())
    print(json.dumps({"loaded": loaded, "fsdp2": acc.is_fsdp2, "trained": sorted({str(p.dtype) for p in trainer.model.parameters()}),
                      "buffers_as_loaded": all(torch.equal(b, buffers[n]) and b.dtype == buffers[n].dtype
                                               for n, b in reference.named_buffers())}))
""")


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Qwen3 saved in bf16, as the presets' hub checkpoints are."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import smoke_setup

    return smoke_setup.write_model(tmp_path_factory.mktemp("bf16") / "dense", {**smoke_setup.QWEN3_8B, **smoke_setup.TINY}, 2, tiny=True)


@pytest.mark.parametrize("path", ["fsdp", "ddp"])
def test_a_bf16_checkpoint_is_loaded_in_bf16_and_trained_in_fp32(bf16_checkpoint, path):
    got = _load(str(bf16_checkpoint), path)
    assert got["fsdp2"] == (path == "fsdp")
    assert got["loaded"] == ["torch.bfloat16"]  # the checkpoint's dtype: no fp32 copy made while loading
    assert got["trained"] == ["torch.float32"]  # fp32 master weights (FSDP2: Accelerate's upcast in prepare)
    assert got["buffers_as_loaded"]


def test_an_fp32_checkpoint_trained_in_bf16_keeps_its_fp32_rotary_buffers(tiny_model_path):
    """Without mixed precision (model.dtype=bfloat16 on CPU) the parameters are cast, not the
    buffers: `model.to(bf16)` would round the rotary frequencies, which a bf16 load keeps in fp32."""
    got = _load(tiny_model_path, "pure")
    assert got["loaded"] == ["torch.float32"] and got["trained"] == ["torch.bfloat16"] and got["buffers_as_loaded"]


def _load(checkpoint: str, path: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, checkpoint, path], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
