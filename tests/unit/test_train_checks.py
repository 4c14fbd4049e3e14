"""Start-up checks of train.py that depend on the number of trainer processes, its mixed precision,
and its stop signal."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pace.config import Config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("b, n_mini, g, world, ok", [
    (32, 4, 8, 2, True),    # 8 groups × 8 per mini-batch
    (4, 3, 8, 1, False),    # 2, 2, 0 groups: the last mini-batch is empty even on one process
    (5, 2, 1, 4, False),    # 3 + 2 trajectories: the second has fewer than 4 ranks
    (5, 2, 2, 4, True),     # 6 + 4
])
def test_every_rank_gets_a_share_of_every_mini_batch(b, n_mini, g, world, ok):
    from pace.config_checks import check_processes, check_shares
    from pace.errors import ConfigError
    from pace.placement import Placement

    cfg = OmegaConf.structured(Config)
    cfg.data.batch_prompts, cfg.trainer.mini_batches, cfg.data.group_size = b, n_mini, g
    placement = Placement.of(cfg.rollout, "cpu", world)  # what train.py checks once it knows the world
    if ok:
        check_shares(cfg, world)
        check_processes(cfg, placement)
    else:
        with pytest.raises(ConfigError, match="trainer.mini_batches"):
            check_shares(cfg, world)
        with pytest.raises(ConfigError, match="trainer.mini_batches"):
            check_processes(cfg, placement)


def test_a_deterministic_run_needs_the_in_process_engine():
    """rollout.deterministic is stepped by the rollout thread: refused, in one line naming the key,
    where the trainer processes put the engine in its own process."""
    from pace.config_checks import check_processes
    from pace.errors import ConfigError
    from pace.placement import Placement

    cfg = OmegaConf.structured(Config)
    cfg.rollout.deterministic = True
    check_processes(cfg, Placement.of(cfg.rollout, "cpu", 1))  # one process on CPU: the engine in process
    with pytest.raises(ConfigError, match=r"rollout.deterministic needs the in-process engine.*\(here: 2 processes on cpu\)"):
        check_processes(cfg, Placement.of(cfg.rollout, "cpu", 2))


@pytest.mark.parametrize("device, dtype, launcher, want", [
    ("cuda", "bfloat16", None, "bf16"),    # `python train.py +exp=<GPU preset>`: no launcher setting
    ("cuda", "bfloat16", "no", "bf16"),    # `accelerate launch` without mixed precision
    ("cuda", "bfloat16", "bf16", None),    # conf/accelerate/fsdp.yaml says bf16: it stands
    ("cuda", "float32", None, None),       # a float32 model trains in float32
    ("cpu", "float32", None, None),        # the CPU runs
    ("cpu", "bfloat16", None, None),
])
def test_a_bf16_model_on_a_gpu_always_trains_with_fp32_master_weights(device, dtype, launcher, want):
    from pace.algo.precision import mixed_precision

    assert mixed_precision(device, dtype, launcher) == want


def test_an_fp16_model_on_a_gpu_is_refused_in_one_line():
    from pace.algo.precision import mixed_precision
    from pace.errors import ConfigError

    with pytest.raises(ConfigError, match="model.dtype=float16 on a GPU: use bfloat16"):
        mixed_precision("cuda", "float16", None)
    assert mixed_precision("cpu", "float16", None) is None


def test_a_stop_signal_sent_twice_at_once_is_one_stop_and_a_later_one_stops_now(monkeypatch):
    """A cluster signals every process and torchrun forwards the signal to each rank: a rank gets the
    same SIGTERM twice within moments, which must not count as the second ("stop at once, without a
    checkpoint"); one sent again later still does."""
    import os
    import signal
    import time

    from pace.signals import StopSignal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(StopSignal, "REPEAT_S", 0.3)
    try:
        stop = StopSignal()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's copy of the same stop
        time.sleep(0.05)
        assert stop.requested and stop.signum == signal.SIGTERM
        time.sleep(0.35)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_importing_train_py_loads_no_framework_before_the_config_is_checked():
    """A typo in an override fails in ~2 s: train.py's module-level imports reach none of torch,
    vLLM, transformers or accelerate (~8 s of CPU together), which it imports once the config passed."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    heavy = ("torch", "vllm", "transformers", "accelerate")
    code = f"import sys; import train; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
