"""The run-time guard that the engines compute with the trainer's weights (pace/mismatch.py)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pace.config import Config
from pace.config_checks import validate
from pace.errors import ConfigError
from pace.mismatch import KEY, MismatchGuard, SyncMismatch

pytestmark = pytest.mark.unit


def _run(guard, values):
    """Feed per-step values (None: no on-policy token that step); the step it stops at, or None."""
    for step, value in enumerate(values):
        failure = guard.check(step, {} if value is None else {KEY: value})
        if failure is not None:
            assert isinstance(failure, SyncMismatch)
            return step, str(failure)
    return None


def test_it_stops_at_the_nth_step_above_the_bound_in_a_row_and_warns_once(capsys):
    stopped = _run(MismatchGuard(1e-5, 3), [4e-7, 3e-5, 6e-5, 1e-4, 2e-4])
    assert stopped is not None and stopped[0] == 3
    assert stopped[1].startswith("on-policy tokens' |ℓ^μ − log π_θ| = 1.00e-04 per token at step 3, above "
                                 "trainer.max_sync_mismatch = 1e-05, 3 steps in a row")
    assert capsys.readouterr().err.count("warning: on-policy tokens' |ℓ^μ − log π_θ| = 3.00e-05 per token at step 1") == 1


def test_a_step_within_the_bound_restarts_the_count_and_unmeasured_steps_do_not_count():
    assert _run(MismatchGuard(1e-5, 3), [3e-5, 3e-5, 1e-6, 3e-5, 3e-5, None, 1e-6]) is None
    assert _run(MismatchGuard(1e-5, 3), [3e-5, None, 3e-5, None, None, 3e-5])[0] == 5


def test_zero_steps_only_warns(capsys):
    assert _run(MismatchGuard(1e-5, 0), [1.0] * 20) is None
    assert capsys.readouterr().err.count("warning:") == 1


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("bfloat16", 0.2), ("float16", 0.2)])
def test_the_default_bound_follows_the_model_dtype_and_a_set_one_wins(dtype, bound):
    cfg = OmegaConf.structured(Config)
    cfg.model.dtype = dtype
    assert MismatchGuard.from_config(cfg).bound == bound
    cfg.trainer.max_sync_mismatch, cfg.trainer.sync_mismatch_steps = 0.5, 7
    guard = MismatchGuard.from_config(cfg)
    assert (guard.bound, guard.steps) == (0.5, 7)


@pytest.mark.parametrize("key, value", [("max_sync_mismatch", 0.0), ("max_sync_mismatch", -1.0), ("sync_mismatch_steps", -1)])
def test_bad_values_are_refused_naming_the_key(key, value):
    cfg = OmegaConf.structured(Config)
    cfg.trainer[key] = value
    with pytest.raises(ConfigError, match=f"trainer.{key}"):
        validate(cfg)
