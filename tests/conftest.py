"""Shared fixtures and the tiers of the suite. The engine environment must be set before vLLM or torch are
imported. Helpers that tests import live in tests/helpers.py."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest

from tests.helpers import ROOT


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The default tiny model, built once into the repo cache (the same one `python train.py` uses)."""
    from pace.tiny import TinySpec, build_tiny

    return str(build_tiny(TinySpec(), ROOT / "data" / "cache", progress=False))


# The in-process engine on the default tiny model and its weights, one per test module that asks
# (test_engine.py, test_engine_rollout.py); the tests leave its weights as they found them.

@pytest.fixture(scope="module")
def llm(tiny_model_path):
    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib

    llm = engine_lib.build_engine(tiny_model_path, RolloutConfig(), "float32", seed=0)
    yield llm
    engine_lib.shutdown(llm)


@pytest.fixture(scope="module")
def weights(tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return [(n, p.detach().clone()) for n, p in model.state_dict().items()]


@pytest.fixture(scope="session")
def tiny_tool_model_path() -> str:
    """The tiny tool-use model of conf/model/tiny_tool.yaml (what the *_tiny_tool presets build)."""
    from omegaconf import OmegaConf

    from pace.tiny import TinySpec, build_tiny

    spec = OmegaConf.merge(OmegaConf.structured(TinySpec), OmegaConf.load(ROOT / "conf/model/tiny_tool.yaml").tiny)
    return str(build_tiny(OmegaConf.to_object(spec), ROOT / "data" / "cache", progress=False))


TIERS = ("unit", "integration")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test's tier is its directory: every test under tests/unit/ is marked `unit`, under
    tests/integration/ `integration`. Collection fails, naming the tests, on a test outside both
    directories or marked with the other directory's tier."""
    refused = []
    for item in items:
        parts = Path(item.path).relative_to(ROOT / "tests").parts
        tier = parts[0] if len(parts) > 1 and parts[0] in TIERS else None
        other = [t for t in TIERS if t != tier and item.get_closest_marker(t)]
        if tier is None or other:
            refused.append(f"  {item.nodeid}: " + (f"marked {other[0]!r} under tests/{tier}/" if tier
                                                   else "not under tests/unit/ or tests/integration/"))
        else:
            item.add_marker(tier)
    if refused:
        raise pytest.UsageError("tests outside their tier (see docs/tests.md):\n" + "\n".join(refused))
