"""Weight sync, the trainer's side: θ_version from every trainer rank to the rollout engines.

    sync = WeightSync(cfg, trainer, rollout, placement)   # every rank (rollout: rank 0's, None elsewhere)
    sync.prepare(version)    # every rank, right after the update of that version
    sync.publish(version)    # every rank, once the step's checkpoint (if any) is written

The weights are a `CastSource` over the trainer's parameters (each all-gathered with
`full_tensor()` under FSDP, a collective every rank joins, and cast to the engine dtype), given to
a vLLM trainer-side weight-transfer engine (`sender`); on rank 0 it fingerprints what it sends, for the
rollout thread to compare with the engines' after each update (pace/weights/fingerprint.py). The engines'
side is driven by the rollout thread (`RolloutWorker`), which owns them; the worker is the
`VLLMWeightSyncClient` here. Each update reaches it as a `WeightUpdate` (pace/weights/update.py)
carrying its version.

- ``shm`` (CPU; engines on rank 0's host): rank 0 writes θ into a shared-memory slot and posts
  it; the rollout thread loads it between engine steps while the trainer goes on. A newer
  version replaces one not yet loaded.
- ``nccl`` (GPU, vLLM's `NCCLTrainerWeightTransferEngine`, not yet run on a GPU: README): rank 0
  broadcasts each parameter to every engine worker while the rollout thread holds the engines
  in `update_weights`; the trainer waits for the broadcast (and for a validation in progress).
- ``ipc`` (one GPU shared by trainer and engine, vLLM's `IPCTrainerWeightTransferEngine`, not yet
  run): the engine opens CUDA IPC handles of the trainer's tensors; the trainer waits likewise.

With `rollout.weight_delta` (gloo, nccl): `prepare` plans the sync (pace/weights/delta.py: every
rank diffs the cast of its shard against the version the engines hold, rank 0 gathers the changed
elements, the engines still serving), and `publish` sends either every tensor or only the patches.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading

import torch

from pace.errors import EngineFailed, RolloutError, UpdateFailed
from pace.net import free_port, transfer_address
from pace.placement import SHM_TRANSFER, Placement
from pace.weights.update import WeightUpdate


class WeightSync:
    def __init__(self, cfg, trainer, rollout, placement: Placement, barrier=lambda: None, decide=lambda flag: flag):
        self.barrier = barrier  # the trainer ranks' wait on rank 0 (pace/control.py): hours, not NCCL's watchdog
        self.decide = decide  # rank 0's flag on every rank (pace/control.py): a delta sent whole after a regroup
        self.backend = placement.transfer  # the name vLLM's factories register it under (shm: pace_shm)
        self.acc = trainer.acc
        from pace.weights import transfer  # vLLM's trainer side: imported by a sync, not by this module

        sent = None if rollout is None else rollout.sent_weights  # rank 0, `trainer.sync_fingerprint`: pace/weights/fingerprint.py
        on_sent = None if sent is None else lambda prints: self._sent_prints(sent, prints)
        source = transfer.CastSource(trainer.model, getattr(torch, cfg.model.dtype), on_sent)
        # a checkpoint's copy of θ (`weights`) walks the same tensors without fingerprints: only what
        # is sent is θ_version's as the engines get it, and a copy may come between syncs
        self.copies = transfer.CastSource(trainer.model, getattr(torch, cfg.model.dtype))
        rank = self.acc.process_index
        self._client: BlockingClient | None = None  # nccl/gloo, rank 0: one for the run (a regroup keeps its state)
        self.cfg, self.rollout, self.source = cfg, rollout, source
        self.delta = None  # rollout.weight_delta: the cast θ the engines hold, and each sync's plan
        if cfg.rollout.weight_delta:
            from pace.weights.delta import DeltaTracker

            self.delta = DeltaTracker(trainer.model, getattr(torch, cfg.model.dtype), cfg.rollout.full_sync_every,
                                      cfg.rollout.delta_max_frac, fingerprints=cfg.trainer.sync_fingerprint)
        self.plan = None  # the last sync's plan (delta.Plan; rollout.weight_delta), logged as sync/*
        self._full_prints: dict | None = None  # rank 0: the fingerprints of the last full pass sent
        self._due = False  # rank 0: the group is formed again at the next publish (decided when it was planned)
        self._untrusted = False  # rank 0: the last patches are no base for the next (pace/weights/inplace.py): whole next
        if self.backend == SHM_TRANSFER:
            info = transfer.ShmTrainerInitInfo(rank=rank, directory=transfer.shm_dir(), run_id=_shared_token(self.acc))
            self.sender = transfer.ShmTrainerWeightTransferEngine.trainer_init(info, client=rollout, source=source)
        elif self.backend in ("nccl", "gloo"):  # gloo: the NCCL protocol over TCP (pace/weights/gloo.py)
            self.sender = self._connect(rank)
        elif self.backend == "ipc":  # colocated: the engine maps the trainer's CUDA tensors (no copy)
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

            self.sender = IPCTrainerWeightTransferEngine.trainer_init(
                IPCTrainerInitInfo(rank=rank), client=None if rollout is None else BlockingClient(rollout), source=source)
        else:
            raise ValueError(f"rollout.weight_transfer: unknown backend {self.backend!r}")
        self._update: WeightUpdate | None = None  # shm, rank 0: θ_version written, to post
        self._version, self._sending = None, None
        self._written: WeightUpdate | None = None  # shm, rank 0: the last θ written (its slot, until rewritten)

    def _connect(self, rank: int):
        """The trainer side of the nccl/gloo group of trainer rank 0 and every engine worker (the
        rendezvous at rank 0's `transfer_address`); rank 0 has the engines join it."""
        extra = {}
        if self.backend == "nccl":  # the checked engines take whole tensors and patches (pace/weights/nccl_delta.py)
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo as Info

            from pace.weights.nccl_delta import DeltaNCCLTrainerWeightTransferEngine as Engine
        else:
            from pace.weights.gloo import GlooTrainerInitInfo as Info
            from pace.weights.gloo import GlooTrainerWeightTransferEngine as Engine

            extra["delta"] = bool(self.cfg.rollout.weight_delta)  # the workers keep a mirror for patches
            extra["timeout_s"] = float(self.cfg.rollout.update_timeout_s)  # every operation of the group: the deadline
        fleet = None if self.rollout is None else self.rollout.fleet
        if fleet is not None:  # rank 0: the ranks of the engines in service
            workers = fleet.transfer_workers()
        else:
            workers = self.cfg.rollout.engines * self.cfg.rollout.tensor_parallel_size
        info = Info(rank=rank, master_address=transfer_address(self.cfg.rollout), master_port=free_port() if rank == 0 else 0,
                    world_size=1 + workers, **extra)
        if self.delta is not None:
            self.delta.reset()  # a (re)formed group: the engines in it get whole tensors next
        if self.rollout is not None and self._client is None:
            self._client = BlockingClient(self.rollout, label=True)  # one for the run: a regroup keeps its state
        engine = Engine.trainer_init(info, client=None if self.rollout is None else self._client, source=self.source)
        if self.backend == "nccl":  # the engine workers' chunk of patches applied in place (pace/weights/inplace.py)
            engine.chunk_bytes = self.cfg.rollout.delta_chunk_mib << 20
        return engine

    def prepare(self, version: int) -> None:
        """shm: every rank materialises θ, rank 0 writes it into a slot (the engines go on with
        the previous weights). nccl: nothing yet (the broadcast needs the engines paused)."""
        self._sending = version  # what the source's passes send from here on (its fingerprints' version)
        self._update = self.sender.write(version) if self.backend == SHM_TRANSFER else None
        self._version = version
        # delta: planned while the engines serve (every rank; the changed elements gathered to rank 0),
        # whole when the group is formed again at this update (a server joins or was lost: rank 0 decides)
        self.plan = None
        if self.delta is not None:
            due = self._regroup_due(admit=True)
            untrusted, self._untrusted = self._untrusted, False  # the engines' weights are not known exactly
            if self.decide(due or untrusted):
                self.delta.reset()
            self.plan = self.delta.plan(version)
        if self._update is not None:
            self._written = self._update

    def weights(self, version: int) -> list | None:
        """θ_version (the trainer's current weights) as host (name, tensor) pairs in the engine dtype
        on rank 0, None elsewhere. Every rank calls it. shm: a copy of the slot if it holds
        θ_version (else None); nccl: streamed from the parameters (all-gathered one at a time)."""
        if self.backend == SHM_TRANSFER:
            if self._written is None or self._written.version != version or not self.acc.is_main_process:
                return None
            with self._written.lock:
                from pace.weights.transfer import read_slot

                return read_slot(self._written.info)
        main, out = self.acc.is_main_process, []
        for name, t in self.copies:  # every rank iterates: each parameter is a collective
            if main:  # only rank 0 keeps a host copy (16 GB for an 8B model)
                out.append((name, t.to("cpu", copy=True)))
        return out if main else None

    def publish(self, version: int) -> None:
        """The engines load θ_version. shm: rank 0 posts the slot to the rollout thread and goes
        on; nccl/gloo/ipc: every rank takes part in the broadcast, which returns once the engines
        have it. Rank 0 first waits for the engines to take an update (held while an in-training
        validation runs) and pauses them; the other ranks wait for it at the control barrier, not in
        the first all-gather of the broadcast, where NCCL's watchdog would end them."""
        if version != self._version:
            raise RuntimeError(f"publish({version}) after prepare({self._version})")
        if self.backend == SHM_TRANSFER:
            if self._update is not None:
                self.sender.client.post_update(self._update)
        else:
            failure = None
            if self.sender.is_sender:
                try:
                    # servers ready to join come in here, before the engines pause (delta: when it was planned,
                    # so that the plan is whole and logged so)
                    self._regroup(admit=self.delta is None)
                    # may wait for a validation; send_weights' start_weight_update is then a no-op
                    self.sender.client.start(WeightUpdate(version))
                    self._regroup(admit=False)  # a server lost while the update started
                except Exception as exc:  # noqa: BLE001 - every rank leaves the update with it (below)
                    failure = exc
            # every rank waits here for rank 0 (not in the first all-gather, under NCCL's watchdog), and
            # learns whether the update goes ahead
            self._agree(version, failure)
            fleet = None if self.rollout is None else self.rollout.fleet
            known = set() if fleet is None else set(fleet.group_members())  # a joiner or draining one too
            plan = self.plan
            if plan is not None and not plan.full and self.decide(self.delta.version is None):
                plan = self.plan = self.delta.whole(plan)  # rank 0 formed the group again: its engines get θ whole
            try:
                with self._deadline(version):
                    if plan is not None and not plan.full:
                        if self.sender.is_sender:  # the other ranks gave their changes when it was planned
                            self._expect_delta(plan)
                            self.sender.send_patches(plan.patches, version, self.delta.version, plan.base_sums)
                            self._untrusted = self._take_untrusted(fleet)
                    else:
                        self.sender.send_weights()  # every rank: each tensor is a collective under FSDP
                if plan is not None:
                    self.delta.sent(plan, self._full_prints)
            except Exception as exc:
                if not self.sender.is_sender:
                    raise  # a rank's own collectives failed: nothing to agree on
                if self.delta is not None:
                    self.delta.failed()  # what the engines hold is unknown: whole tensors next
                self.source.finish()  # the gathers the other ranks wait in, the broadcast given up
                self.sender.shutdown()  # the group's connections close: a live engine's receive fails (or waits out its deadline)
                failure = exc
                blamed = [] if fleet is None else fleet.wait_failed(known)
                if blamed:
                    silent = any(not s.answered or s.calling for s in blamed)  # servers (pace/rollout/server_state.py)
                    named = " and ".join(f"{s.index} ({s.url})" for s in blamed)
                    failure = EngineFailed(f"rollout engine{'s' * (len(blamed) > 1)} {named} "
                                           f"{'did not answer' if silent else 'failed'} during the weight broadcast, "
                                           f"which raised {_one_line(exc)}")
                    failure.__cause__ = exc
            self._agree(version, failure)
        self._update = None

    def _agree(self, version: int, failure: BaseException | None) -> None:
        """Every rank: rank 0's failure (its one line) on every rank, each then raising `UpdateFailed`
        with it: the ranks leave the update together, and every rank writes the checkpoint (train.py)."""
        line = self.decide(None if failure is None else _one_line(failure))
        if line is not None:
            raise UpdateFailed(version, line) from failure

    @contextlib.contextmanager
    def _deadline(self, version: int):
        """Rank 0, the transfer: past `rollout.update_timeout_s` the sender's group is aborted so that a
        broadcast waiting on a peer that stopped returns (vLLM's PyNccl broadcast has no timeout of its
        own: `abort` is `ncclCommAbort`, pace/weights/nccl_delta.py). The gloo group's operations and the
        engines' update calls time out by themselves at the same deadline (pace/weights/gloo.py)."""
        abort = getattr(self.sender, "abort", None) if self.sender.is_sender else None
        timer = None
        if abort is not None:
            timeout = self.cfg.rollout.update_timeout_s

            def expire():
                print(f"warning: the weight update to θ_{version} passed rollout.update_timeout_s={timeout:g} s: "
                      "aborting its transfer group", file=sys.stderr, flush=True)
                abort()

            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()

    def _sent_prints(self, sent, prints: dict) -> None:
        """Rank 0, a full pass: the engines are judged against these; a delta plan starts from them."""
        self._full_prints = prints
        sent.expect(self._sending, prints)

    def _expect_delta(self, plan) -> None:
        """Rank 0: a delta's fingerprints (from the change: pace/weights/delta.py) are expected, and the
        engines judged by them as after a whole sync: gloo's workers fingerprint each tensor they reload
        whole from their mirror; nccl's advance their fingerprints of θ_base by the patches they
        received and the plan's base sums (pace/weights/inplace.py)."""
        sent = None if self.rollout is None else self.rollout.sent_weights
        if sent is not None and plan.prints is not None and (self.backend == "gloo" or plan.base_sums is not None):
            sent.expect(plan.version, plan.prints)

    @staticmethod
    def _take_untrusted(fleet) -> bool:
        """Rank 0, after patches loaded: whether a worker does not trust them as the base of the next
        (a patch that reached no parameter, or one the whole update did not load: pace/weights/inplace.py);
        then one warning, and the next sync sends θ whole (`prepare`)."""
        why = None if fleet is None else fleet.take_untrusted()
        if why is None:
            return False
        print(f"warning: {why}; the next weight sync sends θ whole (rollout.weight_delta)", file=sys.stderr, flush=True)
        return True

    def _regroup_due(self, admit: bool) -> bool:
        """Rank 0, server mode: whether the group is formed again at this update (a server failed or
        left; ``admit``: a server is ready to join, and joins now: pace/rollout/healing.py)."""
        if self.rollout is not None and self.rollout.fleet.regroup_due(admit):
            self._due = True
        return self._due

    def _regroup(self, admit: bool) -> None:
        """Server mode, rank 0: the group formed again, without the servers that failed or left and
        (``admit``, the engines not yet paused) with those ready to join."""
        if self._regroup_due(admit):
            # on the rollout thread, once no validation holds it (the rendezvous below would wait for it):
            # every member's engine released first, so one that fails there is not counted in the group
            self._client.call(self.rollout.fleet.release_engines)
            self.sender.shutdown()
            self.sender = self._connect(0)
            self._due = False

    def metrics(self) -> dict:
        """The last sync's `sync/*` (rollout.weight_delta): whether it sent θ whole, its bytes to each
        engine worker, and the fraction of elements whose engine-dtype value changed."""
        plan = self.plan
        if plan is None:
            return {}
        out = {"sync/full": int(plan.full), "sync/bytes": plan.bytes}
        if plan.changed_frac is not None:  # measured against the engines' version (unknown at a first sync)
            out["sync/changed_frac"] = plan.changed_frac
        return out

    def close(self) -> None:
        self.sender.shutdown()


class BlockingClient:
    """vLLM's four-call client over the rollout thread: each call runs there, between engine
    steps, and returns when it has (for the NCCL engine, which needs `update_weights` to run
    while the trainer broadcasts). An update is started with its `WeightUpdate` (`start`), whose
    version labels the engines when vLLM's trainer engine finishes it."""

    POLL_S = 1.0  # how often a waiting call checks that the rollout thread is still there

    def __init__(self, rollout, label: bool = False):
        self.rollout = rollout
        self.label = label  # nccl/gloo: the update info names its version (the workers' check of patch bases)
        self.update: WeightUpdate | None = None  # the update in progress: from `start` to finish_weight_update
        self._cancelled = False

    def call(self, fn):
        """``fn()`` on the rollout thread, between engine steps and after a validation in progress."""
        return self._run(fn)

    def _run(self, fn):
        if self.rollout.ident is None:  # the thread has not started: the engines are idle, call here
            return fn()
        future = self.rollout.call(fn)
        while True:  # a thread that died never runs the call: fail within a poll, not never
            try:
                return future.result(timeout=self.POLL_S)
            except concurrent.futures.TimeoutError:
                if not self.rollout.is_alive():
                    err = self.rollout.error
                    raise RolloutError(f"rollout thread died with a weight-update call pending: {err!r}") from err

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._run(lambda: self.rollout.init_weight_transfer_engine(init_info))

    def start(self, update: WeightUpdate) -> None:
        """Once per update, by WeightSync.publish before the trainer ranks' barrier: the engines
        pause for ``update`` (after a validation in progress); the trainer engine's own
        start_weight_update (in send_weights) then finds it started."""
        if self.update is None:
            self._run(self.rollout.begin_update)
        self.update = update

    def start_weight_update(self) -> None:
        """vLLM's trainer engine's call (in send_weights): the update was started by `start`."""
        if self.update is None:
            raise RuntimeError("BlockingClient: start_weight_update before start(update): no version to label "
                               "the engines with")

    def update_weights(self, update_info) -> None:
        if self.label and self.update is not None and update_info.get("version") is None:
            update_info = {**update_info, "version": self.update.version}
        self._run(lambda: self.rollout.fleet.load(update_info))

    def cancel(self) -> None:
        """The update under way was aborted at its deadline (pace/weights/nccl_delta.py): its finish fails
        instead of labelling the engines with a version they did not get."""
        self._cancelled = True

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``weight_version``: vLLM's trainer engines pass none; the started update's version is used."""
        update = self.update
        if update is None:
            raise RuntimeError("BlockingClient: finish_weight_update without an update started")
        if self._cancelled:
            self.update, self._cancelled = None, False
            raise TimeoutError(f"the weight update to θ_{update.version} was aborted at rollout.update_timeout_s")
        self._run(lambda: self.rollout.end_update(update.version))
        self.update = None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _shared_token(acc) -> str:
    """A name for this run's shared-memory slots (rank 0's pid)."""
    return f"{os.getpid()}" if acc.is_main_process else "-"

