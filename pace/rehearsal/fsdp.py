"""The preset's Accelerate config on a CPU: FSDP2 over gloo, as `accelerate launch --config_file
conf/accelerate/fsdp.yaml` makes the trainer on GPUs.

`Accelerator.prepare` chooses FSDP only on accelerators: for a CPU run Accelerate keeps `MULTI_CPU`,
i.e. DDP, whatever the launcher's config says. A rehearsal (`rehearsal.accelerate_config`) sets the
yaml's FSDP plugin on the run's Accelerator as the launcher would (`plugin_from_yaml`) and marks the run
FSDP, so the trainer is sharded with `fully_shard` over the rehearsal's processes: its parameters are
DTensors, each `full_tensor()` of the weight sync a collective every rank joins, its checkpoints
per-rank shards (torch DCP), as on the preset's GPUs. The CPU tests reach Accelerate's FSDP2 path the
same way (tests/integration/fsdp_prepare.py, ddp_step.py).
"""
from __future__ import annotations

from pathlib import Path


def plugin_from_yaml(path: str | Path):
    """An accelerate config file's FSDP plugin, as `accelerate launch` builds it from the file."""
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp = yaml.safe_load(Path(path).read_text())["fsdp_config"]
    kwargs = {k if k == "fsdp_version" else k.removeprefix("fsdp_"): v for k, v in fsdp.items()}
    if "transformer_layer_cls_to_wrap" in kwargs:  # the launcher's name for the plugin's field
        kwargs["transformer_cls_names_to_wrap"] = kwargs.pop("transformer_layer_cls_to_wrap").split(",")
    kwargs.pop("cpu_ram_efficient_loading", None)  # a loading mode for hub checkpoints, set by the launcher's env
    kwargs["cpu_offload"] = kwargs.pop("offload_params", False)
    return FullyShardedDataParallelPlugin(**kwargs)


def shard_on_cpu(accelerator, path: str | Path) -> None:
    """Make ``accelerator`` (a CPU run's, several processes) an FSDP run with the plugin of ``path``,
    before the trainer is built (its `prepare` shards the model)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if getattr(accelerator.state, "fsdp_plugin", None) is None:
        accelerator.state.fsdp_plugin = plugin_from_yaml(path)
    accelerator.state.distributed_type = DistributedType.FSDP
    # as Accelerate does when the launcher asks for FSDP (accelerate/state.py, AcceleratorState.__init__): every
    # later AcceleratorState() copies the partial state's type over its own, which would make the run DDP again
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def as_launched(cfg, world: int) -> str | None:
    """A rehearsal (`rehearsal.accelerate_config`): the preset's Accelerate config, as its launcher would
    apply it, before the Accelerator is built: its mixed precision in ACCELERATE_MIXED_PRECISION (unless
    set, or the model is float32: the rehearsal's on a CPU without bf16 matmuls); the config's path when the
    trainer is to be sharded with it (several processes), else None."""
    import os

    import yaml

    r = cfg.rehearsal
    if not r.enabled or r.accelerate_config is None:
        return None
    path = Path(r.accelerate_config)
    if not path.is_absolute():
        path = Path(__file__).resolve().parents[2] / path
    launcher = yaml.safe_load(path.read_text())
    if launcher.get("mixed_precision") not in (None, "no") and cfg.model.dtype != "float32":  # a float32 model: none
        os.environ.setdefault("ACCELERATE_MIXED_PRECISION", launcher["mixed_precision"])
    return str(path) if world > 1 and launcher.get("distributed_type") == "FSDP" else None
