"""After every weight sync, the tensors each engine worker's model loader received must be the
ones the trainer sent for the version the engine is labelled with, and that loader must be the
served model's: fingerprints of θ_v taken on both sides, in checkpoint coordinates, compared exactly.

Why not the on-policy guard (pace/weights/mismatch.py) alone: in bf16 its bound is 0.2 nats a token (the
two sides' rounding gives ~5e-3), while an engine one version behind at lr 1e-6 differs by ~1e-3.
A sync that changes nothing — a version label moved without weights, weights loaded into a model
that does not serve, an update applied one version late — never trips it on a GPU. Why not a fixed
probe whose engine log-probs must move with every version: an engine one version late moves too
(θ_{v−1} ≠ θ_{v−2}), and a probe checked against the trainer needs a bf16 floor that hides the
~1e-3 it looks for. A fingerprint needs neither: it compares bytes, so it is exact in any dtype
and catches an engine whose loader received another version's tensors (any number of versions
behind) or none since it started, or whose loader is not the served model's.

What is compared. The trainer's side: each tensor as it is sent (`CastSource`: the parameter cast to
the engine dtype, gathered whole; named as the checkpoint names it), on trainer rank 0's device;
only the pass that sends (a checkpoint's copy of θ is not fingerprinted).
The engines' side: each tensor the serving model's `load_weights` receives during the update, on
the engine worker's device, in every worker (each receives whole tensors and shards them itself; a
worker that patches in place, nccl's delta, advances those of θ_base by the patches it received:
pace/weights/inplace.py);
pace/weights/reload.py takes them in the same wrapper whose names its audit reads, which every
backend's receive path goes through (shm, gloo, nccl, ipc, in-process or not, HTTP servers). The
worker also says whether that model is the one its runner serves. What is checked is therefore
receipt: an engine given the right tensors that then does not apply them is not seen here.
Fingerprints of what the engine *holds* after loading would need each model's loader inverted
(fused qkv/gate_up projections, tensor-parallel shards, stacked MoE experts, CPU kernel repacking);
what loading does after receipt is checked by the reload's audit (every layer got all its
elements) and, in float32, by the on-policy guard. Only one integer a tensor crosses processes
(`collective_rpc`, JSON for servers).

The fingerprint of a tensor: its bytes read as int16 (uint8 for one-byte dtypes), each times a
weight w_i = (i·A mod P) + 1 that depends on its position i (P = 32749, prime), summed exactly in
integers: independent of device, reduction order and rounding (|int16 · w_i| < 2^30, so the int64
sum is exact for tensors under 2^33 int16 elements, 16 GiB). A change of any one element changes it
(by δ·w_i ≠ 0). The weights repeat every P positions: the fingerprint is Σ_r w_r·S_r over the P sums
S_r of the elements at positions ≡ r (mod P), so a change that keeps every S_r — two elements
exchanged, or a block moved, between positions a multiple of P apart — is never seen. Any other
change (other values, a transpose, a shift by other than a multiple of P) is missed only if its
terms cancel exactly, Σ δ_i·w_i = 0. The weights guard against what a sync gets wrong (another
version's tensors, none, a transposed or shifted layout), not against a deliberate exchange.
Cost: three elementwise passes over what is sent, on the device that holds it (~22 bytes of memory
traffic an element); the sums stay there, queued, until the pass ends and are read at once (one
device sync a side per sync, not one a tensor: a receive on a side stream keeps its overlap): ~0.1 s
a side per sync for an 8B model at an H100's bandwidth (an estimate: not yet run on a GPU); on CPU
0.09 G elements/s on one thread (the tiny model: 1.5 ms a side per sync).

A judged update with other weights, or none, stops the run after a checkpoint with one line
(`StaleEngine`, a `SyncMismatch`). `trainer.sync_fingerprint` (default true) turns it off.
"""
from __future__ import annotations

import threading

import torch

from pace.weights.mismatch import SyncMismatch
from pace.weights.streams import on_default_stream

