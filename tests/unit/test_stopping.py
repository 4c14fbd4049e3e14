"""Where responses stop, on copies of the real Qwen3 checkpoints' configs (tests/fixtures/qwen3).

The stop set is resolved as vLLM 0.32 resolves it for a request (vllm/v1/engine/input_processor.py):
the tokenizer's EOS plus the generation_config EOS ids plus the request's `stop_token_ids`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "qwen3"
ENDOFTEXT, IM_END = 151643, 151645


def checkpoint(name: str, tmp_path: Path) -> Path:
    """The fixture's config files with a stand-in vocabulary: the 256 byte-level symbols, fillers up to
    the real added tokens' ids (151643…), no merges. The tokenizer is the real class (Qwen2Tokenizer,
    from tokenizer_config.json) with the real added tokens, EOS and chat template."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    symbols = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(symbols)}
    vocab.update({f"\u2581filler{i}": i for i in range(len(symbols), ENDOFTEXT)})
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n")
    return out


def tokenizer_of(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def vllm_stops(params, path: Path, tokenizer) -> set[int]:
    """The token ids a request with ``params`` stops on in vLLM for the checkpoint at ``path``."""
    from vllm.transformers_utils.config import try_get_generation_config

    p = params.clone()
    generation = try_get_generation_config(str(path), trust_remote_code=False)
    p.update_from_generation_config(generation.to_diff_dict() if generation else {}, tokenizer.eos_token_id)
    assert not p.ignore_eos
    return {p.eos_token_id, *p.stop_token_ids}


def config(chat_template: bool, stop_on_turn_end: bool = True):
    from omegaconf import OmegaConf

    from pace.config import Config

    cfg = OmegaConf.structured(Config)
    cfg.data.chat_template, cfg.data.stop_on_turn_end = chat_template, stop_on_turn_end
    return cfg


def rollout_params(cfg, tokenizer):
    """The rollout thread's request parameters (`RolloutWorker.params`), from a worker built on a
    stand-in fleet (no engine)."""
    from types import SimpleNamespace

    from pace.pool.plugins import PoolPolicy
    from pace.rollout.worker import RolloutWorker

    fleet = SimpleNamespace(version=0, device_type="cpu", in_process=False)
    worker = RolloutWorker(fleet, tokenizer, None, SimpleNamespace(policy=PoolPolicy(8, 8)), None, cfg)
    return worker.params


def test_the_fixture_checkpoints_are_the_real_ones(tmp_path):
    """The facts the rule is about: a Base model's files name only <|endoftext|>; its template ends a
    turn with <|im_end|>; the post-trained Qwen3-4B names both."""
    base = tokenizer_of(checkpoint("Qwen3-8B-Base", tmp_path))
    post = tokenizer_of(checkpoint("Qwen3-4B", tmp_path))
    assert (base.eos_token_id, post.eos_token_id) == (ENDOFTEXT, IM_END)
    assert base.convert_tokens_to_ids("<|im_end|>") == IM_END
    prompt = base.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["Qwen3-8B-Base", "Qwen3-4B"])
def test_rollout_and_evaluation_stop_at_the_turn_end_with_the_chat_template(tmp_path, name):
    from pace.evaluation import sampling_params

    path = checkpoint(name, tmp_path)
    tok, cfg = tokenizer_of(path), config(chat_template=True)
    rollout = vllm_stops(rollout_params(cfg, tok), path, tok)
    evaluation = vllm_stops(sampling_params(cfg, tok, seeded=False), path, tok)
    assert rollout == evaluation == {ENDOFTEXT, IM_END}


def test_without_the_chat_template_a_base_model_stops_on_its_eos_only(tmp_path):
    """Raw-text prompts (the tiny presets, `data.chat_template=false`): vLLM's stops, nothing added."""
    from pace.evaluation import sampling_params

    path = checkpoint("Qwen3-8B-Base", tmp_path)
    tok, cfg = tokenizer_of(path), config(chat_template=False)
    assert vllm_stops(rollout_params(cfg, tok), path, tok) == {ENDOFTEXT}
    assert vllm_stops(sampling_params(cfg, tok, seeded=False), path, tok) == {ENDOFTEXT}


def test_stop_on_turn_end_false_keeps_the_checkpoint_eos_only(tmp_path):
    """`data.stop_on_turn_end: false` (a checkpoint saved before the turn-end stop resumes with it):
    templated prompts, and the rollout and evaluation stop on the checkpoint's EOS only, as before."""
    from pace.evaluation import sampling_params

    path = checkpoint("Qwen3-8B-Base", tmp_path)
    tok, cfg = tokenizer_of(path), config(chat_template=True, stop_on_turn_end=False)
    assert vllm_stops(rollout_params(cfg, tok), path, tok) == {ENDOFTEXT}
    assert vllm_stops(sampling_params(cfg, tok, seeded=False), path, tok) == {ENDOFTEXT}


def test_a_checkpoint_saved_before_the_turn_end_stop_resumes_without_it(tmp_path):
    from omegaconf import OmegaConf

    from pace.checkpoint import resume_config

    ckpt = tmp_path / "run" / "checkpoints" / "step-000004"
    ckpt.mkdir(parents=True)
    saved = OmegaConf.to_container(config(chat_template=True))
    del saved["data"]["stop_on_turn_end"]
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    assert resume_config(config(chat_template=True), ckpt, [f"resume={ckpt}"]).data.stop_on_turn_end is False
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(config(chat_template=True)))  # saved with the key: as saved
    assert resume_config(config(chat_template=True), ckpt, [f"resume={ckpt}"]).data.stop_on_turn_end is True


def test_remote_servers_and_tool_turns_get_the_same_stops(tmp_path):
    """A generate-route request carries the stops (the server's engine adds its checkpoint's EOS);
    an evaluation sample's later tool turns keep them."""
    from pace.evaluation import EvalRun, sampling_params
    from pace.rollout.protocol import params_json
    from pace.tasks.base import Prompt

    tok = tokenizer_of(checkpoint("Qwen3-8B-Base", tmp_path))
    cfg = config(chat_template=True)
    assert params_json(rollout_params(cfg, tok))["stop_token_ids"] == [IM_END]

    class Tools:
        tokenizer = tok

        def turn_kwargs(self, turn):
            return {"stop": ["</code>"], "include_stop_str_in_output": True}

    class Engine:
        params = []

        def add_request(self, request_id, prompt, params, priority=0):
            self.params.append(params)

    engine = Engine()
    params = sampling_params(cfg, tok, seeded=False, k=2)
    run = EvalRun({"set": [Prompt("p", "2+2?", "4")]}, params, None, tools=Tools())
    run.submit(engine)
    run._add_turn(("set", 0, 0), [1, 2], [3], turn=1)
    assert len(engine.params) == 3 and all(p.stop_token_ids == [IM_END] for p in engine.params)


def test_a_template_without_a_special_turn_end_is_refused():
    from pace.rollout.stopping import StopTokenError, stop_token_ids
    from pace.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(StopTokenError, match=r"data.chat_template: .* ends an assistant turn with '\\n'"):
        stop_token_ids(tok, config(chat_template=True).data)
    assert stop_token_ids(tok, config(chat_template=False).data) == []
    assert stop_token_ids(tok, config(chat_template=True, stop_on_turn_end=False).data) == []
