"""pace/launch.py: what a hub model's download fetches (`model.path` a hub id)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.unit

# a Qwen3 checkpoint's files on the hub as a newer transformers saves them: the chat template in a
# file of its own (chat_template.jinja), not inside tokenizer_config.json
QWEN3_NEEDED = ["config.json", "generation_config.json", "model-00001-of-00005.safetensors",
                "model-00005-of-00005.safetensors", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja",
                "additional_chat_templates/tool_use.jinja"]
QWEN3_OTHERS = [".gitattributes", "LICENSE", "README.md"]


def test_a_hub_model_is_fetched_with_its_chat_template_file(monkeypatch):
    """The patterns `resolve_model` hands `snapshot_download`, applied by huggingface_hub's own filter
    to a Qwen3 checkpoint's files: everything the tokenizer and the weights need, the template file
    included (before: every file but the template)."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from pace.launch import resolve_model

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kwargs: calls.append((repo_id, kwargs)) or "/hub/snapshot")
    cfg = OmegaConf.create({"model": {"path": "Qwen/Qwen3-8B-Base"}})
    assert resolve_model(cfg, progress=False) == "/hub/snapshot"
    (repo, kwargs), = calls
    fetched = set(filter_repo_objects(QWEN3_NEEDED + QWEN3_OTHERS, allow_patterns=kwargs["allow_patterns"]))
    assert repo == "Qwen/Qwen3-8B-Base" and fetched == set(QWEN3_NEEDED)
