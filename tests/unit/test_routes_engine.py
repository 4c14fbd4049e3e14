"""MoE routing replay, the engine side: the rollout worker's real code fed vLLM's own output types
(`RequestOutput` / `CompletionOutput` with `routed_experts`) by a stand-in in-process engine (the
CPU vLLM build cannot return routes: the last test shows why), the remote client's decoding of a
server's base64 routes, and the one-line refusal on this build."""
from __future__ import annotations

import pickle
import time
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from pace.config import Config
from pace.errors import ConfigError
from pace.pool import Pool, build_policy
from pace.tasks.base import Prompt, PromptSampler
from pace.tools.protocol import CODE_STOP

pytestmark = pytest.mark.unit

PROMPT = "1+1=?\n"  # 6 token ids with the stand-in tokenizer
P = len(PROMPT)


class RoutingEngine:
    """An in-process `LLMEngine` stand-in that returns routed experts as vLLM 0.32 does: one token
    per request and step (under the version set last), and on the finished output the rows of
    positions ``routed_experts_prompt_start`` … len(prompt) + generated − 2, each row naming its
    position (layer 0) and the request that computed it (layer 1). Until then its output processor
    holds them a step at a time (`routed_experts_chunks`: the prompt's rows with the first token, one
    row per token after). A tool turn stops at `</code>` after ``turn`` tokens; an abort emits
    nothing (as `LLMEngine.abort_request`)."""

    def __init__(self, first_serial: int = 1, turn: int = 3):
        self.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
        self.output_processor = SimpleNamespace(external_req_ids={}, request_states={})  # routes; no partial versions
        self.requests: dict[str, dict] = {}
        self.asked: list[tuple[str, int]] = []  # (request id, routed_experts_prompt_start) of every request
        self.serial, self.turn, self.version = first_serial - 1, turn, "0"

    def add_request(self, rid, prompt, params, priority=0):
        start = params.routed_experts_prompt_start
        assert 0 <= start <= len(prompt["prompt_token_ids"])  # vLLM's check (v1/engine/input_processor.py)
        self.serial += 1
        self.asked.append((rid, start))
        self.requests[rid] = dict(prompt=list(prompt["prompt_token_ids"]), params=params, versions=[],
                                  serial=self.serial)
        self.output_processor.request_states[rid] = SimpleNamespace(routed_experts_chunks=[])

    def has_unfinished_requests(self):
        return bool(self.requests)

    def set_weight_version(self, version):
        self.version = version

    def abort_request(self, ids):
        for rid in ids:
            self.requests.pop(rid, None)
            self.output_processor.request_states.pop(rid, None)

    def reset_prefix_cache(self, *args):
        return True

    def step(self):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput, WeightVersionSpan

        outs = []
        for rid, r in list(self.requests.items()):
            tok = 40 + r["serial"]
            r["versions"].append(self.version)
            n, params = len(r["versions"]), r["params"]
            first = params.routed_experts_prompt_start if n == 1 else len(r["prompt"]) + n - 2
            positions = np.arange(first, len(r["prompt"]) + n - 1)  # computed in this step
            chunks = self.output_processor.request_states[rid].routed_experts_chunks
            chunks.append(np.stack([np.repeat(positions[:, None], 2, 1), np.full((len(positions), 2), r["serial"])],
                                   axis=1).astype(np.uint8))  # [positions, layers 2, top-k 2]
            reason = stop = None
            if params.stop and n == self.turn:
                reason, stop = "stop", CODE_STOP
            elif n == params.max_tokens:
                reason = "length"
            routes = spans = None
            if reason is not None:
                del self.requests[rid]
                routes = np.concatenate(self.output_processor.request_states.pop(rid).routed_experts_chunks)
                spans = [WeightVersionSpan(v, i, i + 1) for i, v in enumerate(r["versions"])]
            comp = CompletionOutput(0, "", [tok], None, [{tok: Logprob(-0.5)}], routed_experts=routes,
                                    finish_reason=reason, stop_reason=stop, weight_versions=spans)
            outs.append(RequestOutput(rid, None, r["prompt"], None, [comp], reason is not None))
        return outs


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["" for _ in ids]


