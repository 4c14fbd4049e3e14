"""Prompts that cannot fit the engine's context are found at load (pace.tasks.loading), before any
engine starts: dropped with one warning naming the source and the count, or, with nothing left, one
error naming the keys. The tiny model's character-level tokenizer makes token counts = characters."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from pace.config import Config
from pace.errors import DataError
from pace.evaluation import markdown_table, sets_from_config
from pace.tasks.base import Prompt, drop_overlong, prompt_token_limit
from pace.tasks.loading import train_prompts
from pace.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _cfg(**overrides):
    cfg = OmegaConf.structured(Config)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def test_drop_overlong_keeps_prompts_of_at_most_the_limit(tokenizer):
    prompts = [Prompt(f"p{n}", "x" * n, "1") for n in (5, 10, 11, 3)]
    kept, dropped = drop_overlong(prompts, tokenizer, limit=10)
    assert [p.id for p in kept] == ["p5", "p10", "p3"] and dropped == 1
    assert prompt_token_limit(256, 96) == (160, "rollout.max_model_len 256 − max_tokens 96")
    assert prompt_token_limit(256, 96, max_prompt_tokens=100)[0] == 100
    assert prompt_token_limit(256, 96, max_prompt_tokens=500)[0] == 160  # the context still binds


def _math_file(tmp_path, problem_lengths):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"problem": "y" * n, "answer": "1"}) + "\n" for n in problem_lengths))
    return path


def test_training_prompts_too_long_for_the_context_are_dropped_with_one_warning(tokenizer, tmp_path, capsys):
    limit = 256 - 96
    path = _math_file(tmp_path, [limit, limit + 1, 5, 500])
    cfg = _cfg(**{"data.source": "math", "data.path": str(path), "data.template": "plain"})
    prompts = train_prompts(cfg, tokenizer)
    assert [len(p.text) for p in prompts] == [limit, 5]
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]  # not the counts
    assert err == [f"warning: {path}: dropped 2 of 4 prompts longer than {limit} tokens "
                   "(rollout.max_model_len 256 − max_tokens 96)"]

    cfg.data.max_prompt_tokens = 5  # a tighter limit of one's own
    assert [len(p.text) for p in train_prompts(cfg, tokenizer)] == [5]
    assert "data.max_prompt_tokens" in capsys.readouterr().err


def test_no_prompt_fitting_is_one_error_naming_the_keys(tokenizer, tmp_path):
    path = _math_file(tmp_path, [400, 500])
    cfg = _cfg(**{"data.source": "math", "data.path": str(path), "data.template": "plain"})
    with pytest.raises(DataError, match=r"all 2 prompts are longer than 160 tokens .*raise rollout.max_model_len"):
        train_prompts(cfg, tokenizer)
    cfg = _cfg(**{"data.arithmetic.n_train": 16, "rollout.max_model_len": 20, "rollout.max_tokens": 16})
    with pytest.raises(DataError, match="data.source=arithmetic: all 16 prompts"):
        train_prompts(cfg, tokenizer)


def test_eval_sets_drop_per_benchmark_and_the_table_reports_it(tokenizer, tmp_path):
    rows = [{"problem": "z" * n, "answer": "2"} for n in (10, 300, 20)]
    (tmp_path / "aime_2024.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(**{"eval.benchmarks": ["aime_2024", "arithmetic"], "eval.data_dir": str(tmp_path),
                  "data.template": "plain"})
    sets, dropped = sets_from_config(cfg, tokenizer)
    assert len(sets["aime_2024"]) == 2 and dropped["aime_2024"] == 1
    assert dropped["arith_l1"] == 0 and len(sets["arith_l1"]) > 0
    table = markdown_table({"tiny": {"aime_2024": 0.5, "avg": 0.5}}, k=4, dropped=dropped)
    assert table.rstrip().endswith("Prompts dropped (too long for the engine's context): AIME 2024 1")

    cfg.eval.max_tokens, cfg.eval.benchmarks = 250, ["aime_2024"]  # the eval budget, not the training one
    with pytest.raises(DataError, match="aime_2024: all 3 prompts are longer than 6 tokens"):
        sets_from_config(cfg, tokenizer)


# Qwen3's chat template, cut to its generation prompt: thinking off adds an empty think block.
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")


@pytest.mark.parametrize("thinking, block", [(None, False), (True, False), (False, True)])
def test_enable_thinking_reaches_the_chat_template(tmp_path, thinking, block):
    tok = build_tokenizer()
    tok.chat_template = QWEN3_TEMPLATE
    path = _math_file(tmp_path, [3])
    cfg = _cfg(**{"data.source": "math", "data.path": str(path), "data.template": "plain", "data.chat_template": True,
                  "data.enable_thinking": thinking})
    [p] = train_prompts(cfg, tok)
    assert p.text.startswith("<|im_start|>user\nyyy<|im_end|>\n<|im_start|>assistant\n")
    assert p.text.endswith("<think>\n\n</think>\n\n") == block
