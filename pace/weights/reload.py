"""Exact in-place weight updates: every layer of the engine holds the trainer's weights after a
sync, or the sync fails naming the layers that did not.

Every vLLM 0.32 weight-transfer engine that loads checkpoint-format tensors (nccl, ipc, and
pace_shm) runs vLLM's layerwise reload (`vllm/model_executor/model_loader/reload/layerwise.py`):
`start_weight_update` moves each layer's tensors aside, a layer is processed (loaded, repacked,
copied back into its kernel tensors) once it has received as many elements as it holds, and
`finish_weight_update` puts the previous tensors back into any layer that received none, logging
"<Layer>: Failed to load weights" and going on. Two things follow, both handled here:

- **A tied output head keeps stale kernels.** Qwen3-4B and smaller tie `lm_head` to
  `embed_tokens`: one `Parameter`, two layers. The checkpoint (and the trainer's `CastSource`) has
  it once, as `model.embed_tokens.weight`, so `lm_head` receives nothing; its `weight` is the
  shared tensor, which the embedding's processing refreshes, but on CPU
  `UnquantizedEmbeddingMethod.process_weights_after_loading` also built the head's own GEMM
  kernel (`layer.cpu_linear`: oneDNN or SGL weights packed from θ_0), and nothing rebuilds it.
  The engine then samples from θ_v's body and θ_0's head (up to 2.1 nats a token after a move of
  every parameter by N(0, 0.05²); in a sync run an on-policy mismatch of 4.5e-7 at step 0 grew to
  7e-4 by step 19, flat at ~4e-7 with the fix). Fix: a
  layer that received nothing but whose parameters are all shared with layers that received
  theirs is re-processed after the reload. On CUDA the same processing is a no-op (the head reads
  the shared weight directly), so the refresh costs nothing there.
- **A dropped or partial tensor goes unnoticed.** vLLM restores a layer that received nothing
  (stale weights) and processes one that received part of its elements (one projection of a fused
  `qkv_proj`) with the rest uninitialised. Here both fail the sync with one line naming the layers
  (`IncompleteWeightUpdate`, raised by the client once every engine has finished the update, so
  each takes a complete update next; until then those layers hold stale or uninitialised values).

- **vLLM-CPU's MoE experts keep the layout of their first load only.** On a CPU,
  `CPUUnquantizedExperts.process_weights_after_loading` (`vllm/model_executor/layers/fused_moe/
  experts/cpu_moe.py`) prepacks `w13_weight`/`w2_weight` into the grouped-GEMM kernel's layout (same
  shape, other order). A reload processes an MoE layer as a weight update (`moe_kernel` already set:
  `UnquantizedFusedMoEMethod._setup_kernel`), which skips that prepack, and the reload copies the
  sent weights, in checkpoint order, into the prepacked tensors: the kernel then reads a scrambled
  θ (identical weights moved the tiny MoE's log-probs by 2.5e-2 nats in float32, up to 14.8 in
  bfloat16; a run's groups all had one reward). Fix: after the reload, each such layer that received
  its weights is prepacked again in place (`repack_cpu_experts`; the reload is then exact, 0.0).
  Other experts (CUDA's) are left as they are. `PACE_NO_CPU_MOE_REPACK=1` in an engine's
  environment leaves the defect in: what the reload probe must catch (test_reload_probe_run.py).

What receives nothing and is harmless: a layer with buffers and no parameters — RotaryEmbedding's
`cos_sin_cache` (computed from the config; vLLM warns about it at every sync), an attention layer's
`k_scale`/`v_scale` (vLLM re-processes attention layers at finalize): the trainer's parameters never
include them, so there is nothing of θ to receive.

`ExactReload` is a mixin for a worker-side `WeightTransferEngine`; pace/weights/transfer.py
registers checked variants of vLLM's nccl and ipc engines and its own shm engine with it.
"""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field

import torch

NO_CPU_MOE_REPACK = "PACE_NO_CPU_MOE_REPACK"  # =1: leave vLLM-CPU's defect in (to see what the reload probe catches)
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
UNTRUSTED = "untrusted"  # a worker's report of an update that loaded but is no base for patches: {UNTRUSTED: line}

# The served models that have begun a weight update in this process: their weights may no longer be
# the ones they loaded from disk (pace/rollout/reload_probe.py compares a reload with that load only)
_RELOADED: weakref.WeakSet = weakref.WeakSet()


def reloaded(model: torch.nn.Module) -> bool:
    """Whether ``model`` has begun a weight update since it was loaded (in this process)."""
    return model in _RELOADED


class IncompleteWeightUpdate(RuntimeError):
    """A weight update left layers of the engine without the trainer's weights."""


