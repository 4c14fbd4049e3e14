"""Synthetic rollout engines at a set token rate, for measuring what the rollout client costs rank 0
(scripts/bench_client_cost.py). Nothing runs a model: each engine emits one token per running
request per step, paced so that it produces ``rate`` tokens/s, each response ending after a length
drawn uniformly from [1, max_tokens] (`length`: requests finish and start all the time), in vLLM's own types, so the client's
side of every path runs unchanged:

- ``inproc``: `InprocFeed` replaces an `LLMEngine`'s core client (vLLM's `InprocClient`): the
  engine's real `step()` (output processor, per-token log-prob objects, weight-version spans) runs
  in the caller's thread, as an in-process engine's does. The stand-in core's own work (building
  the `EngineCoreOutputs`, what vLLM's scheduler does after a step) is timed apart (`core_s`).
- ``child``: `ChildFeed` is vLLM's `SyncMPClient` as far as the client's process is concerned:
  requests encoded with vLLM's `MsgpackEncoder` and sent over ZMQ, outputs received on a thread of
  this process and decoded with its `MsgpackDecoder` (the loop of `SyncMPClient.__init__`'s
  `process_outputs_socket`, vllm/v1/engine/core_client.py:948-972), into `outputs_queue`; the
  stand-in core runs in its own process (`_core_main`).
- ``servers``: `serve` is a stand-in for one `vllm serve --enable-scale-out` process: its
  `/inference/v1/generate` streams one server-sent event per token in vLLM's format (its own
  pydantic models, serialised as vllm/entrypoints/scale_out/token_in_token_out/serving.py does),
  the client being the run's `RemoteFleet`.

Scoring requests (`prompt_logprobs`, PACE's rescoring) get one output with the prompt's log-probs
(`LogprobsTensors`; over HTTP, the whole response at once, as vLLM answers a non-streamed request).
"""
from __future__ import annotations

import os
import queue
import threading
import zlib
import time
from collections import deque

import numpy as np


class Feed:
    """One engine core's scheduling: up to ``max_running`` requests, one token each per step, steps
    paced at ``rate`` tokens/s (None: as fast as asked). A request is its id, max_tokens, its prompt
    ids if it asks for their log-probs (scoring; else None) and whether it asks for ℓ^μ."""

    def __init__(self, rate: float | None, max_running: int, version: str = "0"):
        self.rate, self.max_running, self.version = rate, max_running, version
        self.waiting: deque = deque()
        self.running: dict[str, list] = {}
        self.next_t: float | None = None
        self.tokens = 0

    def add(self, rid: str, max_tokens: int, prompt: list | None, logprobs: bool = True) -> None:
        self.waiting.append([rid, max_tokens, prompt, logprobs, 0])

    def abort(self, ids) -> None:
        ids = set(ids)
        for rid in ids:
            self.running.pop(rid, None)
        self.waiting = deque(r for r in self.waiting if r[0] not in ids)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def due(self) -> float:
        """Seconds until the next step may run."""
        return 0.0 if self.next_t is None else max(self.next_t - time.perf_counter(), 0.0)

    def step(self):
        """One step's `EngineCoreOutputs` (vLLM's types; the caller paces it with `due`)."""
        import torch
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.outputs import LogprobsLists, LogprobsTensors

        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            self.running[r[0]] = r
        outs = []
        for rid, r in list(self.running.items()):
            _, max_tokens, prompt, logprobs, done = r
            tok = 5 + (hash(rid) + done) % 90
            new = EngineCoreOutput(rid, [tok])
            if logprobs:  # the sampled token's (logprobs=0)
                new.new_logprobs = LogprobsLists(np.array([[tok]], dtype=np.int32), np.array([[-0.25]], dtype=np.float32),
                                                 np.zeros(1, np.int32))
            if prompt is not None and done == 0:  # the prompt's log-probs, from its second token on (as the model runner gives them)
                n = len(prompt) - 1
                new.new_prompt_logprobs_tensors = LogprobsTensors(torch.tensor(prompt[1:], dtype=torch.int32).unsqueeze(1),
                                                                  torch.full((n, 1), -0.5), torch.ones(n, dtype=torch.int32))
            r[4] = done = done + 1
            if done >= length(rid, max_tokens):
                new.finish_reason = FinishReason.LENGTH if done >= max_tokens else FinishReason.STOP
                del self.running[rid]
            outs.append(new)
        self.tokens += len(outs)
        now = time.perf_counter()
        if self.rate:
            self.next_t = max(self.next_t or now, now - 0.05) + len(outs) / self.rate
        return EngineCoreOutputs(outputs=outs, weight_version=self.version)


