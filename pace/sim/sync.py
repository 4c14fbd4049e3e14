"""A weight sync's seconds from the bytes it moves: full syncs, and deltas (`rollout.weight_delta`).

    seconds = sim.sync.fixed_s + bytes / (sim.sync.gb_per_s · 1e9)        the trainer's side
    bytes   = P · b                          a full sync: every parameter in the engine dtype
            = c · P · (4 + b)                a delta: an int32 index + the value per changed element
    c       = 1 − (1 − changed_frac)^k       k versions since the engines' weights, each changing a
                                             fraction changed_frac of the elements independently (assumed)

P = `sim.sync.params`, b = the bytes of an element in `model.dtype` (bf16: 2, fp32: 4). A sync is
full without `rollout.weight_delta`, and with it on the run's first sync, once
`rollout.full_sync_every` versions have passed since the last full one (0: never again), and when
c exceeds `rollout.delta_max_frac` (null: b / (4 + b), where a delta's bytes reach a full sync's:
1/3 in bf16, 1/2 in fp32).

The engines' pause scales the same way: each engine pauses `sim.engine.stall_s` × seconds / the full
sync's seconds. With nccl (the GPU presets) the engines are held in `update_weights` while rank 0
broadcasts (bytes over the same link) and then load what arrived: a full reload, or the changed
elements patched in place (vLLM's `load_checkpoint_weight_patches`); the rest (pause, resume, the
version label, the fingerprint check) is assumed to be the same share of the pause as `fixed_s` is
of the trainer's side. (The CPU gloo path reloads every tensor from a patched mirror: there the
load would not shrink; no CPU scenario has the bytes model.)

Without `sim.sync.params` (a scenario fitted to a run's logs: conf/sim/tiny_cpu.yaml) nothing is
known of the bytes: every sync takes `sim.trainer.sync_s` and every load pauses `sim.engine.stall_s`,
as before the bytes model, whatever `rollout.weight_delta` says.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

INDEX_BYTES = 4  # a changed element's position: int32 (vLLM's SparseWeightPatch flat indices)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Sync(NamedTuple):
    seconds: float  # the trainer's side, before the engines load
    pause_s: float  # each engine's pause when it loads
    full: bool
    bytes: float | None  # None: no bytes model
    changed_frac: float | None  # of the elements, since the engines' weights (None: no bytes model)


def break_even(dtype: str) -> float:
    """The changed fraction at which a delta's bytes equal a full sync's."""
    b = DTYPE_BYTES[dtype]
    return b / (INDEX_BYTES + b)


class SyncModel:
    """The syncs of one run, in order: `sync(version)` for each version the engines get."""

    def __init__(self, cfg):
        s, r = cfg.sim, cfg.rollout
        self.params, self.fixed_s, self.bw = s.sync.params, s.sync.fixed_s, s.sync.gb_per_s * 1e9
        self.frac, self.const_s, self.stall_s = s.sync.changed_frac, s.trainer.sync_s, s.engine.stall_s
        self.delta, self.every = r.weight_delta, r.full_sync_every
        self.b = DTYPE_BYTES[cfg.model.dtype]
        self.max_frac = break_even(cfg.model.dtype) if r.delta_max_frac is None else r.delta_max_frac
        self._loaded: int | None = None  # the version the engines hold (None: the one they started with)
        self._last_full: int | None = None
        if self.delta and self.params is None:
            warnings.warn("rollout.weight_delta=true but sim.sync.params is null: every sync takes the constant "
                          "sim.trainer.sync_s (set sim.sync.* for the bytes model)", stacklevel=2)

    @property
    def full_bytes(self) -> float:
        return self.params * self.b

    def seconds(self, nbytes: float) -> float:
        return self.fixed_s + nbytes / self.bw

    def sync(self, version: int) -> Sync:
        if self.params is None:
            return Sync(self.const_s, self.stall_s, True, None, None)
        k = version - (0 if self._loaded is None else self._loaded)
        changed = 1.0 - (1.0 - self.frac) ** k
        full = (not self.delta or self._last_full is None or changed > self.max_frac
                or (self.every > 0 and version - self._last_full >= self.every))
        nbytes = self.full_bytes if full else changed * self.params * (INDEX_BYTES + self.b)
        self._loaded = version
        if full:
            self._last_full = version
        seconds = self.seconds(nbytes)
        return Sync(seconds, self.stall_s * seconds / self.seconds(self.full_bytes), full, nbytes, changed)
