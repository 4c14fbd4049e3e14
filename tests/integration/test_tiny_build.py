"""pace.tiny.build_tiny: a loadable Hugging Face checkpoint, cached, never left half-built.

A reduced spec (a few SFT steps, a small accuracy sample) keeps this to seconds; the default
spec's accuracy is what `meta.json` of the real cache records.
"""
from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

import pytest
import torch

from pace.tasks.arithmetic import ArithmeticSpec, make_prompts, solution
from pace.tiny import TinySpec, build_tiny

pytestmark = pytest.mark.integration

SPEC = TinySpec(task=ArithmeticSpec(n_train=200, n_val=20), sft_steps=20, batch_size=16, eval_prompts=24,
                eval_max_new_tokens=40)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, build_tiny(SPEC, cache, progress=False)


def test_build_writes_a_loadable_checkpoint(built) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, path = built
    assert path == cache / f"tiny-{SPEC.key()}"
    assert sorted(p.name for p in cache.iterdir()) == [f".{path.name}.lock", path.name]  # no temp directory left behind
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "meta.json"} <= names

    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == "qwen3" and model.dtype == torch.float32
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (128, 128, 2, 32)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.tie_word_embeddings) == (1, 0, True)

    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    prompt = make_prompts(SPEC.task, "train")[3]
    text = prompt.text + solution(prompt)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 128) and torch.isfinite(logits).all()


def test_meta_records_the_build(built) -> None:
    meta = json.loads((built[1] / "meta.json").read_text())
    assert meta["spec"] == json.loads(json.dumps(asdict(SPEC)))
    assert meta["sft_steps"] == SPEC.sft_steps and meta["key"] == SPEC.key()
    assert meta["sft_final_loss"] < math.log(128) - 0.5  # the warm start moved the model off uniform
    levels = [str(lv) for lv in SPEC.task.level_list()]
    assert list(meta["accuracy_per_level"]) == levels
    assert all(0.0 <= a <= 1.0 for a in meta["accuracy_per_level"].values())
    assert 0.0 <= meta["accuracy_overall"] <= 1.0 and meta["eval_prompts"] == SPEC.eval_prompts
    assert list(meta["response_tokens_per_level"]) == levels
    assert meta["build_seconds"] > 0 and {"torch", "transformers", "tokenizers"} <= set(meta["versions"])
    assert 300_000 < meta["n_params"] < 500_000


def test_second_call_is_cached(built) -> None:
    cache, path = built
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert build_tiny(SPEC, cache, progress=False) == path
    assert time.perf_counter() - start < 1.0
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert replace(SPEC, seed=1).key() != SPEC.key()  # any knob names a different cache entry


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch) -> None:
    import pace.tiny

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(pace.tiny, "_measure", crash)  # after SFT, before anything is saved
    with pytest.raises(RuntimeError, match="mid-build"):
        build_tiny(replace(SPEC, sft_steps=2), tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [f".tiny-{replace(SPEC, sft_steps=2).key()}.lock"]  # the lock only


def test_concurrent_builders_of_one_spec_build_it_once(tmp_path, monkeypatch, caplog) -> None:
    """Two builders at once (the ranks of a launch, two test workers): one builds, the other waits
    on the lock file and returns the same directory without building."""
    import pace.tiny

    spec, builds, real = replace(SPEC, sft_steps=4), [], pace.tiny._build_into

    def counted(*args):
        builds.append(threading.current_thread().name)
        time.sleep(0.5)  # the other builder arrives while this one holds the lock
        return real(*args)

    monkeypatch.setattr(pace.tiny, "_build_into", counted)
    with caplog.at_level("INFO", logger="pace.tiny"), ThreadPoolExecutor(2, thread_name_prefix="builder") as pool:
        futures = [pool.submit(build_tiny, spec, tmp_path, progress=False) for _ in range(2)]
        paths = [f.result(timeout=120) for f in futures]  # a builder's error raises here
    assert len(builds) == 1, builds
    assert paths[0] == paths[1] == tmp_path / f"tiny-{spec.key()}" and (paths[0] / "meta.json").exists()
    assert "waiting for another process's build" in caplog.text


def test_a_file_system_without_flock_builds_without_the_lock(tmp_path, monkeypatch, caplog) -> None:
    """Lustre without -o flock (ENOSYS), an NFS that refuses it: the build goes on, unlocked, and says so."""
    import errno

    import pace.tiny

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(pace.tiny.fcntl, "flock", no_flock)
    spec = replace(SPEC, sft_steps=2)
    with caplog.at_level("WARNING", logger="pace.tiny"):
        path = build_tiny(spec, tmp_path, progress=False)
    assert (path / "meta.json").exists() and "building without one" in caplog.text
