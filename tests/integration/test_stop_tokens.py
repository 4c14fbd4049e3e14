"""The real engine stops where the chat template ends a turn, on a checkpoint whose EOS is another token.

A copy of the tiny model made to look like a Base checkpoint: its tokenizer and generation config
name <|pad|> as EOS (a token it never writes), while its chat template ends an assistant turn with
<|endoftext|>, the token it was trained to end an answer with (as Qwen3-*-Base names <|endoftext|>
and its template ends turns with <|im_end|>).
"""
from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.integration

TURN_END = 1  # <|endoftext|> of the tiny tokenizer


@pytest.fixture(scope="module")
def base_like(tiny_model_path, tmp_path_factory):
    from transformers import AutoTokenizer

    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib

    path = tmp_path_factory.mktemp("base-like") / "model"
    shutil.copytree(tiny_model_path, path)
    for name, key, value in (("tokenizer_config.json", "eos_token", "<|pad|>"),
                             ("generation_config.json", "eos_token_id", 0), ("config.json", "eos_token_id", 0)):
        data = json.loads((path / name).read_text())
        data[key] = value
        if name == "tokenizer_config.json":  # the prompt as the tiny model was trained on it, a turn closed by its EOS
            data["chat_template"] = ("{% for m in messages %}{{ m.content }}{% if m.role == 'assistant' %}<|endoftext|>"
                                     "{% endif %}{% endfor %}")
        (path / name).write_text(json.dumps(data))
    llm = engine_lib.build_engine(str(path), RolloutConfig(), "float32", seed=0, backend=None)
    yield llm, AutoTokenizer.from_pretrained(path)
    engine_lib.shutdown(llm)


def _outputs(llm, tokenizer, chat_template: bool):
    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.evaluation import sampling_params
    from pace.tasks.arithmetic import ArithmeticSpec, make_prompts

    cfg = OmegaConf.structured(Config)
    cfg.data.chat_template, cfg.eval.max_tokens = chat_template, 64
    prompts = [{"prompt_token_ids": tokenizer(p.text, add_special_tokens=False).input_ids}
               for p in make_prompts(ArithmeticSpec(), "train")[:6]]
    assert tokenizer.eos_token_id == 0
    return [c for out in llm.generate(prompts, sampling_params(cfg, tokenizer, seeded=False, k=2), use_tqdm=False)
            for c in out.outputs]


def test_responses_end_at_the_turn_end_with_the_chat_template(base_like):
    llm, tokenizer = base_like
    completions = _outputs(llm, tokenizer, chat_template=True)
    assert all(c.finish_reason == "stop" and c.stop_reason == TURN_END and c.token_ids[-1] == TURN_END
               and TURN_END not in c.token_ids[:-1] for c in completions)


def test_without_the_stop_responses_run_past_the_turn(base_like):
    """What the rule is for: left to the checkpoint's EOS, the model writes on after its turn's end."""
    llm, tokenizer = base_like
    completions = _outputs(llm, tokenizer, chat_template=False)
    assert any(TURN_END in c.token_ids[:-1] for c in completions)