P = 32749  # prime below 2^15: |int16 · w| < 2^30 (int32), a chunk's sum < 2^52, a tensor's < 2^63
A = 40503
CHUNK = P * 128  # a multiple of P: every chunk has the same weights (~4.2M elements, ~17 MB of int32)
KEEP = 4  # versions of sent fingerprints kept (an engine found one is named by how far behind it is)
SLICE = 1 << 20  # elements `terms_at` weighs at once (its int64 temporaries: ~24 MB in bf16)

_weights: dict[torch.device, torch.Tensor] = {}  # w_i for one chunk, by device: made once, kept for the process


def prepare(device: torch.device | str) -> None:
    """Make ``device``'s position weights now (once a process): where the device is known before a
    sync, so that they are not first made inside a transfer. Both sides call it up front (the
    trainer's `CastSource` when it is built, the engine's checked reload when an update starts)."""
    _position_weights(_key(torch.device(device)))


def _key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:  # the key a tensor's own device has
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _position_weights(device: torch.device) -> torch.Tensor:
    """The cached w_i on ``device``, made on its default CUDA stream and finished before they are
    used (pace/weights/streams.py). A fingerprint is taken where vLLM's packed NCCL transfer runs
    our code inside its side-stream context (trainer rank 0's `CastSource`, the engine's loader);
    weights first made there would be written by kernels queued on one side stream and read by
    fingerprints queued on another (the next buffer's, or the default stream's at a later sync) with
    nothing ordering the two: a fingerprint could read them unwritten and judge a good engine stale."""
    w = _weights.get(device)
    if w is None:
        w = _weights[device] = on_default_stream(
            device, lambda: (torch.arange(CHUNK, dtype=torch.int64, device=device) * A % P + 1).to(torch.int32))
    return w


