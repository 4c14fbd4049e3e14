"""A `RemoteFleet`'s generation streams read in a child process (pace/rollout/streams.py) against a
stand-in server streaming vLLM's generate events: the rollout gets the same outputs as from a
stream read on rank 0's loop; a broken stream fails its server, a refusal is raised, an abort closes
the stream, and a reader that dies stops the run."""
from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pace.errors import EngineFailed
from pace.rollout.remote import RemoteFleet, RequestRefused

CHUNKS = [[5, 9, 200], [31, 7, 1000], [64]]  # one request's token ids, as three chunks
SPANS = [{"version": "3", "start": 0, "end": 4}, {"version": "4", "start": 4, "end": 7}]


def _event(ids: list[int], first: int, last: bool) -> bytes:
    """A chunk as vLLM's generate route streams it: one log-prob entry a token, rank and top-1 as
    vLLM writes them; the last carries the finish reason and the weight versions."""
    content = [{"token": f"token_id:{t}", "logprob": -0.01 * (first + k) - 1e-9 * t, "bytes": None, "rank": 1,
                "top_logprobs": [{"token": f"token_id:{t}", "logprob": -0.01 * (first + k), "bytes": None}]}
               for k, t in enumerate(ids)]
    choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "text": "",
              "finish_reason": "length" if last else None, "stop_reason": None}
    if last:
        choice["weight_versions"] = SPANS
    return b"data: " + json.dumps({"request_id": "x", "choices": [choice]}).encode() + b"\n\n"


class StreamingStandIn:
    """/inference/v1/generate streams CHUNKS (``mode`` "ok"), one chunk then a cut ("break"), a 400
    ("refuse"), or a chunk every 20 ms until the client goes ("endless": ``gone`` is set then)."""

    def __init__(self):
        self.mode = "ok"
        self.gone = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the stream ends with the connection

            def _json(self, body: dict, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - http.server's name
                self._json({"world_size": 1} if self.path.startswith("/get_world_size") else {})

            def do_POST(self):  # noqa: N802
                json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if stand_in.mode == "refuse":
                    return self._json({"error": "bad sampling params"}, 400)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    if stand_in.mode == "endless":
                        k = 0
                        while True:
                            self.wfile.write(_event([k % 100], k, False))
                            self.wfile.flush()
                            k += 1
                            time.sleep(0.02)
                    first = 0
                    for n, ids in enumerate(CHUNKS):
                        self.wfile.write(_event(ids, first, n == len(CHUNKS) - 1))
                        self.wfile.flush()
                        first += len(ids)
                        if stand_in.mode == "break":
                            return  # the connection closes without the request's end
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    stand_in.gone.set()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand_in():
    s = StreamingStandIn()
    yield s
    s.close()


def _params():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=7, logprobs=0, output_kind=RequestOutputKind.DELTA, detokenize=False)


def _until(fleet, done, timeout=20.0) -> list:
    outs, deadline = [], time.monotonic() + timeout
    while not done(outs):
        assert time.monotonic() < deadline, f"nothing more came: {outs}"
        outs += fleet.step(timeout=0.05)
    return outs


def _read(stand_in, reader: str):
    fleet = RemoteFleet([stand_in.url], tokenizer=None, stream_reader=reader)
    try:
        if reader == "process":  # the streams are read by a child, not this process
            assert fleet._streams.process.is_alive() and fleet._streams.process.pid != os.getpid()
        else:
            assert fleet._streams is None
        fleet.add_request("g0-0", {"prompt_token_ids": [1, 2, 3]}, _params())
        outs = _until(fleet, lambda outs: outs and outs[-1].finished)
        assert not fleet.has_unfinished_requests()
        return [(o.request_id, o.finished, o.engine, [(c.index, c.token_ids, c.logprobs.logprobs, c.finish_reason,
                 None if c.weight_versions is None else [vars(s) for s in c.weight_versions]) for c in o.outputs])
                for o in outs]
    finally:
        fleet.shutdown()


def test_the_child_process_delivers_what_a_stream_read_here_does(stand_in):
    here, child = _read(stand_in, "thread"), _read(stand_in, "process")
    assert child == here
    assert [c[1] for o in child for c in o[3]] == CHUNKS and child[-1][3][0][4] == SPANS
    sent = json.loads(_event(CHUNKS[0], 0, False)[len(b"data: "):])["choices"][0]["logprobs"]["content"]
    assert child[0][3][0][2] == [e["logprob"] for e in sent]  # ℓ^μ as the rollout reads it, exactly as sent


def test_a_broken_stream_fails_its_server_and_a_refusal_is_raised(stand_in):
    fleet = RemoteFleet([stand_in.url], tokenizer=None, stream_reader="process")
    try:
        stand_in.mode = "break"
        fleet.add_request("g0-0", {"prompt_token_ids": [1, 2, 3]}, _params())
        deadline = time.monotonic() + 20
        while not (failures := fleet.take_failures()):
            assert time.monotonic() < deadline, "the broken stream failed no server"
            fleet.step(timeout=0.05)
        assert [(f.index, f.request_ids) for f in failures] == [(0, ["g0-0"])]
        assert "stream broke" in failures[0].cause and fleet.alive == []
    finally:
        fleet.shutdown()
    fleet = RemoteFleet([stand_in.url], tokenizer=None, stream_reader="process")
    try:
        stand_in.mode = "refuse"
        fleet.add_request("g1-0", {"prompt_token_ids": [1, 2, 3]}, _params())
        with pytest.raises(RequestRefused, match="HTTP 400"):
            _until(fleet, lambda outs: False)
    finally:
        fleet.shutdown()


def test_an_abort_closes_the_stream_and_a_dead_reader_stops_the_run(stand_in):
    fleet = RemoteFleet([stand_in.url], tokenizer=None, stream_reader="process")
    try:
        stand_in.mode = "endless"
        fleet.add_request("g0-0", {"prompt_token_ids": [1, 2, 3]}, _params())
        _until(fleet, lambda outs: len(outs) >= 2)
        assert not stand_in.gone.is_set()
        fleet.abort_request(["g0-0"])
        assert stand_in.gone.wait(10), "the aborted request's stream stayed open"
        assert not fleet.has_unfinished_requests() and fleet.alive == [0]
        fleet._streams.process.kill()
        with pytest.raises(EngineFailed, match="reading the rollout servers' streams exited"):
            _until(fleet, lambda outs: False)
    finally:
        fleet.shutdown()

