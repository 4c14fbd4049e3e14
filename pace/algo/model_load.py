"""How each trainer rank gets the policy model before Accelerate's `prepare`.

Under FSDP2 with `fsdp_cpu_ram_efficient_loading` (every yaml in conf/accelerate/), `prepare` takes
the weights from rank 0 alone: `fsdp2_prepare_model` (accelerate/utils/fsdp_utils.py) moves the
model to the meta device, upcasts it under mixed precision, shards it, and
`fsdp2_load_full_state_dict` broadcasts each tensor of rank 0's state dict into every rank's shard.
The other ranks need only the model's structure and its non-persistent buffers (the rotary
frequencies, which Accelerate re-registers from each rank's own model), so they build it from its
config on the meta device (`accelerate.init_empty_weights`: parameters on meta, buffers computed on
the CPU): no weights read, no parameter memory. transformers' `from_pretrained` there would read
the whole checkpoint and then fill every parameter with zeros (`_move_missing_keys_from_meta_to_device`
when `is_fsdp_enabled()` and the process is not its node's local rank 0): the 30B-A3B's 61 GB of
bf16 on each of a node's 7 other ranks.

Rank 0 (and every rank where nothing is broadcast: DDP, one process, FSDP2 without that option)
loads the checkpoint in its own dtype: config.json's `dtype` (float32 where it names none), which
the meta ranks build in too, so the broadcast's tensors match (checked: rank 0's layout is sent
and compared, one line naming the first difference). Under FSDP2 with mixed precision Accelerate's
upcast then replaces each bf16 tensor by its fp32 copy in turn: rank 0's peak is the fp32 model,
4 bytes a parameter, never bf16 and fp32 of the whole model at once; it holds that fp32 copy in
host memory until the broadcast ends (the shards go to the GPUs). Casting on the GPU instead, with
bf16 crossing the broadcast, would halve it: Accelerate's broadcast sends the state dict's dtype
and the receivers expect the sharded parameters' (fp32), so it is not done here.
`pace/algo/memory_check.py` `check_host_memory` holds that load to the node's memory at start.
"""
from __future__ import annotations

import torch


def weights_from_rank0(accelerator) -> bool:
    """Does Accelerate's `prepare` broadcast rank 0's weights to the others (FSDP2 with
    `cpu_ram_efficient_loading`)? Then only rank 0 needs them before it."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return bool(accelerator.is_fsdp2 and plugin is not None and plugin.cpu_ram_efficient_loading)


def checkpoint_dtype(config) -> torch.dtype:
    """The dtype the checkpoint is loaded in: its config's (`from_pretrained(dtype="auto")` reads
    the same), float32 where it names none."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def load(model_path: str, accelerator, **kwargs):
    """The model as this rank needs it before `prepare` (``kwargs``: to transformers, e.g.
    ``attn_implementation``): on the meta device where rank 0's weights will be broadcast
    (`weights_from_rank0`) and this is not rank 0, else loaded in the checkpoint's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    dtype = checkpoint_dtype(config)
    broadcast = weights_from_rank0(accelerator) and accelerator.num_processes > 1
    if broadcast and not accelerator.is_main_process:
        from accelerate import init_empty_weights

        with init_empty_weights():  # parameters on meta; buffers (rotary frequencies) real, on the CPU
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        model.tie_weights()  # from_config under init_empty_weights leaves a tied head untied
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs)
    if broadcast:
        same_layout(model, accelerator.is_main_process)
    return model


def layout(model) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every state-dict entry, in order: what the broadcast walks."""
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]


def same_layout(model, main: bool) -> None:
    """Every rank (a collective): rank 0's `layout` is sent to the others, which raise, naming the
    first entry that differs, if theirs is not the same (a broadcast of mismatched tensors would hang
    or load garbage)."""
    import torch.distributed as dist

    box = [layout(model) if main else None]
    dist.broadcast_object_list(box, src=0)
    if main:
        return
    ours = layout(model)
    if ours != box[0]:
        first = next((a, b) for a, b in zip([*box[0], None], [*ours, None]) if a != b)
        raise RuntimeError(f"the model built on the meta device differs from rank 0's loaded one "
                           f"(rank 0: {first[0]}, here: {first[1]}): transformers' from_config and "
                           f"from_pretrained disagree for this model")
