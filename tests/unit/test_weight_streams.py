"""CUDA streams on the weight path (pace/weights/streams.py), shown on CPU with torch.cuda's stream
calls replaced by fakes that log what runs on which stream: trainer rank 0's gathers are finished
on the default stream before vLLM's packed NCCL sender, iterating on a side stream, gets them
(huggingface/trl#6797: with more than 2 trainer ranks a gather queued there hangs the sync); on CPU
the path makes no CUDA call. What a GPU would add (the real streams, NCCL) has not run."""
from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.unit


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def synchronize(self):
        self.log.append(("sync", self.name))


class _FakeCuda:
    """torch.cuda's stream calls as the code under test uses them: one device, a default stream, a
    current stream set by `torch.cuda.stream(s)`; every call that would wait is logged."""

    def __init__(self, monkeypatch, log: list):
        self.default = _Stream("default", log)
        self.side = _Stream("side", log)
        self.current = self.default

        @contextlib.contextmanager
        def stream(s):
            before, self.current = self.current, s
            try:
                yield
            finally:
                self.current = before

        monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: self.default)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("sync", "device")))


class _Gathered:
    """What `full_tensor()` returns: logs the stream it is handed to (`record_stream`)."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def record_stream(self, stream):
        self.log.append(("record", self.name, stream.name))


class _Shard:
    """An FSDP2 parameter on a GPU as `engine_tensor` sees it: a DTensor-like shard whose cast is
    itself and whose all-gather logs the stream that was current when it ran."""

    device = torch.device("cuda", 0)

    def __init__(self, name: str, log: list, cuda: _FakeCuda):
        self.name, self.log, self.cuda = name, log, cuda

    def detach(self):
        return self

    def to(self, dtype):
        return self

    def full_tensor(self):
        self.log.append(("gather", self.name, self.cuda.current.name))
        return _Gathered(self.name, self.log)


class _Model:
    def __init__(self, params):
        self.params = params

    def named_parameters(self, remove_duplicate=True):
        return iter(self.params)


def _drain(it, log, cuda=None, stream=None):
    """Iterate as vLLM's `packed_nccl_broadcast_producer` does: each `next` inside
    `torch.cuda.stream(side)` (``stream``), or on the current stream (``None``: ranks ≥ 1)."""
    while True:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                name, _ = next(it)
            except StopIteration:
                return
        log.append(("yield", name))


def test_each_gather_is_finished_on_the_default_stream_before_the_side_stream_sender_gets_it(monkeypatch):
    """Per tensor, in order: gathered on the default stream, that stream waited for, the tensor
    handed to the sender's side stream (the allocator keeps its memory until the side stream is
    done with it), yielded. Before the fix: gathered on the side stream, no wait."""
    from pace.weights.transfer import CastSource

    log: list = []
    cuda = _FakeCuda(monkeypatch, log)
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    source = CastSource(_Model([(n, _Shard(n, log, cuda)) for n in names]), torch.bfloat16)
    _drain(iter(source), log, cuda, stream=cuda.side)
    assert log == [event for n in names
                   for event in (("gather", n, "default"), ("sync", "default"), ("record", n, "side"), ("yield", n))]
    assert cuda.current is cuda.default  # the sender's context is left as it was

    log.clear()  # ranks ≥ 1 (and the unpacked path) iterate on the default stream: nothing to hand over
    _drain(iter(source), log)
    assert log == [event for n in names for event in (("gather", n, "default"), ("sync", "default"), ("yield", n))]


def test_on_cpu_the_weight_path_makes_no_cuda_call(monkeypatch):
    """The trainer's pass on CPU (with fingerprints, as rank 0's) and the engine's position weights:
    any CUDA stream or sync call would raise here."""
    from pace.weights import fingerprint as fp
    from pace.weights.transfer import CastSource

    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA call on the CPU path")

    for name in ("default_stream", "current_stream", "stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(fp, "_weights", {})
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    got = []
    pairs = list(CastSource(model, torch.bfloat16, on_sent=got.append))
    assert [n for n, _ in pairs] == ["0.weight", "0.bias", "1.weight", "1.bias"] and len(got) == 1
    assert torch.equal(pairs[0][1], model[0].weight.detach().to(torch.bfloat16))


def test_a_tensor_made_on_the_default_stream_is_waited_for_and_handed_to_the_caller(monkeypatch):
    """`on_default_stream` itself: made with the default stream current, waited for, recorded on the
    caller's stream; from the default stream, nothing to record; the caller's stream restored."""
    from pace.weights import streams

    log: list = []
    cuda = _FakeCuda(monkeypatch, log)

    def make():
        log.append(("make", cuda.current.name))
        return _Gathered("t", log)

    with torch.cuda.stream(cuda.side):
        streams.on_default_stream("cuda:0", make)
        assert cuda.current is cuda.side
    streams.on_default_stream(torch.device("cuda", 0), make)
    assert log == [("make", "default"), ("sync", "default"), ("record", "t", "side"),
                   ("make", "default"), ("sync", "default")]
