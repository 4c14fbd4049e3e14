"""Delta updates over NCCL (GPU; written against vLLM 0.32's sources, not yet run on a GPU).

The engines' side is the checked NCCL engine (`pace_nccl`) taught vLLM's sparse protocol
(`vllm/distributed/weight_transfer/sparse_nccl_engine.py`): an update whose info carries
`num_updates_list` is a list of patches — per tensor its changed flat indices (int32) and values,
broadcast from trainer rank 0 in that order — applied *in place* through the model's own loader by
`load_checkpoint_weight_patches` (`vllm/model_executor/model_loader/checkpoint_weight_patch.py`: a
NaN-masked checkpoint tensor, TP slicing and fused qkv/gate_up parameters mapped by `load_weights`).
Its docstring: sparse online updates must not use the layerwise-reload lifecycle. So this engine
starts vLLM's layerwise reload (with pace/weights/reload.py's checks) only when the update's first
tensors are whole (`receive_weights` of dense info); a patch update touches the served tensors
directly, then re-processes the layers that share a parameter (the tied head: on CUDA its
processing reads the shared weight, a no-op; on CPU it would repack the head's kernel).

One engine backend takes both kinds, so a server started by scripts/launch_rollout_server.sh
needs nothing new. vLLM's own sparse engine takes only patches (its full syncs would have to be
patches of every element: 3× the bytes in bf16), and its trainer side opens a second NCCL group.

What a patch update is checked by (pace/weights/inplace.py): it is received and applied in chunks of
`rollout.delta_chunk_mib`, not held on the GPU whole; each patch's loader call reports the parameters
it wrote, and a patch that wrote none (or one the last whole update did not load) makes the update
untrusted — reported through the reload check (`take_failure`: {"untrusted": line}), the trainer's
next sync whole; a worker takes patches only on a version whose update passed its checks
(`held_version`, the patches' base compared before anything is applied); and it advances its
fingerprints of θ_base by what it received, so the trainer judges the engines after a delta as after
a whole sync (pace/weights/fingerprint.py). Not run on a GPU: NCCL's broadcast, CUDA streams and a real
model's loaders under NaN-masked patches (tests/unit/test_nccl_patches.py runs this module's logic
against a stand-in communicator and a toy loader on CPU). MoE models are refused (pace/config_checks.py
`check_model`): vLLM lays their experts out anew on load.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import torch
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from pace.weights import fingerprint, inplace
from pace.weights.reload import ExactReload, refresh, shared_parameters


@dataclass
class DeltaNCCLUpdateInfo(NCCLWeightTransferUpdateInfo):
    num_updates_list: list[int] | None = None  # patches: changed elements per tensor (None: whole tensors)
    version: int | None = None  # the trainer step of these weights
    base: int | None = None  # patches: the version they apply to
    chunk_bytes: int | None = None  # patches: a worker receives at most this much before applying (None: inplace.CHUNK_BYTES)
    base_sums: list[int] | None = None  # patches: θ_base's fingerprint terms at each one's positions (delta.Plan)


class CheckedDeltaNCCLWeightTransferEngine(ExactReload, NCCLWeightTransferEngine):
    """`pace_nccl`: vLLM's NCCL engine with the reload's checks, and patch updates in place."""

    update_info_cls = DeltaNCCLUpdateInfo

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kind: str | None = None  # this update's: "whole" or "patches", None before its first receive
        # patches in: what each wrote, and the fingerprint terms of what was received (queued on the device)
        self._patched: tuple[DeltaNCCLUpdateInfo, dict[str, set[str]], dict[str, torch.Tensor]] | None = None
        self._received: int | None = None  # a whole update's version, held once it is checked
        self.held_version: int | None = None  # the version patches may start from (None: none, or not trusted)

    def start_weight_update(self) -> None:
        self._kind = None  # the lifecycle starts with the first receive, once its kind is known
        self.untrusted = None  # this update's, not one left by an update that never finished

    def receive_weights(self, update_info: DeltaNCCLUpdateInfo) -> None:
        kind = "whole" if update_info.num_updates_list is None else "patches"
        if self._kind is None:
            self._kind = kind
            if kind == "whole":
                ExactReload.start_weight_update(self)  # vLLM's layerwise reload, checked
            else:
                self._shared, self._patched = shared_parameters(self.model), None
        elif self._kind != kind:
            raise RuntimeError("one weight update is either whole tensors or patches, not both")
        if kind == "whole":
            self.held_version = self._received = None
            super().receive_weights(update_info)
            self._received = update_info.version  # held once the reload's checks pass (finish_weight_update)
        else:
            self._receive_patches(update_info)

    def _receive_patches(self, info: DeltaNCCLUpdateInfo) -> None:
        """As vLLM's `SparseNCCLWeightTransferEngine.receive_weights` (indices, then values, per
        tensor, on the communicator's device), but received and applied in chunks of at most
        `chunk_bytes` (pace/weights/inplace.py), not all received first. The base is checked before
        anything is applied; patches this worker cannot take are received all the same (every worker
        takes part in every broadcast) and dropped, chunk by chunk."""
        from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

        from pace.weights.gloo import DeltaMismatch

        group = self.model_update_group
        if group is None:
            raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        held = self.held_version
        refused = None if held is not None and held == info.base else (
            f"weight patches for θ_{info.base} → θ_{info.version}, but this engine worker holds "
            f"{'no version to patch (none yet, or its last update failed or was not trusted)' if held is None else f'θ_{held}'}"
            ": the trainer must send whole tensors")
        if refused is None:
            self.held_version = None  # until they are in and audited (finish_weight_update)
        written: dict[str, set[str]] = {}
        terms: dict[str, torch.Tensor] = {}
        device = group.device
        metas = list(zip(info.names, [getattr(torch, d) for d in info.dtype_names], info.shapes, info.num_updates_list,
                         strict=True))
        sizes = [inplace.wire_bytes(n, dtype) for _, dtype, _, n in metas]
        with on_device(device) as stream:
            for run in inplace.chunks(sizes, info.chunk_bytes or inplace.CHUNK_BYTES):
                received = []
                for name, dtype, shape, n in (metas[i] for i in run):
                    indices = torch.empty(n, dtype=torch.int32, device=device)
                    values = torch.empty(n, dtype=dtype, device=device)
                    group.broadcast(indices, src=0, stream=stream)
                    group.broadcast(values, src=0, stream=stream)
                    received.append(CheckpointWeightPatch(name=name, shape=tuple(shape), dtype=dtype, values=values,
                                                          indices=indices))
                if refused is None:
                    if self.fingerprinting:
                        for p in received:
                            terms[p.name] = fingerprint.terms_at(p.indices, p.values)
                    for name, params in inplace.apply(self.model, received).items():
                        written.setdefault(name, set()).update(params)
                del received  # this chunk's buffers go before the next is received
        if refused is not None:
            raise DeltaMismatch(refused)
        self._patched = (info, written, terms)

    def finish_weight_update(self) -> None:
        kind, self._kind = self._kind, None
        if kind == "whole":
            ExactReload.finish_weight_update(self)
            received, self._received = self._received, None
            self.held_version = received if self.failure is None else None  # a failed whole update is no base
            return
        patched, self._patched = self._patched, None
        failures = []
        for name, layer in self.model.named_modules():  # the layers that share a patched parameter
            if any(id(p) in self._shared for p in layer._parameters.values() if p is not None):
                try:
                    refresh(name, layer)
                except Exception as exc:  # noqa: BLE001 - named in the update's failure
                    failures.append(f"{name}: {exc}")
        self.failure = "; ".join(failures) or None
        if patched is None:  # none received
            return
        info, written, terms = patched
        # the names each patch's loader call wrote against those the last whole update loaded
        loaded = None if self.last_audit is None else self.last_audit.loaded
        self.untrusted = inplace.untrusted(written, loaded, info.base, info.version)
        if self.fingerprinting:  # θ_version's, advanced from θ_base's as received (one device sync)
            self.fingerprint = inplace.advance(self.fingerprint, fingerprint.read(terms), info.names, info.base_sums)
        if self.failure is None and self.untrusted is None:
            self.held_version = info.version


class DeltaNCCLTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine (whole tensors, packed) and `send_patches` over its group, with a
    deadline: `abort` (pace/weights/sync.py calls it past `rollout.update_timeout_s`) aborts the group's
    communicator, so that a broadcast waiting on an engine that stopped returns, and the update raises.
    Written against vLLM 0.32's `PyNcclCommunicator.destroy` (`ncclCommAbort` in a thread of its own,
    after which its broadcasts return at once): not run on a GPU."""

    aborted = False

    def abort(self) -> None:
        self.aborted = True
        cancel = getattr(self.client, "cancel", None)  # BlockingClient: the engines are not labelled with it
        if cancel is not None:
            cancel()
        if self.model_update_group is not None:
            self.model_update_group.destroy()

    def send_weights(self) -> None:
        """vLLM's, then a failure if the deadline aborted it: past the abort its broadcasts return at once,
        so the rest of the source is still walked (every rank's gathers end) but the engines got nothing."""
        super().send_weights()
        self._check_aborted()

    def _check_aborted(self) -> None:
        if self.aborted:
            raise TimeoutError("the transfer group was aborted at rollout.update_timeout_s: the engines did not get "
                               "the update")

    chunk_bytes: int | None = None  # the engine workers' chunk of patches (`rollout.delta_chunk_mib`; None: theirs)

    def send_patches(self, patches: list, version: int, base: int, base_sums: list[int] | None = None) -> None:
        """Rank 0: pace/weights/delta.py's patches of θ_version against θ_base, broadcast as vLLM's
        `SparseNCCLTrainerWeightTransferEngine._broadcast_chunk` does (indices, then values);
        ``base_sums`` (the plan's): the workers advance their fingerprints with them."""
        info = DeltaNCCLUpdateInfo(names=[p.name for p in patches],
                                   dtype_names=[str(p.values.dtype).split(".")[-1] for p in patches],
                                   shapes=[list(p.full_shape) for p in patches],
                                   num_updates_list=[int(p.indices.numel()) for p in patches], version=version, base=base,
                                   chunk_bytes=self.chunk_bytes, base_sums=base_sums)
        from pace.weights.gloo import run_into

        self.client.start_weight_update()
        future: Future = Future()  # the engines receive inside update_weights while rank 0 broadcasts
        threading.Thread(target=run_into, args=(future, self.client.update_weights, asdict(info)),
                         name="pace-nccl-patches", daemon=True).start()
        if future.done():
            future.result()
        device = self.model_update_group.device
        with on_device(device) as stream:  # the group's device, as vLLM's sparse sender
            for p in patches:
                self.model_update_group.broadcast(p.indices.to(device, torch.int32).contiguous(), src=0, stream=stream)
                self.model_update_group.broadcast(p.values.to(device).contiguous(), src=0, stream=stream)
        future.result()
        self._check_aborted()
        self.client.finish_weight_update()
        self._post_send_sync()


@contextlib.contextmanager
def on_device(device: torch.device):
    """The communicator's device made current, and its current stream (None off CUDA), as vLLM's
    `SparseNCCLTrainerWeightTransferEngine._broadcast_chunk` does (a CPU device: no device context).
    A CPU device is what the tests' stand-in communicator has (tests/unit/test_nccl_patches.py)."""
    if device.type != "cuda":
        yield None
        return
    with torch.accelerator.device_index(device.index):
        yield torch.cuda.current_stream(device=device)