def length(rid: str, max_tokens: int) -> int:
    """A response's length: uniform in [1, max_tokens] (mean about max_tokens / 2), fixed by its id."""
    return 1 + zlib.crc32(rid.encode()) % max_tokens


def _request_fields(request) -> tuple:
    sp = request.sampling_params
    scoring = sp.prompt_logprobs is not None
    return request.request_id, sp.max_tokens, list(request.prompt_token_ids) if scoring else None, sp.logprobs is not None


class InprocFeed:
    """An `LLMEngine`'s core client (`engine.engine_core`) whose core is a `Feed` run in this thread:
    `get_output` waits out the step's pacing (sleeping: the GIL is free, as while a GPU steps) and
    returns its outputs. ``core_s``: this thread's CPU seconds spent building them."""

    def __init__(self, rate: float | None, max_running: int):
        self.feed = Feed(rate, max_running)
        self.core_s = 0.0

    def add_request(self, request) -> None:
        self.feed.add(*_request_fields(request))

    def abort_requests(self, request_ids) -> None:
        self.feed.abort(request_ids)

    def dp_engines_running(self) -> bool:
        return False

    def set_weight_version(self, version: str) -> None:
        self.feed.version = version

    def set_rate(self, rate: float | None) -> None:
        self.feed.rate, self.feed.next_t = rate, None

    def get_output(self):
        from vllm.v1.engine import EngineCoreOutputs

        if not self.feed.has_work():
            return EngineCoreOutputs()
        wait = self.feed.due()
        if wait > 0:
            time.sleep(wait)
        t0 = time.thread_time()
        out = self.feed.step()
        self.core_s += time.thread_time() - t0
        return out

    def shutdown(self, timeout: float | None = None) -> None:
        pass


def pin(cores: set[int] | None) -> None:
    """This process on ``cores`` only (None: where it was)."""
    if cores:
        os.sched_setaffinity(0, cores)


def _core_main(in_addr: str, out_addr: str, rate: float | None, max_running: int, cores: set[int] | None = None) -> None:
    """A child engine's core process: requests in (vLLM's msgpack), paced steps out."""
    pin(cores)
    import zmq
    from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(in_addr)
    push.connect(out_addr)
    requests, aborts, encoder = MsgpackDecoder(EngineCoreRequest), MsgpackDecoder(list[str]), MsgpackEncoder()
    feed = Feed(rate, max_running)
    while True:
        wait = feed.due() if feed.has_work() else 1.0
        if pull.poll(int(wait * 1000)):
            kind, *frames = pull.recv_multipart(copy=False)
            kind = bytes(kind.buffer)
            if kind == EngineCoreRequestType.ADD.value:
                feed.add(*_request_fields(requests.decode(frames)))
            elif kind == EngineCoreRequestType.ABORT.value:
                feed.abort(aborts.decode(frames))
            elif kind == b"R":  # the benchmark sets the rate (tokens/s; 0: unpaced)
                feed.rate, feed.next_t = float(bytes(frames[0].buffer)) or None, None
            elif kind == b"V":  # `set_weight_version`
                feed.version = bytes(frames[0].buffer).decode()
            else:
                break
            continue
        if feed.has_work() and feed.due() == 0:
            push.send_multipart(encoder.encode(feed.step()), copy=False)
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