class Grader:
    def submit(self, texts, answers):
        future = Future()
        future.set_result([False] * len(texts))
        return future

    def check(self):
        pass


class Tools:
    """A `ToolRunner` stand-in: one call per response, its interpreter output two tokens."""

    def __init__(self):
        self.submitted, self.stats, self.running = [], {}, 0

    def turn_kwargs(self, calls):
        return {"stop": [CODE_STOP], "include_stop_str_in_output": True} if calls < 1 else {}

    def submit(self, key, turn_ids, budget):
        self.submitted.append(key)

    def poll(self):
        done, self.submitted = [(key, SimpleNamespace(ok=True), [7, 8]) for key in self.submitted], []
        return done

    def close(self):
        pass


def _worker(engine, max_tokens=6, tools=False):
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker

    cfg = OmegaConf.structured(Config)
    cfg.algo.routing_replay = True
    cfg.data.group_size, cfg.rollout.max_inflight_groups, cfg.rollout.max_tokens = 1, 1, max_tokens
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    worker = RolloutWorker(EngineFleet([SimpleNamespace(llm_engine=engine)]), Tokenizer(),
                           PromptSampler([Prompt("p0", PROMPT, "2")]), pool, grader=Grader(), cfg=cfg)
    if tools:  # (the worker builds a `ToolRunner` when rollout.max_tool_calls > 0)
        worker.tools = Tools()
        worker._sampling["detokenize"] = True  # stop strings are matched on text
        worker.params = worker._turn_params(max_tokens, calls=0)  # the first turn stops at </code>
    return worker


def _update(worker, version):
    """A weight update between engine steps, in-flight requests kept (pause "keep")."""
    worker.fleet.set_version(version)
    worker.engine_version = worker.trainer_version = version


def _graded(worker):
    return worker._grading[-1][0].trajectories[0]


def test_a_request_spanning_an_update_records_its_prompt_and_response_rows():
    engine = RoutingEngine()
    w = _worker(engine)
    assert w._admit()
    for _ in range(3):
        w._consume(w.fleet.step())
    _update(w, 1)
    for _ in range(3):
        w._consume(w.fleet.step())
    t = _graded(w)
    assert t.versions.tolist() == [0, 0, 0, 1, 1, 1] and engine.asked == [(engine.asked[0][0], 0)]
    assert t.prompt_routes.shape == (P, 2, 2) and t.prompt_routes[:, 0, 0].tolist() == list(range(P))
    assert t.routes[:, 0, 0].tolist() == list(range(P, P + 5))  # response tokens 0-4 (the last is no input)
    assert set(t.routes[:, 1, 0].tolist()) == {1}  # one request, one array, across the update
    from pace.loop import step_metrics
    from pace.records import Batch

    pooled = w._grading[-1][0]
    m = step_metrics(Batch(1, [pooled]), w.pool, [], 0.0)
    assert m["moe/route_bytes_per_token"] == (P + 5) * 2 * 2 / 6  # prompt's rows included, per response token


def test_a_tool_turn_asks_for_the_unknown_positions_and_keeps_the_first_turns_rows():
    engine = RoutingEngine()
    w = _worker(engine, max_tokens=8, tools=True)
    w._admit()
    for _ in range(3):  # turn 1 stops at </code> after 3 tokens: rows of positions 0 … P + 1
        w._consume(w.fleet.step())
    w._collect_tools()  # its output (2 tokens) appended; the continuation asks from token 2 (the last sampled)
    rid, start = engine.asked[-1]
    assert start == P + 2 and engine.requests[rid]["prompt"][:P] == [ord(c) for c in PROMPT]
    for _ in range(3):
        w._consume(w.fleet.step())
    t = _graded(w)
    assert len(t) == 8 and t.prompt_routes[:, 1, 0].tolist() == [1] * P
    assert t.routes[:, 0, 0].tolist() == list(range(P, P + 7))
    assert t.routes[:, 1, 0].tolist() == [1, 1, 2, 2, 2, 2, 2]  # turn 1's rows kept; the rest from turn 2


