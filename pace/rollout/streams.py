"""A `RemoteFleet`'s generation streams read in a process of their own (`rollout.stream_reader=process`).

Rank 0's process runs the trainer too. Whatever reads a server's token stream parses one JSON
event per `rollout.stream_interval` tokens with an entry per token, and holds the GIL while it
does: at the paper's ~33k tokens/s that alone slowed a trainer thread beside it by a fifth
(docs/benchmarks.md "The rollout client's cost"). Here a child process holds the streamed
generation requests' HTTP connections, parses every event and hands rank 0 one message per few
milliseconds: each chunk's token ids and sampled log-probs as packed arrays (one C call each to
unpack), its text, finish and stop reasons and, on a request's last chunk, the weight-version
spans and routed experts (still base64: decoded once a request, in rank 0).

What stays in rank 0: which server holds which request, the health checks, failures and healing
(pace/rollout/remote.py, healing.py), and the requests answered whole (validation, scoring). The
child only reads: a stream that breaks or answers a server error is reported (`FAIL`), one
refused (HTTP 4xx) too (`REFUSED`), and rank 0 decides as it does for its own streams. The child
ends when rank 0 asks it to (`stop`) or its pipe closes (rank 0's process gone); at rank 0's exit
without a shutdown it is killed (it ignores SIGTERM in a run: pace/signals.py).

Messages, rank 0 → child: ``("add", key, server, url, body)``, ``("abort", key)``, ``("stop",)``;
child → rank 0, pickled lists of ``(CHUNK, key, server, index, ids, logprobs, text, finish_reason,
stop_reason, weight_versions, routed_experts)``, ``(FAIL, key, server, cause)``,
``(REFUSED, key, server, message)``; ``key`` is (request id, serial).
"""
from __future__ import annotations

import asyncio
import json
import pickle
from array import array

CHUNK, FAIL, REFUSED = 0, 1, 2
FLUSH_S = 0.002  # a batch of chunks goes to rank 0 this often (and on a request's last chunk)


def packed_chunks(data: dict, key, server: int) -> list[tuple]:
    """One generate-route event's choices as `CHUNK` messages: token ids (int32) and sampled-token
    log-probs (float64) packed, the rest as the server sent it."""
    out = []
    for c in data.get("choices", []):
        content = (c.get("logprobs") or {}).get("content")
        lps = None if content is None else array("d", [e["logprob"] for e in content]).tobytes()
        out.append((CHUNK, key, server, c.get("index", 0), array("i", c.get("token_ids") or []).tobytes(), lps,
                    c.get("text") or "", c.get("finish_reason"), c.get("stop_reason"), c.get("weight_versions"),
                    c.get("routed_experts")))
    return out


def unpack(ids: bytes, lps: bytes | None) -> tuple[list[int], list[float] | None]:
    return array("i", ids).tolist(), None if lps is None else array("d", lps).tolist()


def main(commands, results, keepalive_s: float) -> None:
    """The child process: serve ``commands`` until told to stop or the pipe closes."""
    from pace import priority
    from pace.rollout.protocol import allow_open_files

    priority.lower()  # rollout.engine_nice (a CPU run)
    allow_open_files()  # a connection a request in flight
    asyncio.run(_Reader(commands, results, keepalive_s).serve())