class ChildFeed:
    """vLLM's `SyncMPClient` as its caller's process sees it, around a `Feed` in a process of its own."""

    def __init__(self, rate: float | None, max_running: int, cores: set[int] | None = None):
        import multiprocessing as mp

        import zmq
        from vllm.v1.engine import EngineCoreOutputs
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.ctx = zmq.Context()
        self.input, output = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        in_port = self.input.bind_to_random_port("tcp://127.0.0.1")
        out_port = output.bind_to_random_port("tcp://127.0.0.1")
        self.proc = mp.get_context("spawn").Process(
            target=_core_main, args=(f"tcp://127.0.0.1:{in_port}", f"tcp://127.0.0.1:{out_port}", rate, max_running, cores),
            daemon=True)
        self.proc.start()
        self.encoder = MsgpackEncoder()
        decoder = MsgpackDecoder(EngineCoreOutputs)
        self.outputs_queue: queue.Queue = queue.Queue()
        outputs_queue, self._closing = self.outputs_queue, threading.Event()

        def process_outputs_socket():  # vllm/v1/engine/core_client.py:948-972, less the shutdown socket
            poller = zmq.Poller()
            poller.register(output, zmq.POLLIN)
            while not self._closing.is_set():
                if not poller.poll(100):
                    continue
                frames = output.recv_multipart(copy=False)
                outputs_queue.put_nowait(decoder.decode(frames))
            output.close(linger=0)

        self.thread = threading.Thread(target=process_outputs_socket, name="EngineCoreOutputQueueThread", daemon=True)
        self.thread.start()

    def _send(self, kind, request) -> None:
        self.input.send_multipart((kind.value, *self.encoder.encode(request)), copy=False)

    def add_request(self, request) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def dp_engines_running(self) -> bool:
        return False

    def set_weight_version(self, version: str) -> None:
        self.input.send_multipart((b"V", version.encode()))

    def set_rate(self, rate: float | None) -> None:
        self.input.send_multipart((b"R", str(rate or 0).encode()))

    def get_output(self):
        return self.outputs_queue.get()

    def shutdown(self, timeout: float | None = None) -> None:
        self.input.send_multipart((b"Q",))
        self.proc.join(timeout or 5)
        if self.proc.is_alive():
            self.proc.kill()
        self._closing.set()
        self.thread.join(1)
        self.input.close(linger=0)


class FeedEngines:
    """``n`` `LLMEngine`s for an `EngineFleet`, each a shallow copy of ``engine`` (a real one: its
    input processor and renderer) with its own output processor (emitting a request's outputs every
    ``stream_interval`` tokens at least: vLLM's `--stream-interval`; a request may ask for more) and
    a stand-in core (``mode``)."""

    def __init__(self, engine, n: int, mode: str, rate: float | None, max_running: int, stream_interval: int = 1,
                 cores: set[int] | None = None):
        import copy

        from vllm.v1.engine.output_processor import OutputProcessor

        engine.get_supported_tasks()  # cached on the engine (a request asks for it)
        self.llms = []
        for _ in range(n):
            e = copy.copy(engine)
            e.output_processor = OutputProcessor(engine.renderer.tokenizer, log_stats=engine.log_stats,
                                                 stream_interval=stream_interval)
            e.engine_core = InprocFeed(rate / n if rate else None, max_running) if mode == "inproc" else \
                ChildFeed(rate / n if rate else None, max_running, cores)
            self.llms.append(_Llm(e))

    def set_rate(self, rate: float | None) -> None:
        for llm in self.llms:
            llm.llm_engine.engine_core.set_rate(rate / len(self.llms) if rate else None)

    def core_seconds(self) -> float:
        return sum(getattr(llm.llm_engine.engine_core, "core_s", 0.0) for llm in self.llms)

    def shutdown(self) -> None:
        for llm in self.llms:
            llm.llm_engine.engine_core.shutdown()


class _Llm:
    def __init__(self, engine):
        self.llm_engine = engine


