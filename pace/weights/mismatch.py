"""The run-time check that the engines compute with the trainer's weights, on any hardware.

On-policy tokens (sampled by an engine labelled θ_v while the trainer holds θ_v) have ℓ^μ equal
to the trainer's log π_θ up to the two sides' kernels: `mismatch/abs_logp_diff` is ~4e-7 a token
in float32 on CPU, flat over a run. Weights that do not all reach the engine move it by orders
of magnitude — a tied output head left at θ_0 gave 3.2e-5 one step later and 7e-4 by step 19, a
dropped layer gives nats — and make every number of the run wrong (ℓ^μ, the ratios, the
staleness scores, the validations on the engine). So: a step above the bound warns once; `steps`
measured steps above it in a row stop the run (`SyncMismatch`, one line, after a checkpoint).

The bound (`trainer.max_sync_mismatch`; null: by `model.dtype`): 1e-5 in float32 (25× the
measured floor; the stale head crossed it at its first step) and 0.2 in bfloat16/float16, where
the two sides' rounding alone gives ~5e-3 a token on dense models and more on MoE ones. That bound
cannot see an engine a version behind (~1e-3 at lr 1e-6): pace/weights/fingerprint.py checks the weights
themselves after every sync, exactly, in any dtype.
"""
from __future__ import annotations

import sys

BOUNDS = {"float32": 1e-5, "bfloat16": 0.2, "float16": 0.2}
KEY = "mismatch/abs_logp_diff"


class SyncMismatch(RuntimeError):
    """The engines' log-probs of their own on-policy tokens are not the trainer's."""

    why = "on-policy mismatch"  # the checkpoint's reason


class MismatchGuard:
    def __init__(self, bound: float, steps: int):
        self.bound, self.steps = bound, steps
        self.in_row = 0
        self.warned = False

    @classmethod
    def from_config(cls, cfg) -> MismatchGuard:
        bound = cfg.trainer.max_sync_mismatch
        return cls(BOUNDS[cfg.model.dtype] if bound is None else bound, cfg.trainer.sync_mismatch_steps)

    def check(self, step: int, metrics: dict) -> SyncMismatch | None:
        """After training step ``step`` (its metrics): the failure to stop with, or None. A step
        without on-policy tokens measures nothing and neither breaks nor extends a run of steps."""
        value = metrics.get(KEY)
        if value is None:
            return None
        if value <= self.bound:
            self.in_row = 0
            return None
        self.in_row += 1
        cause = (f"on-policy tokens' |ℓ^μ − log π_θ| = {value:.2e} per token at step {step}, above "
                 f"trainer.max_sync_mismatch = {self.bound:.0e}")
        if not self.warned:
            self.warned = True
            print(f"warning: {cause}: the engines may not hold the trainer's weights", file=sys.stderr, flush=True)
        if self.steps and self.in_row >= self.steps:
            return SyncMismatch(f"{cause}, {self.in_row} steps in a row: the engines do not compute with the trainer's "
                                "weights (a weight sync that misses tensors, or stale engine kernels)")
        return None
