"""The prompts a run uses, from its config: training prompts (`data.*`) and in-training validation
sets (`eval.*`), checked against the engine's context before any engine starts.

A prompt that cannot fit `rollout.max_model_len` with the response budget would stop the rollout
thread mid-run with vLLM's "prompt contains at least N input tokens"; such prompts are dropped here
with one warning naming the source and the count (as verl's ``filter_overlong_prompts``), and a
source with nothing left is a `DataError` naming the keys to change.
"""
from __future__ import annotations

import sys

from omegaconf import OmegaConf

from pace.errors import DataError
from pace.tasks.base import Prompt, drop_overlong, prompt_token_limit, with_chat_template
from pace.tasks.math import load_math_prompts


def train_prompts(cfg, tokenizer) -> list[Prompt]:
    """`data.source`'s prompts with the template (and chat template) applied, overlong ones dropped."""
    if cfg.data.source == "arithmetic":
        from pace.tasks.arithmetic import make_prompts

        prompts = make_prompts(OmegaConf.to_object(cfg.data.arithmetic), cfg.data.split)
    elif cfg.data.source == "tool_arithmetic":
        from pace.tasks import tool_arithmetic

        prompts = tool_arithmetic.make_prompts(OmegaConf.to_object(cfg.data.tool_arithmetic), cfg.data.split)
    else:
        try:
            prompts = load_math_prompts(cfg.data.path, cfg.data.split, cfg.data.template, dedup=cfg.data.dedup)
        except DataError as exc:
            raise DataError(f"data.path: {exc}") from exc
    if cfg.data.chat_template:
        prompts = with_chat_template(prompts, tokenizer, cfg.data.enable_thinking)
    return fit_train_prompts(cfg, prompts, tokenizer)


def fit_train_prompts(cfg, prompts: list[Prompt], tokenizer) -> list[Prompt]:
    """Drop the prompts that cannot fit the context with `rollout.max_tokens` (or are over
    `data.max_prompt_tokens`), tokenized as the rollout does (no special tokens added)."""
    r = cfg.rollout
    limit, keys = prompt_token_limit(r.max_model_len, r.max_tokens, cfg.data.max_prompt_tokens)
    source = cfg.data.path if cfg.data.source == "math" else f"data.source={cfg.data.source}"
    kept, dropped = drop_overlong(prompts, tokenizer, limit)
    if not kept:
        raise DataError(f"{source}: all {len(prompts)} prompts are longer than {limit} tokens ({keys}): raise "
                        "rollout.max_model_len, or lower rollout.max_tokens or data.max_prompt_tokens")
    if dropped:
        print(f"warning: {source}: dropped {dropped} of {len(prompts)} prompts longer than {limit} tokens ({keys})",
              file=sys.stderr)
    return kept


def val_sets(cfg, tokenizer) -> dict[str, list[Prompt]]:
    """The in-training validation sets (`eval.benchmarks`, the first `eval.val_max_problems` of each)."""
    from pace.evaluation import sets_from_config

    try:
        sets, dropped = sets_from_config(cfg, tokenizer)
    except DataError as exc:
        raise DataError(f"eval.benchmarks: {exc}") from exc
    for name, n in dropped.items():
        if n:
            print(f"warning: validation set {name}: dropped {n} prompts too long for the engine's context",
                  file=sys.stderr)
    if cfg.eval.val_max_problems is not None:
        sets = {name: ps[: cfg.eval.val_max_problems] for name, ps in sets.items()}
    return sets
