"""The start-up memory check (pace/algo/memory_check.py): its parameter count against a real model,
its per-rank layout, and its decision on the presets' models at the sizes of an H100 and an H200."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from pace.algo import memory_budget as mb
from pace.algo.memory_check import check_memory, count_params
from pace.config import Config
from pace.errors import ConfigError

H100_GIB, H200_GIB = 79.2, 139.8  # torch.cuda.mem_get_info()[1] of an 80 GB H100 and a 141 GB H200, about


def _accelerator(processes: int, fsdp: bool = True, mixed: str = "bf16", offload: bool = False):
    plugin = SimpleNamespace(cpu_offload=offload) if fsdp else None
    return SimpleNamespace(is_fsdp2=fsdp, num_processes=processes, mixed_precision=mixed, is_main_process=True,
                           parallelism_config=None, state=SimpleNamespace(fsdp_plugin=plugin))


def _cfg(memory_gib: float | None, dtype: str = "bfloat16"):
    cfg = OmegaConf.structured(Config)
    cfg.model.dtype, cfg.trainer.device_memory_gib = dtype, memory_gib
    return cfg


@pytest.fixture(scope="module")
def qwen3_30b_a3b(tmp_path_factory) -> str:
    """Qwen3-30B-A3B-Base's config.json (its shapes as scripts/gpu_smoke.py has them); no weights."""
    import sys

    from tests.helpers import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import smoke_setup

    path = tmp_path_factory.mktemp("qwen3_30b_a3b")
    Qwen3MoeConfig(**smoke_setup.QWEN3_30B_A3B).save_pretrained(path)
    return str(path)


def test_count_params_is_the_loaded_models(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert count_params(tiny_model_path) == sum(p.numel() for p in model.parameters())  # tied head counted once


def test_the_check_refuses_exactly_above_the_states_and_adamw_temporary(tiny_model_path):
    params = count_params(tiny_model_path)
    need = mb.optimizer_bytes(params, shards=2, master_bytes=4)  # FSDP2 over 2, fp32 master weights
    assert need == -(-params // 2) * 20
    check_memory(_cfg(need / mb.GIB), tiny_model_path, _accelerator(2), "cpu")  # fits exactly
    with pytest.raises(ConfigError) as err:
        check_memory(_cfg(need * 0.99 / mb.GIB), tiny_model_path, _accelerator(2), "cpu")
    line = str(err.value)
    assert "\n" not in line and "over 2 FSDP2 shards" in line and "20 bytes a parameter" in line
    assert "--num_processes" in line and "trainer.device_memory_gib" in line and "fsdp_offload_params" in line


def test_without_fsdp_every_rank_holds_the_whole_model(tiny_model_path):
    params = count_params(tiny_model_path)
    whole = mb.optimizer_bytes(params, 1, 4)
    with pytest.raises(ConfigError, match="whole on every rank"):
        check_memory(_cfg(whole * 0.99 / mb.GIB), tiny_model_path, _accelerator(2, fsdp=False), "cpu")
    # without mixed precision a float32 model's states are float32 too; bf16 ones half
    check_memory(_cfg(mb.optimizer_bytes(params, 1, 2) / mb.GIB), tiny_model_path, _accelerator(1, False, "no"), "cpu")
    with pytest.raises(ConfigError):
        check_memory(_cfg(mb.optimizer_bytes(params, 1, 2) / mb.GIB, "float32"), tiny_model_path,
                     _accelerator(1, False, "no"), "cpu")


def test_cpu_is_not_checked_unless_a_size_is_given_and_offload_is_not_checked(tiny_model_path):
    check_memory(_cfg(None), tiny_model_path, _accelerator(1), "cpu")
    check_memory(_cfg(1e-6), tiny_model_path, _accelerator(2, offload=True), "cpu")


def test_the_30b_a3b_fits_8_gpus_of_either_card_but_not_the_yamls_4_h200s(qwen3_30b_a3b, capsys):
    """fsdp.yaml's default 4 processes: 20 B × 30.5 B / 4 = 142 GiB a rank, above an H200; on 8
    (fsdp_8gpu.yaml) 71 GiB, within an H100's 79 (activations come on top); on 6 H100s 95 GiB."""
    assert 30.4e9 < count_params(qwen3_30b_a3b) < 30.6e9
    with pytest.raises(ConfigError) as err:
        check_memory(_cfg(H200_GIB), qwen3_30b_a3b, _accelerator(4), "cuda")
    assert "need 142.2 GiB a rank" in str(err.value) and ">= 5 processes" in str(err.value)
    with pytest.raises(ConfigError, match=r"need 94\.8 GiB a rank.*>= 8 processes"):
        check_memory(_cfg(H100_GIB), qwen3_30b_a3b, _accelerator(6), "cuda")
    for card in (H100_GIB, H200_GIB):
        check_memory(_cfg(card), qwen3_30b_a3b, _accelerator(8), "cuda")
    assert "need 71.1 GiB a rank" in capsys.readouterr().err


def test_a_step_estimate_above_the_device_warns_without_stopping(qwen3_30b_a3b, capsys):
    """The 30B-A3B on 8 ranks: 71.1 GiB at AdamW's step passes a 72 GiB device, but its states
    (56.9) and a 24,576-token micro-batch (~17.4 by memory_budget.step_bytes) do not fit it."""
    cfg = _cfg(72.0)
    cfg.model.gradient_checkpointing, cfg.trainer.max_tokens_per_micro_batch = True, 24_576
    check_memory(cfg, qwen3_30b_a3b, _accelerator(8), "cuda")
    err = capsys.readouterr().err
    assert "warning: by estimate" in err and "peaks at 74.3 GiB" in err and "trainer.max_tokens_per_micro_batch=24576" in err
    cfg.trainer.device_memory_gib = 80.0
    check_memory(cfg, qwen3_30b_a3b, _accelerator(8), "cuda")
    assert "warning" not in capsys.readouterr().err


def test_a_step_estimate_that_fails_is_skipped_with_one_warning(qwen3_30b_a3b, monkeypatch, capsys):
    """The estimate runs on rank 0 alone while the others wait at the next barrier, and only ever
    warns: any error in it (here the shapes' reader) is one warning line, and the run goes on."""
    cfg = _cfg(72.0)
    cfg.model.gradient_checkpointing, cfg.trainer.max_tokens_per_micro_batch = True, 24_576

    def broken(config):
        raise ValueError("an unexpected layout")

    monkeypatch.setattr(mb.Shapes, "of", staticmethod(broken))
    check_memory(cfg, qwen3_30b_a3b, _accelerator(8), "cuda")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: the micro-batch memory estimate (pace/algo/memory_budget.py) was skipped: "
                        "ValueError: an unexpected layout"]