# --- a stand-in vLLM server ------------------------------------------------------------------
def serve(port_out, rate: float | None, max_running: int, stream_interval: int = 1, cores: set[int] | None = None) -> None:
    """A process serving vLLM's generate route at ``rate`` tokens/s, streamed one event per
    ``stream_interval`` tokens (vLLM's `--stream-interval`; a request asking for more gets its own,
    as vLLM clamps it); the port it listens on is put on ``port_out``. The events are built with
    vLLM's own models, two per request (the chunks' tokens repeat), and the last carries the
    request's weight-version span. ``cores``: the CPUs the process runs on (None: any)."""
    pin(cores)
    import asyncio

    from aiohttp import web
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProb, GenerateLogProbs, GenerateLogProbsContent, GenerateTokensChoice, GenerateTokensResponse,
        GenerateTokensStreamChoice, GenerateTokensStreamResponse)
    from vllm.logprobs import Logprob
    from vllm.outputs import WeightVersionSpan

    state = {"tick": None, "running": 0, "slots": None}  # (the future and semaphore: made on the loop)

    def event(rid: str, k: int, last: int | None) -> bytes:
        """One event of ``k`` tokens (``last``: the response's length, on its final event)."""
        toks = [5 + (hash(rid) + i) % 90 for i in range(k)]
        # each token's entry as vLLM's `_create_tokens_logprobs` writes it for logprobs=0: its rank and
        # a one-entry top_logprobs (max(logprobs, 1))
        content = [GenerateLogProbsContent(token_id=t, logprob=-0.25, rank=1,
                                           top_logprobs=[GenerateLogProb(token_id=t, logprob=-0.25, rank=1)]) for t in toks]
        choice = GenerateTokensStreamChoice(
            index=0, token_ids=toks, finish_reason="stop" if last else None, logprobs=GenerateLogProbs(content=content),
            weight_versions=[WeightVersionSpan("0", 0, last)] if last else None)
        chunk = GenerateTokensStreamResponse(request_id=rid, choices=[choice])
        return f"data: {chunk.model_dump_json(exclude={'prompt_token_ids', 'mm_placeholders', 'metrics'})}\n\n".encode()

    async def ticker():
        while True:
            n = max(state["running"], 1)
            await asyncio.sleep(n / rate if rate else 0)
            fut, state["tick"] = state["tick"], asyncio.get_running_loop().create_future()
            fut.set_result(None)

    async def generate(request: web.Request):
        body = await request.json()
        sp, rid, ids = body["sampling_params"], body["request_id"], body["token_ids"]
        async with state["slots"]:
            state["running"] += 1
            try:
                if not body.get("stream"):  # a scoring request: the prompt's log-probs, whole
                    await state["tick"]
                    plp = [None] + [{t: Logprob(-0.5, 1, None)} for t in ids[1:]]
                    resp = GenerateTokensResponse(request_id=rid, prompt_logprobs=plp, choices=[GenerateTokensChoice(
                        index=0, token_ids=[5], finish_reason="length",
                        logprobs=GenerateLogProbs(content=[GenerateLogProbsContent(token_id=5, logprob=-0.25)]))])
                    return web.Response(body=resp.model_dump_json().encode(), content_type="application/json")
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                every = max(sp.get("stream_interval") or 1, stream_interval)  # the request's, as vLLM clamps it
                n, chunk = length(rid, sp["max_tokens"]), event(rid, every, None)
                for k in range(1, n + 1):  # one token a step; an event every `every` tokens and at the end
                    await state["tick"]
                    if k == n:
                        await out.write(event(rid, n - (n - 1) // every * every, n) + b"data: [DONE]\n\n")
                    elif k % every == 0:
                        await out.write(chunk)
                return out
            except ConnectionResetError:  # the client closed the stream (an abort, or the benchmark's end)
                return out
            finally:
                state["running"] -= 1

    async def set_rate(request):  # the benchmark sets the rate (tokens/s; 0: unpaced)
        nonlocal rate
        rate = (await request.json())["rate"] or None
        return web.json_response({})

    def answer(data: dict):
        async def handler(request):
            return web.json_response(data)
        return handler

    async def main():
        state["tick"] = asyncio.get_running_loop().create_future()
        state["slots"] = asyncio.Semaphore(max_running)
        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        app.router.add_get("/health", answer({}))
        app.router.add_get("/get_world_size", answer({"world_size": 1}))
        app.router.add_post("/update_weight_version", answer({}))
        app.router.add_post("/pace_bench_rate", set_rate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_out.put(site._server.sockets[0].getsockname()[1])
        asyncio.get_running_loop().create_task(ticker())
        await asyncio.Event().wait()

    asyncio.run(main())


def start_servers(n: int, rate: float | None, max_running: int, stream_interval: int = 1,
                  cores: set[int] | None = None) -> tuple[list[str], list]:
    """``n`` stand-in servers (processes), each at ``rate / n`` tokens/s: their URLs and processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs, urls = [], []
    for _ in range(n):
        q = ctx.Queue()
        p = ctx.Process(target=serve, args=(q, rate / n if rate else None, max_running, stream_interval, cores), daemon=True)
        p.start()
        procs.append(p)
        urls.append(f"http://127.0.0.1:{q.get(timeout=120)}")
    return urls, procs
