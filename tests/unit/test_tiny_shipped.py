"""The committed tiny models (data/tiny/): one for each current default spec, none stale, used without a build."""
from __future__ import annotations

import json

import pytest

from pace.tiny import SHIPPED, build_tiny, shipped_specs
from pace.tiny_spec import BUILD_VERSION

pytestmark = pytest.mark.unit


def test_each_current_spec_has_its_shipped_model_and_nothing_else_is_shipped() -> None:
    specs = shipped_specs()
    want = {f"tiny-{spec.key()}" for spec in specs.values()}
    have = {p.name for p in SHIPPED.iterdir() if p.is_dir()}
    assert have == want, f"data/tiny/ holds {sorted(have)}, the specs want {sorted(want)}: run scripts/ship_tiny.py"
    for name, spec in specs.items():
        meta = json.loads((SHIPPED / f"tiny-{spec.key()}" / "meta.json").read_text())
        assert meta["key"] == spec.key() and meta["build_version"] == BUILD_VERSION, name
        assert meta["spec"]["sft_steps"] == spec.sft_steps and (meta["spec"]["tool"] is None) == (spec.tool is None)


def test_a_shipped_spec_is_not_built(tmp_path, monkeypatch) -> None:
    import pace.tiny

    monkeypatch.setattr(pace.tiny, "_build_into", lambda *a: pytest.fail("built a shipped spec"))
    for spec in shipped_specs().values():
        assert build_tiny(spec, tmp_path / "cache", progress=False) == SHIPPED / f"tiny-{spec.key()}"
    assert not (tmp_path / "cache").exists()  # not even the cache folder (a build would make its lock there)


def test_the_shipped_default_loads_with_the_parameters_its_meta_records() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = SHIPPED / f"tiny-{shipped_specs()['default'].key()}"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    meta = json.loads((path / "meta.json").read_text())
    assert sum(p.numel() for p in model.parameters()) == meta["n_params"]
    assert AutoTokenizer.from_pretrained(path).decode(AutoTokenizer.from_pretrained(path)("12+3=").input_ids) == "12+3="
