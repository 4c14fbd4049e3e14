"""The weight path, the last stage of the loop: θ_version from the trainer to the rollout engines,
and the checks that the engines compute with it.

    sync.py         the trainer's side of a sync (every rank): prepare / publish, the shm, gloo, nccl
                    and ipc backends driven through vLLM's trainer-side weight-transfer engines
    update.py       `WeightUpdate`: one update (its version, the backend's update info, the slot lock),
                    what the trainer side hands the rollout thread
    source.py       the trainer's parameters as the engines load them (torch only)
    streams.py      CUDA work done inside vLLM's side-stream context, done on the default stream
    transfer.py     vLLM weight transfer: the `pace_shm` backend (both sides), the engines' worker
                    extension, the backends' registration; gloo.py: the NCCL protocol over TCP
    reload.py       the engine worker's checked reload (tied head re-processed, incomplete updates fail)
    delta.py        delta sync, the trainer's side: which elements changed, as sparse patches; nccl_delta.py
                    the nccl engines' patch updates, inplace.py their chunks, name audit and fingerprints
    fingerprint.py  what each engine's loader received against what the trainer sent, after every sync
    mismatch.py     the run-time on-policy mismatch guard

Nothing here imports `pace.rollout` (tests/unit/test_import_graph.py): the rollout thread is this
package's client, handed in (`WeightSync(…, rollout, …)`), never imported.
"""
