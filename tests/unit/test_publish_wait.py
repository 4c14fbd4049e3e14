"""WeightSync.publish with a blocking backend (nccl, gloo, ipc): rank 0 may wait for the engines
(an in-training validation holds weight updates) before the broadcast, whose source iteration is
an FSDP all-gather on every rank. The other ranks must wait for rank 0 in the control group's decision
that opens the update (pace/control.py, a timeout of hours; it also tells them whether the update goes
ahead), not inside that all-gather, under the trainer's collective
timeout (NCCL's 10-minute watchdog on GPUs). Two gloo processes, a real FSDP2 model and the weight
sync's source (pace/weights/source.py); the engines are a stand-in that only iterates the source
(what vLLM's trainer engines do on ranks ≥ 1) and a rollout whose update is held 5 s; the trainer's
collectives time out at 2 s."""
from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.unit

HELD_S, COLLECTIVE_TIMEOUT_S = 5.0, 2.0


class HeldRollout:
    """BlockingClient's rollout with no thread started (calls run on the caller): the start of an
    update waits as one does behind a validation."""

    ident = None

    def begin_update(self):
        time.sleep(HELD_S)

    def end_update(self, version):
        pass


class StandInEngine:
    """A trainer-side weight-transfer engine as vLLM's send_weights drives it, without engines."""

    def __init__(self, model, client):
        self.model, self.client, self.is_sender = model, client, client is not None

    def send_weights(self):
        from pace.weights import source

        if self.is_sender:
            self.client.start_weight_update()
        for _, p in source.named_parameters(self.model):  # every rank: one all-gather per parameter
            source.engine_tensor(p, torch.bfloat16)
        if self.is_sender:
            self.client.finish_weight_update()


def _rank(rank: int, port: int, use_barrier: bool, results) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pace.weights.sync import BlockingClient, WeightSync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    sync = WeightSync.__new__(WeightSync)  # the publish logic alone: no engines to build
    sync.backend, sync._version, sync._update, sync.rollout = "gloo", 1, None, None  # no engines of its own
    sync.delta = sync.plan = None  # whole syncs (rollout.weight_delta off)
    sync._due = False  # no group formed again
    sync.sender = StandInEngine(model, BlockingClient(HeldRollout()) if rank == 0 else None)
    def decide(flag):  # train.py's Control.decide: rank 0's flag on every rank, over the control group
        box = [flag]
        dist.broadcast_object_list(box, src=0, group=control)
        return box[0]

    # every rank waits for rank 0 (its held update) in the decision that opens the update (pace/weights/sync.py)
    sync.decide = decide if use_barrier else (lambda flag: flag)
    t0 = time.perf_counter()
    try:
        sync.publish(1)
        results.put((rank, "ok", time.perf_counter() - t0))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, str(exc).splitlines()[0], time.perf_counter() - t0))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _publish(use_barrier: bool) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, use_barrier, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, what, seconds = results.get(timeout=120)
        out[rank] = (what, seconds)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


def test_other_ranks_wait_for_a_held_update_at_the_control_barrier_not_in_the_all_gather():
    out = _publish(use_barrier=True)
    assert out[0][0] == "ok" and out[1][0] == "ok", out
    assert out[1][1] >= HELD_S - 0.5  # rank 1 did wait the whole hold, and outlived its collective timeout


def test_without_the_barrier_the_wait_falls_in_the_all_gather_and_times_out():
    """The hazard the barrier removes, shown with the same processes: rank 1 waits for rank 0's held
    update inside the first all-gather and dies at the collective timeout."""
    out = _publish(use_barrier=False)
    assert out[1][0] != "ok" and out[1][1] < HELD_S, out
