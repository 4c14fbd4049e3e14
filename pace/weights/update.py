"""One weight update, θ_version on its way from the trainer to the engines: the record the trainer
side hands the rollout thread, which loads it and labels the engines with `version`.

    shm:             WeightSync.prepare → WeightUpdate(version, info, lock) → RolloutWorker.post_update
                     → the engines load `info` under `lock` between two steps, labelled `version`
    nccl/gloo/ipc:   WeightSync.publish → BlockingClient.start(WeightUpdate(version)) → vLLM's trainer
                     engine broadcasts (start/update/finish_weight_update) → the engines labelled `version`

vLLM's trainer-side engines call the client's `finish_weight_update()` without a version
(`vllm/distributed/weight_transfer/nccl_engine.py`, `ipc_engine.py`), so for them the version
travels in the update the client was started with, not in the call that ends it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class WeightUpdate:
    version: int | None  # the trainer step whose weights these are (θ_version); the engines' label after it
    # loads (None: the label stays, vLLM's argument-less `send_weights`)
    info: dict | None = None  # the backend's update info as vLLM's `update_weights` takes it (shm: the slot
    # file's `ShmUpdateInfo`); None when the weights are broadcast during the update (nccl, gloo, ipc)
    lock: threading.Lock | None = None  # shm: held while the slot is read, so the trainer does not rewrite it