@dataclass
class Audit:
    """What a layerwise reload received, per layer, before vLLM finalizes it."""

    complete: list[str] = field(default_factory=list)  # received every element a checkpoint can give it
    loaded: set[str] | None = None  # the engine model's parameter names `load_weights` reported loaded
    missing: list[tuple[str, int, int]] = field(default_factory=list)  # (layer, received, expected elements)
    tied: list[tuple[str, torch.nn.Module]] = field(default_factory=list)  # received nothing, shares loaded weights
    derived: list[str] = field(default_factory=list)  # buffers only (no parameter): nothing of θ to receive

    def message(self, limit: int = 6) -> str:
        shown = ", ".join(f"{n} got {got} of {total} elements" for n, got, total in self.missing[:limit])
        more = f" and {len(self.missing) - limit} more" if len(self.missing) > limit else ""
        return (f"weight update incomplete: {shown}{more} ({len(self.missing)} layers without the sent weights; "
                "the trainer's source must name every parameter of the engine's model)")


def split_reports(reports: list) -> tuple[list[str], list[str]]:
    """The workers' reload checks of one update (`take_failure`'s, through `pace_weight_update_failure`:
    None, a failure's line, or {"untrusted": line}) as (failures: the update failed; untrusted: it
    loaded, but a delta on it is not trusted, so the next sync sends θ whole)."""
    failures = [r for r in reports if isinstance(r, str) and r]
    untrusted = [r[UNTRUSTED] for r in reports if isinstance(r, dict) and r.get(UNTRUSTED)]
    return failures, untrusted


def shared_parameters(model: torch.nn.Module) -> dict[int, list[str]]:
    """id of each parameter → the layers that hold it directly (two or more: tied weights).
    Taken before the reload moves tensors aside (the kernel tensors it restores are these)."""
    owners: dict[int, list[str]] = {}
    for name, layer in model.named_modules():
        for p in layer._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(name)
    return {k: v for k, v in owners.items() if len(v) > 1}


def audit(model: torch.nn.Module, shared: dict[int, list[str]]) -> Audit:
    """Classify the layers still waiting when the update ends (vLLM's own element counts): a layer
    that received all it holds was processed already, or is an attention layer finalize processes."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out, short = Audit(), {}
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        expected = expected_elements(layer, info.load_numel_total) if info.can_load() else 0
        if not info.can_load() or 0 < expected <= info.load_numel:  # processed, or processed at finalize
            out.complete.append(name)
        elif expected:
            short[name] = (layer, info.load_numel, expected)
    for name, (layer, got, total) in short.items():
        params = (LAYERWISE_INFO[layer].kernel_tensors or ({}, {}))[0]
        if got == 0 and not params:
            out.derived.append(name)
        elif got == 0 and params and all(
                any(o != name and o not in short for o in shared.get(id(p), ())) for p in params.values()):
            out.tied.append((name, layer))
        else:
            out.missing.append((name, got, total))
    return out


def expected_elements(layer: torch.nn.Module, total: int) -> int:
    """What a checkpoint can give ``layer`` of the ``total`` elements it holds: a vocab-parallel
    embedding or head pads its rows to a multiple of 64 (and holds added-vocabulary rows) that its
    loader zero-fills itself, uncounted; vLLM processes such a layer at finalize."""
    shard = getattr(layer, "shard_indices", None)
    if shard is None:
        return total
    return shard.num_org_elements * (layer.embedding_dim + (1 if getattr(layer, "has_bias", False) else 0))


def refresh(name: str, layer: torch.nn.Module) -> None:
    """Redo the post-load processing of a tied layer from its (updated) shared weight."""
    method = getattr(layer, "quant_method", None)
    if method is None:
        return  # a plain module reads its parameters directly: nothing derived from them
    if not _refreshable(method):
        raise IncompleteWeightUpdate(
            f"weight update: tied layer {name} ({type(method).__name__}) received no weights and its post-load "
            "processing cannot be redone in place; send it under its own name")
    method.process_weights_after_loading(layer)


def _refreshable(method) -> bool:
    """Post-load processing that rebuilds kernels from `weight` and keeps it (so it can run again)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return isinstance(method, UnquantizedEmbeddingMethod)


def repack_cpu_experts(layers) -> None:
    """Prepack again, in place, the experts of each of ``layers`` (reloaded layers) that run on
    vLLM-CPU's grouped-GEMM kernel, from the checkpoint-ordered weights the reload left in them."""
    from vllm import _custom_ops as ops

    for layer in layers:
        experts = _cpu_experts(layer)
        if experts is not None:
            for weight in (layer.w13_weight, layer.w2_weight):
                weight.data.copy_(ops.cpu_prepack_moe_weight(weight.data.clone(), experts.isa))


