"""Where a response ends: the checkpoint's EOS, and with `data.chat_template` the template's turn end.

vLLM 0.32 ends a request on (vllm/v1/engine/input_processor.py calls
`SamplingParams.update_from_generation_config`; vllm/v1/core/sched/utils.py `check_stop`):
the tokenizer's `eos_token_id`, every `eos_token_id` of the checkpoint's generation_config.json
(an int or a list; with no such file, config.json's), and the request's own `stop_token_ids`
(none unless set here; `ignore_eos` is never set). The stopping token is the response's last
token either way, and `finish_reason` is "stop".

A Base checkpoint names only its document end: Qwen3-*-Base's tokenizer `eos_token` and
generation_config `eos_token_id` are both <|endoftext|> (151643), while the chat template closes
every turn with <|im_end|> (151645); the post-trained Qwen3-4B names both. A prompt wrapped in the
template (`data.chat_template`) ends with the assistant's header, so a response is one assistant
turn and ends where the template ends that turn. Left to the checkpoint's EOS, a Base model that
closes its turn goes on writing (a next turn, another answer) until <|endoftext|> or
`rollout.max_tokens`: lengths, the overlong penalty and the graded answer would all come from text
after the turn. So the rollout and every evaluation stop on the turn end too (`stop_token_ids`);
without `data.chat_template` the prompt is raw text and only the EOS ends a response.
`data.stop_on_turn_end: false` keeps the EOS only (a checkpoint saved before the turn-end stop
resumes with it false: `KEYS_ADDED` in pace/config.py).
"""
from __future__ import annotations

from pace.errors import ConfigError

_PROBE = "PACE-TURN-END-PROBE"


class StopTokenError(ConfigError):
    """The chat template's end of an assistant turn is not one special token to stop on."""


def turn_end_id(tokenizer) -> int:
    """The token the tokenizer's chat template closes an assistant turn with: the first token after
    the assistant's content in a rendered conversation, which must be a special (added) token."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}],
                                         tokenize=False)
    at = text.rfind(_PROBE)
    if at < 0:
        raise StopTokenError("data.chat_template: the tokenizer's chat template drops an assistant turn's content; "
                             "cannot find where a turn ends")
    rest = text[at + len(_PROBE):]
    ids = tokenizer(rest, add_special_tokens=False).input_ids if rest else []
    added = tokenizer.added_tokens_decoder
    if not ids or ids[0] not in added or not added[ids[0]].special:
        raise StopTokenError(f"data.chat_template: the chat template ends an assistant turn with {rest!r}, "
                             "not with a special token to stop on")
    return ids[0]


def stop_token_ids(tokenizer, data) -> list[int]:
    """The `stop_token_ids` of every generation request (rollout turns, validation, eval.py), from the
    `data` config group: the template's turn end when prompts are wrapped in it (`data.chat_template`)
    and `data.stop_on_turn_end`, else none (vLLM adds the checkpoint's EOS ids itself)."""
    return [turn_end_id(tokenizer)] if data.chat_template and data.stop_on_turn_end else []