def test_a_response_stopped_and_resumed_keeps_the_first_segments_rows():
    """Turn 1 (finished: its rows recorded), then turn 2 stopped after 2 tokens (an in-process abort
    delivers no rows: they are read from the output processor before it), the checkpoint, `resume=`:
    the continuation asks from the first unknown position and its rows fill the rest; each earlier
    segment's rows stay."""
    engine = RoutingEngine()
    w = _worker(engine, max_tokens=10, tools=True)
    w._admit()
    for _ in range(3):
        w._consume(w.fleet.step())
    w._collect_tools()
    for _ in range(2):  # turn 2 (request 2): 2 tokens, then the stop
        w._consume(w.fleet.step())
    w._abort_all()
    assert not engine.requests
    kept = pickle.loads(pickle.dumps(w.state_dict()["inflight"]))  # as a checkpoint keeps them
    t = kept[0].responses[0]
    assert len(t) == 7 and t.routes[:, 1, 0].tolist() == [1, 1, 2, 2, 2, 2]  # turn 1's rows, request 2's so far

    again = RoutingEngine(first_serial=10)
    w2 = _worker(again, max_tokens=10, tools=True)
    _update(w2, 1)  # the resumed weights
    w2.load_inflight(kept, 1)
    assert w2._continue_resumed()
    rid, start = again.asked[-1]
    assert start == P + 6  # the first unknown position: the last token read before the stop
    for _ in range(3):
        w2._consume(w2.fleet.step())
    t = _graded(w2)
    assert t.versions.tolist() == [0] * 7 + [1] * 3
    assert t.prompt_routes[:, 1, 0].tolist() == [1] * P  # the first segment's rows: request 1's
    assert t.routes[:, 0, 0].tolist() == list(range(P, P + 9))
    assert t.routes[:, 1, 0].tolist() == [1, 1, 2, 2, 2, 2, 10, 10, 10]


def test_a_snapshot_while_requests_run_on_leaves_their_routes_to_their_finish():
    """A periodic checkpoint (the thread paused, requests running on) keeps the finished requests'
    routes only; the running request records its own, from the position it asked for, when it ends."""
    engine = RoutingEngine()
    w = _worker(engine)
    w._admit()
    for _ in range(3):
        w._consume(w.fleet.step())
    w._settle_versions(cut=False)  # what `inflight_state` does for a snapshot
    assert w._pending[next(iter(w._pending))].responses[0].routes is None
    for _ in range(3):
        w._consume(w.fleet.step())
    t = _graded(w)
    assert t.routes[:, 0, 0].tolist() == list(range(P, P + 5)) and t.prompt_routes[:, 0, 0].tolist() == list(range(P))


def test_a_finished_output_without_routes_is_refused_in_one_line():
    engine = RoutingEngine()
    w = _worker(engine, max_tokens=1)
    w._admit()
    out = engine.step()[0]
    out.outputs[0].routed_experts = None  # a server started without the flag
    out.engine = 0
    with pytest.raises(ConfigError, match=r"^algo\.routing_replay=true: rollout engine 0 returned no routed experts"):
        w._consume([out])


def test_the_remote_client_decodes_a_final_chunks_routes():
    from vllm.sampling_params import SamplingParams
    from vllm.utils.serial_utils import numpy2base64

    from pace.rollout.protocol import completion_from, params_json

    rows = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2)
    chunk = {"index": 0, "finish_reason": "length", "token_ids": [21], "routed_experts": numpy2base64(rows),
             "logprobs": {"content": [{"token_id": 21, "logprob": -0.5}]}}
    comp = completion_from(chunk)
    assert comp.routed_experts.dtype == np.uint8 and np.array_equal(comp.routed_experts, rows)
    assert completion_from({**chunk, "routed_experts": None, "finish_reason": None}).routed_experts is None
    wide = rows.astype(np.uint16) + 300  # above 256 experts vLLM sends uint16
    assert np.array_equal(completion_from({**chunk, "routed_experts": numpy2base64(wide)}).routed_experts, wide)
    assert params_json(SamplingParams(max_tokens=4, routed_experts_prompt_start=17))["routed_experts_prompt_start"] == 17