def _cpu_experts(layer: torch.nn.Module):
    """``layer``'s experts when they are vLLM-CPU's prepacked unquantized ones, else None."""
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or "CPUUnquantizedExperts" not in {c.__name__ for c in type(experts).__mro__}:
        return None  # (its x86, Arm and Power variants subclass it)
    return None if experts._use_zentorch else experts  # zentorch's kernel reads the weights as loaded


def decided_here(record: logging.LogRecord) -> bool:
    """A log filter for vLLM's reload logger: its per-layer "<Layer>: Failed to load weights",
    logged at every sync for the rotary caches and the tied head, is decided by `audit` (harmless,
    refreshed, or a failed update), so the line is dropped; the reload's other messages pass."""
    return record.msg != "%s: Failed to load weights"


class ExactReload:
    """Mixin for a worker-side `WeightTransferEngine` (before it in the bases) whose
    `start_weight_update` / `finish_weight_update` run vLLM's layerwise reload. A new backend's
    worker side gets the same checks as `checked(ItsEngine)`.

    `finish_weight_update` completes vLLM's lifecycle in any case (so every engine and worker
    closes its update session) and keeps what went wrong in `failure`; the client fails the sync
    from `take_failure()` (pace/weights/transfer.py's `WorkerExtension`, pace/rollout/fleet.py).

    With `fingerprinting` on, the tensors `load_weights` receives are fingerprinted as they pass
    (pace/weights/fingerprint.py: queued on the device, read once when the update finishes, so a receive on
    a side stream is not held per tensor); `fingerprint` holds those of the last finished update,
    None before one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._shared: dict[int, list[str]] = {}
        self._loaded: set[str] | None = None
        self.last_audit: Audit | None = None
        self.failure: str | None = None
        self.untrusted: str | None = None  # an update that loaded but is no base for patches (pace/weights/inplace.py)
        self.fingerprinting = False
        self._prints = None  # this update's, while it runs
        self.fingerprint: dict[str, int] | None = None

    def start_weight_update(self) -> None:
        model = self.model
        _RELOADED.add(model)  # from here on it may hold other weights than its load from disk
        self._shared = shared_parameters(model)
        model.__dict__.pop("load_weights", None)  # a wrapper left by an update that never finished
        load, self._loaded = model.load_weights, set()
        if self.fingerprinting:  # the position weights made now, not inside the receive (a side stream on nccl)
            from pace.weights.fingerprint import Fingerprints

            self._prints = Fingerprints(getattr(self, "device", None))

        def load_weights(weights):  # every backend's receive path loads through it
            names = load(weights if self._prints is None else _fingerprinted(weights, self._prints))
            if names is None or self._loaded is None:
                self._loaded = None  # a model that does not report its names
            else:
                self._loaded.update(names)
            return names

        model.load_weights = load_weights
        super().start_weight_update()

    def finish_weight_update(self) -> None:
        model = self.model
        self.drain_pending()  # an engine that applies updates in the background: all of them first
        found = audit(model, self._shared)
        found.loaded, self._loaded = self._loaded, None
        model.__dict__.pop("load_weights", None)
        super().finish_weight_update()  # vLLM restores what received nothing: the engine stays usable
        self.last_audit = found
        if os.environ.get(NO_CPU_MOE_REPACK) != "1":
            repack_cpu_experts(model.get_submodule(name) for name in found.complete)
        if self._prints is not None:
            self.fingerprint, self._prints = self._prints.prints, None
        failures = [found.message()] if found.missing else []
        for name, layer in found.tied:
            try:
                refresh(name, layer)
            except IncompleteWeightUpdate as exc:
                failures.append(str(exc))
        self.failure = "; ".join(failures) or None

    def take_failure(self) -> str | dict | None:
        """What the last update left undone (one line), else {"untrusted": why} when it loaded but a
        delta on it is not to be trusted (`split_reports`), else None; cleared."""
        failure, untrusted = self.failure, self.untrusted
        self.failure = self.untrusted = None
        if failure:
            return failure
        return {UNTRUSTED: untrusted} if untrusted else None


def _fingerprinted(weights, prints):
    """``weights`` ((name, tensor) pairs) for the loader, each fingerprinted before it loads: a list
    (nccl's and ipc's engines pass lists) stays a list; an iterator is taken as it passes."""
    if isinstance(weights, (list, tuple)):
        for name, tensor in weights:
            prints.add(name, tensor)
        return weights
    return _passing(weights, prints)


def _passing(weights, prints):
    for name, tensor in weights:
        prints.add(name, tensor)
        yield name, tensor


def checked(engine_cls: type) -> type:
    """``engine_cls`` (a worker-side `WeightTransferEngine`) with `ExactReload`."""
    return type(f"Checked{engine_cls.__name__}", (ExactReload, engine_cls), {"__module__": __name__})
