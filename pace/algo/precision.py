"""The trainer's precision on a GPU: Accelerate's mixed precision for a run (train.py and
scripts/gpu_smoke.py decide it here)."""
from __future__ import annotations

from pace.errors import ConfigError


def mixed_precision(device: str, model_dtype: str, launcher: str | None) -> str | None:
    """Accelerate's mixed precision for this run: on a GPU with a bf16 model, bf16 (fp32 master
    weights and AdamW state, bf16 forward: pace.algo.trainer) whatever the launcher says —
    `python train.py` alone, or `accelerate launch` without a mixed-precision setting, would
    otherwise train the bf16 weights themselves, and AdamW steps of lr 1e-6 round away on them.
    None: the launcher's setting (``launcher``, ACCELERATE_MIXED_PRECISION) stands."""
    if device != "cuda":
        return None
    if model_dtype == "float16":  # fp16 needs a loss scaler, whose state a skipped (non-finite) update breaks
        raise ConfigError("model.dtype=float16 on a GPU: use bfloat16 (fp16 training needs loss scaling, "
                          "which the trainer's skipped non-finite updates do not support)")
    if model_dtype != "bfloat16" or launcher in ("bf16", "fp16", "fp8"):
        return None
    return "bf16"
