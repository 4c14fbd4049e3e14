"""The rollout engines as vLLM HTTP servers (`rollout.engine_process=server`), on any host, behind
the `Fleet` interface (pace/rollout/fleet.py), driven by the rollout thread.

Everything goes through vLLM's own serving routes (pace/rollout/server.py starts them):
- generation: `/inference/v1/generate`, token ids in, token ids out, streamed (a generation
  request's tokens arrive as the engine makes them; its last chunk carries the per-token
  `weight_versions` the engine stamped, which the rollout records as each token's v_t);
  validation (n samples) and PACE's prefix scoring (`prompt_logprobs`) in one response each;
  aborting a request is closing its stream (vLLM aborts a request whose client went away);
- weights: vLLM's `HTTPVLLMWeightSyncClient` (`/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights`, `/finish_weight_update`), each update between
  `/pause?mode=keep` and `/resume` (requests in flight keep their KV and go on under the new
  weights), labelled with `/update_weight_version`; the reload checks through `/collective_rpc`.

The HTTP client runs on an asyncio loop of its own thread; the rollout thread's `step()` takes
what the streams delivered. The generation streams themselves are read in a child process by
default (`rollout.stream_reader=process`, pace/rollout/streams.py: their per-token parsing off
the trainer's GIL); `thread` reads them on that loop. A group's requests go to one server (a shared prompt prefix), as in
the in-host fleet.

A server that stops answering `/health` (three misses, one second apart, while it delivers nothing and is
not in a weight update), whose process exits,
whose stream breaks or returns a server error, or that neither delivers output nor makes progress
for `rollout.engine_timeout_s` while it has requests and is not paused, has failed. Progress is
tokens, not completions: a validation request (n = k samples, returned whole) or a response shorter
than `stream_interval` delivers nothing until it ends, and a busy server may take longer than the
timeout to end any; so once a server has been silent a while, its engine's own token counters
(vLLM's `/metrics`: `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`) are read every
`probe_interval` s, and a server whose counters move is alive. (A server without `/metrics` is
judged by its output alone, as before.) Then it has failed: it is taken out of
the fleet and reported once by `take_failures()` with the requests it held (the rollout thread
decides what to do with them: pace/rollout/failover.py). The weight-transfer group is then formed
again without it (`needs_regroup`), at the next update. Then it is started again, or re-admitted,
and servers join and leave a running job: pace/rollout/healing.py.
A server's states: pace/rollout/server_state.py.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

from pace.errors import EngineFailed
from pace.placement import Placement
from pace.rollout import request_ids
from pace.rollout.fleet import Fleet
from pace.rollout.healing import HealingMixin
from pace.rollout.remote_weights import WEIGHT_CALL_TIMEOUT_S, RemoteWeightsMixin
from pace.rollout.protocol import (GENERATE, Output, allow_open_files, completion, completion_from, flat_logprobs,
                                   params_json, post, prompt_logprobs_from, sse_payloads)
from pace.rollout.server_state import (DEAD, DRAINING, PROBE_EVERY_S, SERVING, WATCHED, EngineFailure, Server, tokens_counted,
                                       world_size)

HEALTH_INTERVAL_S = 1.0
HEALTH_MISSES = 3  # consecutive failed /health checks that fail a server
# an idle connection is dropped this soon: vLLM's server closes its end after 5 s
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a request sent on a connection it just closed breaks as a dead
# server's stream does, and failed a healthy server (aiohttp keeps idle connections for 15 s)
KEEPALIVE_S = 2.0


class RequestRefused(RuntimeError):
    """A server refused a request (HTTP 4xx): a bug in what was sent, not a failed engine."""


class RemoteFleet(HealingMixin, RemoteWeightsMixin, Fleet):
    def __init__(self, urls: list[str], tokenizer, device_type: str = "cpu", processes: list | None = None,
                 engine_timeout_s: float = 120.0, max_restarts: int = 0, restart_backoff_s: float = 2.0,
                 start_timeout_s: float = 900.0, drain_timeout_s: float = 300.0, stream_reader: str = "process",
                 transfer_address: str | None = None, update_timeout_s: float = WEIGHT_CALL_TIMEOUT_S):
        allow_open_files()  # a connection a request in flight: thousands on a GPU node
        self.servers = [Server(i, u.rstrip("/"), (processes or [None] * len(urls))[i]) for i, u in enumerate(urls)]
        self.tokenizer = tokenizer
        # where the weight-transfer group (nccl, gloo) meets trainer rank 0 (None: no group, shm): on the
        # loopback, a server on another host cannot join (pace/rollout/healing.py `join`)
        self.transfer_address = transfer_address
        self.device_type = device_type
        self.engine_timeout_s = engine_timeout_s
        self.update_timeout_s = update_timeout_s  # each transfer call's (pace/rollout/remote_weights.py)
        from vllm.sampling_params import RequestOutputKind

        self._delta = RequestOutputKind.DELTA
        self.version = None
        self._lost = False  # a rank of the group failed or left: the group is formed again
        self._init_info: dict | None = None  # the last group's (a group-less backend's joiners get it too)
        self._updating = False  # between begin_update and the resume: no weight-transfer engine is released
        self._fingerprinting = False  # the workers fingerprint their updates (a joiner is switched on too)
        self.max_restarts, self.restart_backoff_s = max_restarts, restart_backoff_s
        self.start_timeout_s, self.drain_timeout_s = start_timeout_s, drain_timeout_s
        self.restarts = 0  # started again or re-admitted, run-wide (rollout.max_engine_restarts)
        self.control = None  # rank 0's control endpoint (pace/rollout/control.py), set by `build`
        self._owner: dict[str, tuple[int, int]] = {}  # request id → (server, serial)
        self._futures: dict[str, object] = {}
        self._group_engine: dict[str, int] = {}
        self._load = [0] * len(urls)
        self._serial = 0
        self._out: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._failures: list[EngineFailure] = []
        self._refused: list[BaseException] = []
        self._closing = False
        for s in self.servers:
            s.workers = world_size(s.url)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pace-http", daemon=True)
        self._thread.start()
        self._session = self._run(self._open())
        self._watchers = [asyncio.run_coroutine_threadsafe(self._watch(s), self._loop) for s in self.servers]
        self._streams = None  # the child reading the generation streams (rollout.stream_reader=process)
        self._streams_lost = None
        if stream_reader == "process":
            from pace.rollout.streams import StreamReader

            self._streams = StreamReader(self._on_streamed, KEEPALIVE_S)

    # --- the event loop -----------------------------------------------------------------------
    def _run(self, coro, timeout: float | None = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open(self):
        import aiohttp

        from pace.rollout.protocol import fresh_session

        self._fresh = fresh_session()  # `post`'s second try
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                     timeout=aiohttp.ClientTimeout(total=None, connect=30))

    async def _close(self) -> None:
        """Every stream still open (one whose last chunk was read may not have ended), then the session."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._session.close()
        await self._fresh.close()

    @property
    def alive(self) -> list[int]:
        return [s.index for s in self.servers if s.alive]

    @property
    def needs_regroup(self) -> bool:
        """A rank of the weight-transfer group failed or left (joiners wait for `regroup_due`)."""
        return self._lost

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: dict, params, priority: int = 0, group: str | None = None,
                    engine: int | None = None) -> None:
        alive = self.alive
        if not alive:
            with self._lock:  # failed since the rollout thread last took failures: say why, not only that
                why = "; ".join(f"engine {f.index}: {f.cause}" for f in self._failures)
            raise EngineFailed("no rollout engine is left" + (f" ({why})" if why else ""))
        if engine is not None and engine not in alive:
            raise EngineFailed(f"rollout engine {engine} ({self.servers[engine].url}) is not in service")
        i = engine if engine is not None else self._group_engine.get(group) if group is not None else None
        if i is None or not self.servers[i].alive:
            i = min(alive, key=self._load.__getitem__)
            if group is not None:
                self._group_engine[group] = i
        ids = prompt.get("prompt_token_ids")
        if ids is None:  # a text prompt, tokenized as vLLM's engine does it (the generate route takes ids only)
            from pace.tasks.base import engine_token_ids

            ids = engine_token_ids(self.tokenizer, prompt["prompt"])
        stream = params.output_kind == self._delta and params.n == 1  # generation: streamed token by token
        self._serial += 1
        body = {"request_id": request_ids.wire(request_id, self._serial), "token_ids": list(ids),
                "sampling_params": params_json(params), "priority": priority, "stream": stream, "output_mode": "text" if params.detokenize else "tokens"}
        if prompt.get("cache_salt") is not None:
            body["cache_salt"] = prompt["cache_salt"]
        server = self.servers[i]
        if self._load[i] == 0:
            server.last_output = time.monotonic()  # an idle server's silence is not a stall
        self._owner[request_id] = (i, self._serial)
        self._load[i] += 1
        if stream and self._streams is not None:
            from pace.rollout.streams import StreamHandle

            key = (request_id, self._serial)
            self._streams.add(key, i, server.url + GENERATE, body)
            self._futures[request_id] = StreamHandle(self._streams, key)
            return
        self._futures[request_id] = asyncio.run_coroutine_threadsafe(
            self._request(server, request_id, self._serial, body, stream), self._loop)

    async def _request(self, server: Server, rid: str, serial: int, body: dict, stream: bool) -> None:
        import aiohttp

        began = False
        try:
            async with await post(self._session, server.url + GENERATE, body, self._fresh) as resp:
                began = True
                if resp.status >= 500:
                    raise ConnectionError(f"HTTP {resp.status} on {rid}: {(await resp.text())[:300]}")
                if resp.status != 200:
                    raise RequestRefused(f"rollout engine {server.index} ({server.url}) refused request {rid}: "
                                         f"HTTP {resp.status} {(await resp.text())[:300]}")
                if not stream:
                    data = await resp.json()
                    server.last_output = time.monotonic()
                    self._out.put((server.index, serial, Output(rid, [completion_from(c) for c in data["choices"]], True,
                                                               prompt_logprobs_from(data.get("prompt_logprobs")))))
                    return
                buf = b""
                async for chunk in resp.content.iter_any():
                    payloads, buf = sse_payloads(buf + chunk)
                    for payload in payloads:
                        if payload == b"[DONE]":
                            return
                        data = json.loads(payload)
                        if "error" in data:
                            raise ConnectionError(f"{rid}: {str(data['error'])[:300]}")
                        server.last_output = time.monotonic()
                        for c in data.get("choices", []):
                            comp = completion_from(c)
                            self._out.put((server.index, serial, Output(rid, [comp], comp.finish_reason is not None)))
                raise ConnectionError(f"the stream of {rid} ended before its end")
        except asyncio.CancelledError:  # aborted here: the closed stream aborts it in the engine
            raise
        except RequestRefused as exc:
            self._refused.append(exc)
            self._out.put(None)
        except (aiohttp.ClientError, ConnectionError, OSError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
            when = "after its response began" if began else "before any response, sent twice"
            self._fail(server, f"a response stream broke {when} ({type(exc).__name__}: {str(exc)[:200]})")

    def _on_streamed(self, batch: list | None) -> None:
        """What the stream reader's child read (its receiving thread): chunks become outputs for
        `step`, a broken stream fails its server as one read here does, a refusal is raised."""
        if batch is None or isinstance(batch, BaseException):  # the child is gone, or what it sent is unreadable
            if not self._closing:
                self._streams_lost = EngineFailed(
                    "the process reading the rollout servers' streams exited "
                    f"(code {self._streams.process.exitcode})" if batch is None else
                    f"a message of the process reading the rollout servers' streams could not be read: {batch!r}")
                self._out.put(None)
            return
        try:
            self._take_streamed(batch)
        except Exception as exc:  # noqa: BLE001 - raised by the rollout thread's next step, not lost with this thread
            self._streams_lost = EngineFailed(f"a streamed chunk could not be read: {exc!r}")
            self._out.put(None)
            raise

    def _take_streamed(self, batch: list) -> None:
        from pace.rollout.streams import CHUNK, FAIL, unpack

        now, outputs = time.monotonic(), []
        for kind, (rid, serial), i, *rest in batch:
            server = self.servers[i]
            if kind == CHUNK:
                index, ids, lps, text, finish, stop, spans, routes = rest
                ids, lps = unpack(ids, lps)
                comp = completion(index, ids, None if lps is None else flat_logprobs(ids, lps), text, finish, stop,
                                  spans, routes)
                server.last_output = now
                outputs.append((i, serial, Output(rid, [comp], finish is not None)))
            elif self._owner.get(rid) != (i, serial):
                continue  # a stream aborted here or lost with its server: nothing to report
            elif kind == FAIL:
                if outputs:  # what the stream delivered before it broke comes first
                    self._out.put(outputs)
                    outputs = []
                self._fail(server, rest[0])
            else:
                self._refused.append(RequestRefused(f"rollout engine {i} ({server.url}) refused request {rid}: {rest[0]}"))
                self._out.put(None)
        if outputs:
            self._out.put(outputs)

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            owner = self._owner.pop(rid, None)
            if owner is not None:
                self._load[owner[0]] -= 1
            future = self._futures.pop(rid, None)
            if future is not None:
                future.cancel()

    def holds(self, request_id: str) -> bool:
        return request_id in self._owner

    def release_group(self, group: str) -> None:
        self._group_engine.pop(group, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self, timeout: float = 0.01) -> list:
        """What the servers delivered since the last call (waiting up to ``timeout`` for the first)."""
        if self._refused:
            raise self._refused[0]
        if self._streams_lost is not None:
            raise self._streams_lost
        items = []
        try:
            items.append(self._out.get(timeout=timeout))
            while True:
                items.append(self._out.get_nowait())
        except queue.Empty:
            pass
        outputs = []
        for item in [x for it in items for x in (it if isinstance(it, list) else [it])]:  # the reader's: lists
            if item is None:  # a wake-up (a failure or a refusal)
                continue
            i, serial, out = item
            if self._owner.get(out.request_id) != (i, serial):
                continue  # aborted, or lost with its server
            if out.finished:
                del self._owner[out.request_id]
                self._futures.pop(out.request_id, None)
                self._load[i] -= 1
            out.engine = i
            outputs.append(out)
        if self._refused:
            raise self._refused[0]
        return outputs

    def partial_versions(self, request_id: str, n: int):
        """None: a server labels a request's tokens in its last chunk only (an unfinished one's
        tokens have the rollout's stamps, cut at a stop: pace/rollout/resuming.py)."""
        return None

    # --- failures -------------------------------------------------------------------------------
    async def _watch(self, server: Server) -> None:
        import aiohttp

        misses = 0
        while server.state in WATCHED and not self._closing:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            if server.state not in WATCHED:
                return  # failed or left meanwhile (a revival watches it anew)
            if server.process is not None and server.process.exit_code() is not None:
                self._fail(server, f"its process exited with code {server.process.exit_code()}")
                return
            asked = time.monotonic()
            try:
                async with self._session.get(server.url + "/health", timeout=aiohttp.ClientTimeout(total=2 * HEALTH_INTERVAL_S)) as r:
                    ok = r.status == 200
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                ok = False
            # A server too busy to answer in time is not dead: one that delivered output meanwhile, or that is
            # in a weight update (whose calls have deadlines of their own: pace/rollout/remote_weights.py), is
            # not counted a miss; on a busy host its API server's loop answered /health late, every server at once
            busy = server.last_output >= asked - HEALTH_INTERVAL_S or server.paused
            misses = 0 if ok or busy else misses + 1
            if misses >= HEALTH_MISSES:
                self._fail(server, f"/health failed {misses} times in a row")
                return
            if self._load[server.index] > 0 and not server.paused and server.state in (SERVING, DRAINING):
                await self._probe_progress(server)
                silent = time.monotonic() - max(server.last_output, server.last_progress)
                if silent > self.engine_timeout_s:
                    how = ("its token counters (/metrics) unchanged" if server.tokens is not None
                           else "no /metrics to read its progress from")
                    self._fail(server, f"no output and no progress for {silent:.0f} s with {self._load[server.index]} "
                                       f"requests in flight ({how}; rollout.engine_timeout_s={self.engine_timeout_s:g})")
                    return

    @property
    def probe_interval(self) -> float:
        """How often a silent server's token counters are read: four reads within the timeout."""
        return min(PROBE_EVERY_S, self.engine_timeout_s / 4)

    async def _probe_progress(self, server: Server) -> None:
        """A server that has delivered nothing for a `probe_interval`: its token counters read (once an
        interval); if they moved since the last read, it made progress now. A silence's first read is its
        baseline: counters that moved before it say nothing about now."""
        import aiohttp

        now = time.monotonic()
        if now - server.last_output < self.probe_interval:  # it delivered lately: nothing to read
            server.tokens = None  # its next silence starts from a baseline read in it
            return
        if now - server.probed < self.probe_interval:
            return
        server.probed = now
        try:
            async with self._session.get(server.url + "/metrics", timeout=aiohttp.ClientTimeout(total=2 * HEALTH_INTERVAL_S)) as r:
                tokens = tokens_counted(await r.text()) if r.status == 200 else None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            tokens = None
        if tokens is not None and server.tokens is not None and tokens > server.tokens:
            server.last_progress = now
        server.tokens = tokens

    def _fail(self, server: Server, cause: str) -> None:
        """Take ``server`` out of the fleet (any thread); reported by `take_failures`, then started
        again or re-admitted (pace/rollout/healing.py) unless it was leaving or the budget is spent."""
        with self._lock:
            if server.state not in WATCHED or self._closing:
                return
            if server.in_group:
                self._lost = True
            serving = server.state in (SERVING, DRAINING)
            server.state, server.since = DEAD, time.monotonic()
            self._failures.append(EngineFailure(server.index, server.url, cause, serving=serving))
        if server.leaving or not self.max_restarts:
            if server.process is not None:  # one this run started: it does not come back half-alive
                threading.Thread(target=server.process.kill, daemon=True).start()
        else:
            asyncio.run_coroutine_threadsafe(self._revive(server, cause), self._loop)
        self._out.put(None)

    def wait_failed(self, alive_before: set[int], timeout: float = 5.0) -> list[Server]:
        """The servers of ``alive_before`` to blame for a failed weight transfer, found within ``timeout`` s
        (the health checks' time); [] when none. Once the trainer gives the transfer up and closes its
        group, a live server whose receive fails answers its weight call with an error: the ones to blame
        are those that did not answer — the call still unanswered or timed out, or the server unreachable
        —, else the first to fail. Several when the transfer left them all waiting (gloo's and NCCL's
        receives wait for their own deadline): which of them stopped cannot be told from here."""
        deadline = time.monotonic() + timeout
        while True:
            ours = [s for s in self.servers if s.index in alive_before]
            failed = sorted((s for s in ours if not s.in_group), key=lambda s: s.since)
            unanswered = [s for s in ours if s.in_group and s.calling]
            if (failed and not unanswered) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        silent = unanswered + [s for s in failed if not s.answered]
        return silent or failed[:1]

    def take_failures(self) -> list[EngineFailure]:
        """Servers failed since the last call, each with the request ids it held (rollout thread)."""
        with self._lock:
            failures, self._failures = self._failures, []
        for f in failures:
            f.request_ids = [rid for rid, (i, _) in self._owner.items() if i == f.index]
            for rid in f.request_ids:
                del self._owner[rid]
                future = self._futures.pop(rid, None)
                if future is not None:
                    future.cancel()
            self._load[f.index] = 0
            for g in [g for g, i in self._group_engine.items() if i == f.index]:
                del self._group_engine[g]
        return failures

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the client; stop the servers this run started (others keep running, resumed)."""
        self._closing = True
        if self.control is not None:  # before the loop's tasks are cancelled: it runs on the loop
            self.control.stop()
        for f in [*self._watchers, *self._futures.values()]:
            f.cancel()
        self._futures.clear()
        self._owner.clear()
        for s in self.servers:
            if s.process is None and s.in_group and s.paused:
                try:
                    self._post(s, "/resume", timeout=5)
                except Exception:  # noqa: BLE001 - best effort: the server is not ours
                    pass
        if self._streams is not None:
            self._streams.close()
        try:
            self._run(self._close(), timeout=5)
        except Exception:  # noqa: BLE001
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        for s in self.servers:
            if s.process is not None:
                s.process.kill(2.0 if timeout is None else timeout)


def build(model_path: str, cfg, placement: Placement, tokenizer, log_dir: str | None, version: int) -> RemoteFleet:
    """The fleet of `rollout.servers`, or of `rollout.engines` servers started on 127.0.0.1 now
    where ``placement`` puts them."""
    from pathlib import Path

    from pace.net import transfer_address
    from pace.rollout import server

    urls, processes = list(cfg.rollout.servers), None
    if not urls:
        processes = server.launch_local(model_path, cfg, placement, Path(log_dir or ".") / "engines")
        urls = [p.url for p in processes]
    try:
        r = cfg.rollout
        restarts = r.max_engine_restarts if r.on_engine_failure == "continue" else 0  # stop: the run ends
        group = placement.transfer in ("nccl", "gloo")  # a rendezvous at rank 0's address (shm: a file here)
        fleet = RemoteFleet(urls, tokenizer, placement.device, processes, r.engine_timeout_s, restarts,
                            r.restart_backoff_s, r.server_start_timeout_s, r.drain_timeout_s, r.stream_reader,
                            transfer_address=transfer_address(r) if group else None, update_timeout_s=r.update_timeout_s)
    except BaseException:
        for p in processes or []:
            p.kill()
        raise
    fleet.set_version(version)
    from pace.rollout import control

    try:
        fleet.control = control.serve(fleet, cfg, log_dir)  # None when rollout.control_port is null
    except BaseException:
        fleet.shutdown()
        raise
    return fleet