def device_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Σ_i bits_i · w_i over ``t``'s bytes as int16, a 0-d int64 tensor on ``t``'s device: queued,
    not read (no device sync)."""
    raw = _words(t)
    if raw.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=raw.device)
    w, sums = _position_weights(raw.device), []
    for start in range(0, raw.numel(), CHUNK):
        part = raw[start : start + CHUNK].to(torch.int32)
        sums.append(part.mul_(w[: part.numel()]).sum(dtype=torch.int64))
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as the fingerprint reads them: int16 words (uint8 for one-byte dtypes), flat."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.uint8)


def terms_at(positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The fingerprint's terms (bits · w_i) of a tensor's elements at flat ``positions`` holding
    ``values`` (1-D, one per position), summed: a 0-d int64 tensor on their device, not read. Over
    every position it is the tensor's fingerprint; a patch moves it by the new values' terms less the
    old ones' (`change_at`). `SLICE` elements at a time: its temporaries stay small whatever the patch."""
    per = max(1, values.element_size() // 2)  # words per element
    total = torch.zeros((), dtype=torch.int64, device=values.device)
    for start in range(0, positions.numel(), SLICE):
        pos = positions[start : start + SLICE].to(device=values.device, dtype=torch.int64)
        words = (pos.unsqueeze(1) * per + torch.arange(per, device=values.device)).reshape(-1)
        total += (_words(values[start : start + SLICE]).to(torch.int64) * (words * A % P + 1)).sum(dtype=torch.int64)
    return total


def change_at(positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """How a tensor's fingerprint changes (a 0-d int64 tensor on their device, not read) when its
    elements at flat ``positions`` go from ``old`` to ``new`` (pace/weights/delta.py: θ_v's
    fingerprints from a delta, without a pass over the whole tensor)."""
    return terms_at(positions, new) - terms_at(positions, old)


def tensor_fingerprint(t: torch.Tensor) -> int:
    """``t``'s fingerprint as an integer (exact: the same on any device; one device sync)."""
    return int(device_fingerprint(t))


def read(values: dict[str, torch.Tensor]) -> dict[str, int]:
    """0-d tensors by name as integers: one device sync for them all (every stream of each CUDA
    device first, so that sums queued on a side stream, as the engines' receive uses, are done)."""
    by_device: dict[torch.device, list[str]] = {}
    for name, value in values.items():
        by_device.setdefault(value.device, []).append(name)
    out: dict[str, int] = {}
    for device, names in by_device.items():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.update(zip(names, torch.stack([values[n] for n in names]).tolist()))
    return {name: out[name] for name in values}


class Fingerprints:
    """Fingerprints of one update's tensors by name, as they pass (either side): kept on the
    tensors' device while the update runs, read at once at its end (`prints`)."""

    def __init__(self, device: torch.device | str | None = None):
        self._sums: dict[str, torch.Tensor] = {}
        if device is not None:  # the position weights up front, not inside the transfer (`prepare`)
            prepare(device)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        value = device_fingerprint(tensor)
        # a name received twice (in parts) cannot match the whole tensor's: kept as a mismatch
        self._sums[name] = value if name not in self._sums else self._sums[name] + value + 1

    @property
    def prints(self) -> dict[str, int]:
        """Every fingerprint so far as an integer (one device sync)."""
        return read(self._sums)


class StaleEngine(SyncMismatch):
    """An engine labelled θ_v does not hold θ_v (its fingerprints are not the trainer's)."""

    why = "engine weights are not the trainer's"


def describe(version: int, expected: dict[str, int], got, sent: dict[int, dict[str, int]]) -> str | None:
    """What is wrong with one engine worker's report ``got`` after the update labelled θ_version
    (None: nothing). ``got``: its fingerprints by name, None (it received no update since it started),
    or a one-line problem it found itself. ``sent``: the trainer's fingerprints of recent versions."""
    if isinstance(got, str):
        return f"is labelled θ_{version} but {got}"
    if got is None:
        return f"is labelled θ_{version} but has received no weights since it started: the label moved without a sync"
    if got == expected:
        return None
    missing = [n for n in expected if n not in got]
    differ = [n for n in expected if n in got and got[n] != expected[n]]
    extra = [n for n in got if n not in expected]
    parts = [f"{len(differ)} of {len(expected)} tensors differ from the trainer's (first: {differ[0]})" if differ else "",
             f"{len(missing)} were not received (first: {missing[0]})" if missing else "",
             f"{len(extra)} were received that it did not send (first: {extra[0]})" if extra else ""]
    text = f"is labelled θ_{version} but received other weights: {'; '.join(p for p in parts if p)}"
    same = [v for v, prints in sent.items() if v != version and prints == got]
    if same:
        behind = version - max(same)
        text += (f"; they are θ_{max(same)}'s: the engine is {behind} version{'s' if behind != 1 else ''} behind"
                 if behind > 0 else f"; they are θ_{max(same)}'s")
    return text


class SentWeights:
    """The trainer's fingerprints of the last `KEEP` versions it sent (set by the trainer thread),
    and the judgement of each engine update against them (the rollout thread)."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._sent: dict[int, dict[str, int]] = {}
        self._lock = threading.Lock()

    def expect(self, version: int, prints: dict[str, int]) -> None:
        if not isinstance(version, int):  # a pass over the source that sent no version
            raise ValueError(f"sent weight fingerprints need the version sent, got version {version!r}")
        with self._lock:
            self._sent[version] = dict(prints)
            for v in sorted(self._sent)[: -self.keep]:
                del self._sent[v]

    def expects(self, version: int) -> bool:
        """Whether θ_version was sent with fingerprints (only such updates are judged)."""
        with self._lock:
            return version in self._sent

    def judge(self, version: int, reports: list) -> StaleEngine | None:
        """``reports``: each engine worker's fingerprints after the update labelled θ_version."""
        with self._lock:
            sent = dict(self._sent)
        for i, got in enumerate(reports):
            problem = describe(version, sent[version], got, sent)
            if problem is not None:
                return StaleEngine(f"rollout engine worker {i} {problem} (weight fingerprints after the sync of "
                                   f"θ_{version}; trainer.sync_fingerprint)")
        if not reports:
            return StaleEngine(f"no rollout engine reported fingerprints after the sync of θ_{version}")
        return None
