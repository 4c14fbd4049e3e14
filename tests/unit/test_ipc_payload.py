"""The colocated GPU path (rollout.weight_transfer=ipc, engine core in a child process): vLLM's IPC
update passes CUDA IPC handles as collective_rpc arguments, which cross the process boundary through
vLLM's msgpack encoder and the engine core's decoder. On CPU: an IPC-shaped payload (the args tuple
`reduce_tensor` returns for a CUDA tensor) pushed through both, in a fresh process, as a run sets up
its environment (pace.rollout.engine.configure_environment) and without it."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent("""
    import os, sys
    from omegaconf import OmegaConf
    from pace.rollout.engine import configure_environment
    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    cfg = OmegaConf.create({"weight_transfer": sys.argv[1], "placement": "colocate", "engine_process": "child",
                            "kv_cache_gib": 1, "cpu_threads_bind": "nobind", "cpu_threads": 1})
    if sys.argv[2] == "configured":
        configure_environment(cfg, "cuda")  # what train.py does before vLLM is imported
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    # reduce_tensor(cuda_tensor)'s args: class, size, stride, offset, storage class, dtype, device,
    # handle, storage size, storage offset, requires_grad, ref-counter handle and offset, event, sync
    args = (torch.Tensor, torch.Size([4, 8]), (8, 1), 0, torch.storage.UntypedStorage, torch.bfloat16, 0,
            b"\\x01" * 64, 64, 0, False, b"ref", 0, b"evt", True)
    info = {"names": ["model.embed_tokens.weight"], "dtype_names": ["bfloat16"], "shapes": [[4, 8]],
            "ipc_handles": [{"GPU-0000": args}]}
    # the core client's utility call (client index, call id, method, args), as LLM.collective_rpc sends it
    msg = (0, 1, "collective_rpc", ("update_weights", None, (), {"update_info": info}))
    try:
        out = MsgpackDecoder().decode(MsgpackEncoder().encode(msg))
    except TypeError as exc:
        print("REFUSED", exc)
        sys.exit(0)
    got = out[3][3]["update_info"]["ipc_handles"][0]["GPU-0000"]
    # msgpack carries tuples and torch.Size as lists (set_() takes either); classes, the dtype and
    # the handles' bytes come back as themselves
    assert list(got) == [list(x) if isinstance(x, tuple) else x for x in args], got
    print("ROUNDTRIP", rebuild_cuda_tensor.__name__)
""")


def _run(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_ipc_handles_cross_to_a_child_engine_once_the_run_configured_its_environment():
    assert "ROUNDTRIP" in _run("ipc", "configured")


def test_without_it_vllm_refuses_them():
    # the failure the run would hit at its first weight sync: why configure_environment sets the flag
    assert "REFUSED" in _run("ipc", "bare")
    assert "REFUSED" in _run("nccl", "configured")  # only the ipc backend sets it
