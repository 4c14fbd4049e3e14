"""The record every prompt source yields, and the sampler that walks a prompt list."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    """One training or evaluation problem.

    ``text`` is the exact string given to the tokenizer (template already applied);
    ``answer`` is the reference answer graded by ``pace.reward``.
    """

    id: str
    text: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


def with_chat_template(prompts: list[Prompt], tokenizer, enable_thinking: bool | None = None) -> list[Prompt]:
    """Prompts wrapped as one user turn of the tokenizer's chat template (`data.chat_template`);
    ``enable_thinking`` (`data.enable_thinking`) goes to the template when not None (Qwen3's switch)."""
    from dataclasses import replace

    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    wrap = lambda text: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False, **extra
    )
    return [replace(p, text=wrap(p.text)) for p in prompts]


class PromptSampler:
    """Epoch-shuffled, endless walk over a prompt list, checkpointable.

    Prompts handed back with `give_back` (groups cut short by a stop) are drawn again first.
    """

    def __init__(self, prompts: list[Prompt], seed: int = 0):
        if not prompts:
            raise ValueError("PromptSampler: the prompt list is empty")
        self.prompts = prompts
        self.seed = seed
        self.position = 0  # prompts drawn so far, over all epochs
        self._order: list[int] = []
        self._epoch = -1
        self._returned: deque[str] = deque()  # prompt ids handed back, drawn before the walk goes on
        self._index: dict[str, int] | None = None  # prompt id → position in `prompts`, built on demand

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.prompts)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order

    def next(self) -> Prompt:
        if self._returned:
            return self.prompts[self._lookup(self._returned.popleft())]
        epoch, i = divmod(self.position, len(self.prompts))
        self.position += 1
        return self.prompts[self._order_for(epoch)[i]]

    def give_back(self, prompt_ids: list[str]) -> None:
        """Prompts whose groups were cut short: `next` returns them (in this order) before new ones."""
        for pid in prompt_ids:
            self._lookup(pid)  # an unknown id fails here, not when it is drawn
        self._returned.extend(prompt_ids)

    def _lookup(self, prompt_id: str) -> int:
        if self._index is None:
            self._index = {p.id: i for i, p in enumerate(self.prompts)}
        try:
            return self._index[prompt_id]
        except KeyError:
            raise ValueError(f"PromptSampler: prompt id {prompt_id!r} is not in the prompt list") from None

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position, "returned": list(self._returned)}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.position = state["seed"], state["position"]
        self._epoch = -1
        self._returned = deque()
        self.give_back(state.get("returned", []))


def prompt_token_limit(max_model_len: int, max_tokens: int, max_prompt_tokens: int | None = None) -> tuple[int, str]:
    """The longest prompt (tokens) that fits the engine's context with the response budget, and
    the keys that set it (for messages)."""
    limit, keys = max_model_len - max_tokens, f"rollout.max_model_len {max_model_len} − max_tokens {max_tokens}"
    if max_prompt_tokens is not None and max_prompt_tokens < limit:
        limit, keys = max_prompt_tokens, f"data.max_prompt_tokens {max_prompt_tokens}"
    return limit, keys


def engine_token_ids(tokenizer, text: str) -> list[int]:
    """``text``'s token ids as vLLM 0.32's engine makes them from a text prompt: with the tokenizer's
    special tokens (vllm/v1/engine/input_processor.py `process_inputs` → vllm/renderers/base.py
    `default_cmpl_tok_params`; its truncation past max_model_len tokens cannot act on a prompt that
    `drop_overlong` kept). Unlike a training prompt's, which go without (pace/rollout/generation.py)."""
    return tokenizer(text, add_special_tokens=True).input_ids


def drop_overlong(prompts: list[Prompt], tokenizer, limit: int, add_special_tokens: bool = False) -> tuple[list[Prompt], int]:
    """The prompts of at most ``limit`` tokens, and how many were dropped (as verl's
    ``filter_overlong_prompts``): a longer one would fail in the engine mid-run."""
    if not prompts:
        return prompts, 0
    # verbose=False: the tokenizer's own warning about sequences over its model_max_length is this check's job
    ids = tokenizer([p.text for p in prompts], add_special_tokens=add_special_tokens, verbose=False).input_ids
    kept = [p for p, tokens in zip(prompts, ids) if len(tokens) <= limit]
    return kept, len(prompts) - len(kept)