def test_this_vllm_build_refuses_routing_replay_in_one_line(monkeypatch, tmp_path):
    from pace.placement import Placement
    from pace.rollout import engine as engine_lib
    from pace.rollout import routes, server

    with pytest.raises(ConfigError) as info:
        routes.check_engine()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("algo.routing_replay=true: the rollout engines cannot return routed experts")
    assert "HAS_TRITON is False" in msg and "vllm/config/vllm.py:" in msg
    import vllm.config.vllm as vllm_config

    source = open(vllm_config.__file__, encoding="utf-8").read().splitlines()
    for line in msg.split("vllm/config/vllm.py:")[1:]:  # the installed vLLM's own lines
        assert "Model Runner V2" in source[int(line.split(")")[0]) - 1]
    cfg = OmegaConf.structured(Config)
    cfg.algo.routing_replay = True
    with pytest.raises(ConfigError, match="HAS_TRITON"):  # refused before any engine is built
        engine_lib.build_engines("no-such-model", cfg.rollout, "float32", 0, Placement("cpu", 1, "inproc", "shm", None),
                                 routes=True)
    with pytest.raises(ConfigError, match="HAS_TRITON"):  # before any server starts
        server.launch_local("no-such-model", cfg, Placement("cpu", 1, "server", "shm", None), tmp_path)
    assert not list(tmp_path.iterdir())
    assert routes.SERVE_FLAG in server.serve_args("m", cfg.rollout, "float32", 0, 8100, routes=True)
    assert routes.SERVE_FLAG not in server.serve_args("m", cfg.rollout, "float32", 0, 8100)
    built = {}  # what an engine is built with (where vLLM can return routes)
    monkeypatch.setattr("vllm.LLM", lambda **kwargs: built.update(kwargs))
    engine_lib._new_llm("m", cfg.rollout, "float32", 0, None, routes=True)
    assert built["enable_return_routed_experts"] is True and built["enable_prefix_caching"] is True
    # vLLM's own decision, not a constant: with Triton it can; with Model Runner V2 turned off it cannot
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", True)
    assert routes.unsupported() is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert routes.unsupported().startswith("VLLM_USE_V2_MODEL_RUNNER=0 turns off Model Runner V2")


def test_a_request_whose_record_grew_while_it_ran_puts_its_rows_where_it_asked():
    """Rows read from the output processor before an abort that then did not happen (a best-effort
    abort at shutdown can fail): the request finishes and returns its rows from the start it asked
    for; they land at their positions (the record's length then is not where they start)."""
    engine = RoutingEngine()
    w = _worker(engine)
    w._admit()
    for _ in range(3):
        w._consume(w.fleet.step())
    w._settle_versions(cut=True)  # the stop's read, without the abort
    assert len(w._pending[next(iter(w._pending))].responses[0].routes) == 2
    for _ in range(3):
        w._consume(w.fleet.step())
    t = _graded(w)
    assert t.prompt_routes[:, 0, 0].tolist() == list(range(P)) and t.routes[:, 0, 0].tolist() == list(range(P, P + 5))


def test_a_group_in_flight_from_a_checkpoint_before_routing_replay_loads():
    from pace.records import Group
    from pace.rollout.generation import _Pending

    old = _Pending(Group(0, "p0", [1, 2], "2", 0), 1)
    del old.__dict__["route_start"]  # as pickled before the field existed
    assert pickle.loads(pickle.dumps(old)).route_start == {}


class SpecialTokenizer:
    """A tokenizer whose special tokens show: a BOS (1) in front when they are added (HF's default, and
    vLLM's for a text prompt), as Llama's does; vLLM's truncation arguments accepted."""

    def __call__(self, text, add_special_tokens=True, truncation=False, max_length=None):
        ids = [1] * add_special_tokens + [ord(c) for c in text]
        return SimpleNamespace(input_ids=ids[:max_length] if truncation else ids)

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["" for _ in ids]


