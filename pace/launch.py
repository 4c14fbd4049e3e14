"""What the entry points (train.py, eval.py, simulate.py) resolve from a composed config before they
build anything: the device, the model directory, the wandb group of a Hydra multirun.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from pace.errors import UserError

# what a hub download of `model.path` fetches: config and generation config, weights (safetensors
# and their index), the tokenizer (tokenizer.json and its config, vocab.json / merges.txt, a
# SentencePiece *.model) and a chat template shipped as a file of its own (chat_template.jinja, and
# additional_chat_templates/*.jinja: newer checkpoints keep it out of tokenizer_config.json, and
# without it the tokenizer has no template)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def resolve_device(cfg) -> str:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"device=cuda (set by +exp={cfg.exp_name}) but no CUDA GPU is available here; "
            "run a *_tiny preset on CPU, or this preset on a GPU machine"
        )
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def resolve_model(cfg, progress: bool) -> str:
    """A local directory or a hub id; `model.path: null` builds (or reuses) the tiny model."""
    if cfg.model.path is None:
        from pace.tiny import build_tiny

        return str(build_tiny(OmegaConf.to_object(cfg.model.tiny), cfg.model.cache_dir, progress=progress))
    path = cfg.model.path
    if Path(path).exists():
        return path
    if path.startswith((".", "/", "~")):
        raise UserError(f"model.path: directory not found: {path}")
    try:  # a hub id: resolve it now so a typo or an offline machine fails here, in one line
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=HUB_PATTERNS)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"model.path: {path!r} is not a local directory and cannot be fetched from the hub ({type(exc).__name__})") from exc


def default_group(cfg) -> str | None:
    """The jobs of one Hydra multirun share a wandb group (`logger.group` overrides)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # called outside a Hydra app (scripts)
        return None
    hc = HydraConfig.get()
    if cfg.logger.group is None and hc.mode == RunMode.MULTIRUN:
        return f"{cfg.exp_name}-{Path(hc.sweep.dir).name}"
    return None