class _Reader:
    def __init__(self, commands, results, keepalive_s: float):
        self.commands, self.results, self.keepalive_s = commands, results, keepalive_s
        self.tasks: dict = {}
        self.batch: list = []
        self.done = asyncio.Event()

    async def serve(self) -> None:
        import aiohttp

        from pace.rollout.protocol import fresh_session

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s),
                                             timeout=aiohttp.ClientTimeout(total=None, connect=30))
        self.fresh = fresh_session()
        loop = asyncio.get_running_loop()
        loop.add_reader(self.commands.fileno(), self._on_commands)
        flusher = asyncio.create_task(self._flush_every())
        await self.done.wait()
        loop.remove_reader(self.commands.fileno())
        for t in [*self.tasks.values(), flusher]:
            t.cancel()
        await asyncio.gather(*self.tasks.values(), flusher, return_exceptions=True)
        await self.session.close()
        await self.fresh.close()

    def _on_commands(self) -> None:
        try:
            while self.commands.poll():
                msg = self.commands.recv()
                if msg[0] == "add":
                    _, key, server, url, body = msg
                    self.tasks[key] = asyncio.ensure_future(self._read(key, server, url, body))
                elif msg[0] == "abort":
                    task = self.tasks.pop(msg[1], None)
                    if task is not None:
                        task.cancel()  # the closed stream aborts the request in the engine
                else:
                    self.done.set()
                    return
        except (EOFError, OSError):  # rank 0 is gone
            self.done.set()

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            self._flush()

    def _flush(self) -> None:
        if self.batch:
            batch, self.batch = self.batch, []
            try:
                self.results.send_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
            except (BrokenPipeError, OSError):
                self.done.set()

    async def _read(self, key, server: int, url: str, body: dict) -> None:
        from pace.rollout.protocol import post, sse_payloads

        began = False
        try:
            async with await post(self.session, url, body, self.fresh) as resp:
                began = True
                if resp.status >= 500:
                    raise ConnectionError(f"HTTP {resp.status} on {key[0]}: {(await resp.text())[:300]}")
                if resp.status != 200:
                    self.batch.append((REFUSED, key, server, f"HTTP {resp.status} {(await resp.text())[:300]}"))
                    return
                buf = b""
                async for data in resp.content.iter_any():
                    payloads, buf = sse_payloads(buf + data)
                    for payload in payloads:
                        if payload == b"[DONE]":
                            return
                        event = json.loads(payload)
                        if "error" in event:
                            raise ConnectionError(f"{key[0]}: {str(event['error'])[:300]}")
                        chunks = packed_chunks(event, key, server)
                        self.batch.extend(chunks)
                        if any(c[7] is not None for c in chunks):
                            self._flush()  # a request's end goes at once
                raise ConnectionError(f"the stream of {key[0]} ended before its end")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a stream that broke or could not be read, reported either way
            when = "after its response began" if began else "before any response, sent twice"
            self.batch.append((FAIL, key, server, f"a response stream broke {when} ({type(exc).__name__}: {str(exc)[:200]})"))
            self._flush()
        finally:
            if self.tasks.get(key) is asyncio.current_task():
                del self.tasks[key]


class StreamReader:
    """Rank 0's end: starts the child (spawned: rank 0 holds CUDA and threads), sends it requests
    and aborts, and hands each batch it reads to ``deliver`` on a thread of its own (blocked in the
    pipe, the GIL released); ``deliver(None)`` once if the child is gone, ``deliver(exc)`` if a
    message could not be read (the thread ends either way)."""

    def __init__(self, deliver, keepalive_s: float):
        import atexit
        import multiprocessing as mp
        import threading

        from pace.spawning import without_main

        ctx = mp.get_context("spawn")
        commands, self._commands = ctx.Pipe(duplex=False)
        self._results, results = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=main, args=(commands, results, keepalive_s), name="pace-streams", daemon=True)
        with without_main():  # it runs this module only, not train.py's imports
            self.process.start()
        commands.close()
        results.close()
        self._deliver = deliver
        self._lock = threading.Lock()  # the rollout thread and the fleet's loop both send
        self._closed = False
        self._thread = threading.Thread(target=self._receive, name="pace-streams", daemon=True)
        self._thread.start()
        # killed at exit before multiprocessing's own handler joins it (deaf to its SIGTERM in a run), in case
        # it cannot see its pipe close (blocked on a full one)
        atexit.register(self._kill)

    def _send(self, msg) -> None:
        with self._lock:
            if not self._closed:
                try:
                    self._commands.send(msg)
                except (BrokenPipeError, OSError):  # the child is gone: _receive reports it
                    pass

    def add(self, key, server: int, url: str, body: dict) -> None:
        self._send(("add", key, server, url, body))

    def abort(self, key) -> None:
        self._send(("abort", key))

    def _receive(self) -> None:
        while True:
            try:
                batch = pickle.loads(self._results.recv_bytes())
            except (EOFError, OSError):
                if not self._closed:
                    self.process.join(1.0)  # its exit code, for the message
                    self._deliver(None)
                return
            except Exception as exc:  # noqa: BLE001 - a message it could not read: nothing after it is sure
                self._deliver(exc)
                return
            self._deliver(batch)

    def close(self, timeout: float = 5.0) -> None:
        """Ask the child to stop; kill it if it has not within ``timeout`` s (a sender blocked on a
        full pipe included)."""
        if self._lock.acquire(timeout=1.0):
            try:
                if not self._closed:
                    self._commands.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            finally:
                self._closed = True
                self._lock.release()
        self._closed = True
        self.process.join(timeout)
        self._kill()
        self._thread.join(timeout)
        self._results.close()
        import atexit

        atexit.unregister(self._kill)

    def _kill(self) -> None:
        self._closed = True
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self._commands.close()


class StreamHandle:
    """A request read by the child, as `RemoteFleet` holds it (it cancels what it holds)."""

    __slots__ = ("reader", "key")

    def __init__(self, reader: StreamReader, key):
        self.reader, self.key = reader, key

    def cancel(self) -> None:
        self.reader.abort(self.key)