def _engine_ids(tokenizer, text: str, max_model_len: int) -> list[int]:
    """``text`` tokenized as vLLM 0.32's engine tokenizes a text prompt: with the arguments of its
    renderer's `default_cmpl_tok_params` (vllm/renderers/base.py; vllm/v1/engine/input_processor.py
    `process_inputs`), taken from vLLM itself."""
    from vllm.renderers.base import BaseRenderer

    renderer = SimpleNamespace(mm_processor=None, model_config=SimpleNamespace(max_model_len=max_model_len,
                                                                               encoder_config=None))
    params = BaseRenderer.default_cmpl_tok_params.func(renderer)
    return tokenizer(text, **params.get_encode_kwargs()).input_ids


VAL_SETS = {"arith_l1": [Prompt("v0", "2+3=?\n", "5"), Prompt("v1", "10+20=?\n", "30")]}


def test_a_validation_request_under_routing_replay_goes_as_token_ids_asking_no_routes():
    """In-training validation on a routing-replay engine: each problem's request carries the token ids
    the engine would have made from its text, and asks for routed experts from the end of its prompt
    (vLLM 0.32's only per-request control: its prompt's rows are not returned)."""
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker

    cfg = OmegaConf.structured(Config)
    cfg.algo.routing_replay = True
    cfg.eval.every, cfg.eval.val_k = 1, 2
    engine = RoutingEngine()
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    worker = RolloutWorker(EngineFleet([SimpleNamespace(llm_engine=engine)]), SpecialTokenizer(),
                           PromptSampler([Prompt("p0", PROMPT, "2")]), pool, grader=Grader(), cfg=cfg, val_sets=VAL_SETS)
    worker._maybe_validate(None)  # θ_0 (eval.at_start)
    assert worker.val_started == 0 and len(engine.asked) == 2
    for (rid, start), problem in zip(engine.asked, VAL_SETS["arith_l1"]):
        ids = _engine_ids(SpecialTokenizer(), problem.text, cfg.rollout.max_model_len)
        assert ids[0] == 1 and engine.requests[rid]["prompt"] == ids  # special tokens as the engine adds them
        assert start == len(ids)  # no prompt row asked for
        assert engine.requests[rid]["params"].n == 2
    run = worker._val[0]
    key = run.request_ids[0]
    engine.abort_request([key])
    run.resubmit(worker.fleet, key)  # its engine failed (pace/rollout/failover.py): sent again as first sent
    assert engine.asked[-1] == engine.asked[0] and engine.requests[key]["prompt"] == _engine_ids(
        SpecialTokenizer(), VAL_SETS["arith_l1"][0].text, cfg.rollout.max_model_len)


def test_a_validation_request_sent_to_a_server_carries_token_ids_and_asks_no_prompt_routes(monkeypatch):
    """The body RemoteFleet posts to /inference/v1/generate for an in-training validation request."""
    from pace.rollout.remote import RemoteFleet
    from pace.rollout.server_state import Server
    from pace.rollout.worker import RolloutWorker

    bodies = []

    async def record(self, server, rid, serial, body, stream):
        bodies.append(body)

    monkeypatch.setattr(RemoteFleet, "_request", record)
    cfg = OmegaConf.structured(Config)
    cfg.algo.routing_replay = True
    cfg.eval.every, cfg.eval.val_k = 1, 4
    tok = SpecialTokenizer()
    fleet = RemoteFleet([], tokenizer=tok, stream_reader="thread")
    try:
        fleet.servers.append(Server(0, "http://node1:8100"))
        fleet._load.append(0)
        fleet.version = 0  # as `remote.build` leaves it (labelling a server is no part of this test)
        pool = Pool(build_policy(cfg), informative=lambda g: True)
        worker = RolloutWorker(fleet, tok, PromptSampler([Prompt("p0", PROMPT, "2")]), pool, grader=Grader(), cfg=cfg,
                               val_sets=VAL_SETS)
        worker._maybe_validate(None)
        deadline = time.monotonic() + 10
        while len(bodies) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        fleet.shutdown()
    for body, problem in zip(sorted(bodies, key=lambda b: b["request_id"]), VAL_SETS["arith_l1"]):
        ids = _engine_ids(tok, problem.text, cfg.rollout.max_model_len)
        assert body["token_ids"] == ids and body["sampling_params"]["n"] == 4 and not body["stream"]
        assert body["sampling_params"]["routed_experts_prompt_start"] == len(ids)  # no prompt row asked for
