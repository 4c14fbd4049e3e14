"""The remote fleet's side of vLLM's serving protocol, without a server: what a streamed chunk and a
full response become (the fields the rollout thread reads), the sampling parameters sent, where
the engines reach trainer rank 0, and the config's one-line errors."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pace.config_checks import validate
from pace.errors import ConfigError
from pace.rollout.protocol import completion_from, params_json, prompt_logprobs_from
from pace.weights.sync import transfer_address
from tests.helpers import compose_cfg

# a final chunk of /inference/v1/generate (stream=true, output_mode=tokens), as vLLM 0.32 sends it
CHUNK = {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [21, 7],
         "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}],
         "logprobs": {"content": [{"token_id": 21, "logprob": -0.5, "rank": 1, "top_logprobs": []},
                                  {"token_id": 7, "logprob": -1.25, "rank": 2, "top_logprobs": []}]}}


def test_a_chunk_becomes_what_the_rollout_reads():
    from pace.rollout.generation import span_versions

    comp = completion_from(CHUNK)
    assert comp.token_ids == [21, 7] and comp.finish_reason == "length"
    assert [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)] == [-0.5, -1.25]
    assert span_versions(comp.weight_versions).tolist() == [3, 4]  # the engine's labels, token by token
    text = completion_from({**CHUNK, "text": "ab", "logprobs": {"content": [{"token": "a", "logprob": -0.5},
                                                                         {"token": "b", "logprob": -1.25}]}})
    assert text.text == "ab" and [lp[t].logprob for t, lp in zip(text.token_ids, text.logprobs)] == [-0.5, -1.25]
    middle = completion_from({**CHUNK, "finish_reason": None, "weight_versions": None})
    assert middle.finish_reason is None and middle.weight_versions is None  # labels come with the last chunk only


def test_a_chunk_s_logprobs_are_flat_and_read_as_they_are():
    """As an engine in this process gives the rollout's requests (flat_logprobs=True): vLLM's
    `FlatLogprobs`, whose flat list is ℓ^μ itself, no dict and `Logprob` a token."""
    from vllm.logprobs import FlatLogprobs

    from pace.rollout.engine import sampled_logprobs

    comp = completion_from(CHUNK)
    assert isinstance(comp.logprobs, FlatLogprobs)
    lps = sampled_logprobs(comp)
    assert lps == [-0.5, -1.25] and lps is comp.logprobs.logprobs


def test_prompt_logprobs_keys_are_token_ids_again():
    entries = [None, {"6": {"logprob": -12.5, "rank": 85, "decoded_token": None}}]
    out = prompt_logprobs_from(entries)
    assert out[0] is None and out[1][6].logprob == -12.5


def test_sampling_params_sent():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    p = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, logprobs=0, stop=["</code>"], detokenize=True,
                       output_kind=RequestOutputKind.DELTA, flat_logprobs=True, stream_interval=16)
    sent = params_json(p)
    keys = ("max_tokens", "temperature", "top_p", "logprobs", "stop", "detokenize", "stream_interval")
    assert {k: sent[k] for k in keys} == {"max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "logprobs": 0, "stop": ["</code>"],
                                          "detokenize": True, "stream_interval": 16}
    assert "flat_logprobs" not in sent  # the server's JSON is the same; its −inf clamp needs its dicts
    assert "output_kind" not in sent  # the server decides it from `stream`


def test_transfer_address():
    rollout = OmegaConf.create({"transfer_address": None, "servers": ["http://127.0.0.1:8100", "http://localhost:8101"]})
    assert transfer_address(rollout) == "127.0.0.1"
    rollout.transfer_address = "10.0.0.7"
    assert transfer_address(rollout) == "10.0.0.7"


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.servers=[http://127.0.0.1:8100]"], "rollout.servers are used with rollout.engine_process=server"),
    (["rollout.engine_process=server", "rollout.servers=[127.0.0.1:8100]"], "is not a URL"),
    (["rollout.engine_process=server", "rollout.weight_transfer=ipc"], "rollout.weight_transfer=ipc"),
    (["rollout.engine_process=server", "rollout.on_engine_failure=retry"], "rollout.on_engine_failure"),
    (["rollout.engine_process=server", "rollout.deterministic=true"], "rollout.deterministic"),
])
def test_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        validate(compose_cfg(overrides))
