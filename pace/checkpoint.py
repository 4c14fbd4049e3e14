"""Checkpoints: what a run needs to continue as if it had not stopped (docs/design.md §5).

    <run>/checkpoints/step-000040/        θ_40: written after training step 39, before step 40
        model.safetensors optimizer.bin custom_checkpoint_0.pkl (LR schedule) random_states_<rank>.pkl
                          Accelerate `save_state` (every rank; sharded under FSDP): weights, AdamW
                          moments, LR schedule, the Python/NumPy/torch RNG states
        run_state.pkl     rank 0's side: the pool (every pooled group with its tokens, behaviour
                          log-probs, versions and scores; the groups in flight as they stood),
                          the policy's state (PACE: ρ and the PFS
                          window), the prompt sampler (position and returned prompts), the next
                          group id, the fate counts, the logger's position (metrics rows, Parquet
                          parts, wandb run id), validation state, counters
        config.yaml       the run's resolved config: a resume runs with it
        model/            θ_version in the engine dtype as a loadable model directory (`eval.py
                          model.path=<checkpoint>/model`), from the weight sync's slot (shm backend,
                          when that version was synced; under FSDP's sharded state dict it is the
                          one full copy of the weights in the checkpoint)
        meta.json         version, why it was written, fate counts (for people and scripts)

Groups in flight at a checkpoint are in it as they stand (`rollout.resume_inflight`, the default):
finished responses, and every unfinished one's tokens with ℓ^μ and versions; `resume=` continues
them (pace/rollout/resuming.py). With it off, or from a checkpoint written before it, they count
as `dropped_shutdown` and their prompts go back to the sampler. Either way a resumed run decides
every submitted group exactly once.
A checkpoint is written to `step-N.tmp` and renamed when complete (a kill while writing leaves
the previous ones intact); the newest `trainer.keep_checkpoints` are kept. The best validated
version's weights do not depend on checkpoints: `<run>/best/` holds them for every backend
(pace/validation.py).
"""
from __future__ import annotations

import json
import logging
import pickle
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from pace.config import override_keys, saved_config
from pace.errors import ConfigError

STATE_FILE = "run_state.pkl"
FORMAT = 1
STOP_WAIT_S = 10.0  # the longest a stop waits for the rollout thread before it checkpoints without it
# Keys a resume may change (`python train.py resume=<dir> trainer.steps=200`); the rest of the
# config is the checkpoint's, so a resumed run is the same experiment.
RESUMABLE = (
    "trainer.steps", "trainer.save_every", "trainer.keep_checkpoints", "logger.mode", "logger.progress",
    "reward.workers", "reward.timeout_s", "reward.max_failed_in_row", "device", "tools.workers", "tools.warm",
    "rollout.resume_inflight", "trainer.max_sync_mismatch", "trainer.sync_mismatch_steps", "trainer.sync_fingerprint", "trainer.dist_timeout_s", "trainer.control_timeout_s",
    "rollout.reload_probe", "rollout.reload_probe_tolerance",  # a check at the start, as the two above
    "trainer.device_memory_gib", "trainer.host_memory_gib",
    "rollout.weight_delta", "rollout.full_sync_every", "rollout.delta_max_frac", "rollout.delta_chunk_mib",  # how θ travels, not what it is
    "rollout.stream_interval", "rollout.stream_reader",  # how the engines' tokens reach the rollout thread
    "rollout.max_engine_restarts", "rollout.restart_backoff_s", "rollout.drain_timeout_s",  # how the fleet heals
    "rollout.control_port", "rollout.control_host",  # how an operator reaches the fleet
)


# Saved weights as a loadable model directory: a checkpoint's model/, the best validated <run>/best/.
# Files of a model directory that are not weights are copied next to the saved weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
VERSION_FILE = "version.json"  # in a saved weights directory: the version it holds, written with the weights


def save_weights(path: Path, weights: list, model_path: str, version: int | None = None) -> None:
    """A loadable model directory: ``model_path``'s config and tokenizer files plus ``weights``
    as one safetensors file, and ``version`` in `version.json`. Written beside ``path`` and
    renamed, so ``path`` is never half-written and says which weights it holds."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES and f.name != VERSION_FILE:
            shutil.copy2(f, tmp / f.name)
    save_file({name: t.contiguous() for name, t in weights}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if version is not None:
        (tmp / VERSION_FILE).write_text(json.dumps({"version": version}))
    install(tmp, path)


def install(src: Path, path: Path) -> None:
    """``src`` becomes ``path``; the directory it replaces waits in `<path>.old` until then (a
    kill in between leaves it there: `BestCheckpoint.load_state_dict` looks there too)."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    src.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def saved_version(path: Path) -> int | None:
    """The version a weights directory holds (its `version.json`), None if it says none."""
    try:
        return int(json.loads((Path(path) / VERSION_FILE).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def step_dir(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{version:06d}"


def checkpoint_version(checkpoint: Path) -> int:
    """The trainer version a checkpoint holds (its meta.json)."""
    return int(json.loads((Path(checkpoint) / "meta.json").read_text())["version"])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE_FILE).exists())


def resolve(resume: str) -> Path:
    """`resume=` names a checkpoint directory, or a run directory (its newest checkpoint)."""
    path = Path(resume).expanduser()
    if (path / STATE_FILE).exists():
        return path
    if not path.exists():
        raise ConfigError(f"resume={resume}: no such directory")
    found = list_checkpoints(path)
    if not found:
        raise ConfigError(f"resume={resume}: no checkpoint here (expected {STATE_FILE} or checkpoints/step-*/)")
    return found[-1]


def run_dir_of(checkpoint: Path) -> Path:
    return Path(checkpoint).resolve().parents[1]


def resume_config(cfg: DictConfig, checkpoint: Path, overrides: list[str]) -> DictConfig:
    """The checkpoint's config, with the command line's changes to `RESUMABLE` keys applied.
    Any other override fails, naming it: a resume continues the same experiment."""
    for key in override_keys(overrides):
        if key != "resume" and key not in RESUMABLE:
            raise ConfigError(
                f"resume: {key} cannot change on resume (the run continues with its checkpoint's config); "
                f"changeable: {', '.join(RESUMABLE)}"
            )
    saved = saved_config(Path(checkpoint) / "config.yaml", cfg, overrides, keep=lambda key: key == "resume")
    saved.resume = str(checkpoint)
    return saved


@dataclass
class RunParts:
    """Rank 0's stateful parts (the trainer's state goes through Accelerate on every rank)."""

    pool: object
    sampler: object
    rollout: object
    grader: object
    logger: object
    val_rows: object | None = None  # pace.validation.ValRows when eval.every > 0


def capture(parts: RunParts) -> bytes:
    """rank 0's state as of one moment: the rollout thread is paused between engine steps."""
    parts.logger.flush()  # every decided group so far is in a Parquet part the checkpoint points to
    with parts.rollout.paused():
        rollout = parts.rollout.state_dict()  # with the groups in flight it kept (rollout.resume_inflight)
        keep = {_group_of(item).id for item in rollout["inflight"]}
        state = {
            "format": FORMAT,
            "pool": parts.pool.state_dict(keep=keep),
            "sampler": parts.sampler.state_dict(),
            "rollout": rollout,
            "grader": parts.grader.state_dict(),
            "logger": parts.logger.state_dict(),
            "validations": None if parts.val_rows is None else parts.val_rows.state_dict(),  # the key checkpoints carry
        }
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def restore(state: dict, parts: RunParts) -> tuple[list, list]:
    """Load rank 0's state into freshly built parts (before the rollout thread starts). Returns
    the groups in flight at the checkpoint that the rollout continues (`rollout.resume_inflight`)
    and those dropped (dropped_shutdown, prompts returned)."""
    if state.get("format") != FORMAT:
        raise ConfigError(f"resume: checkpoint format {state.get('format')} is not {FORMAT}")
    keep = parts.rollout.cfg.rollout.resume_inflight
    dropped = parts.pool.load_state_dict(state["pool"], keep_inflight=keep)
    parts.sampler.load_state_dict(state["sampler"])
    parts.sampler.give_back([g.prompt_id for g in dropped])
    parts.rollout.load_state_dict(state["rollout"])
    ids = {g.id for g in state["pool"].get("inflight", [])} if keep else set()
    kept = [item for item in state["rollout"].get("inflight", []) if _group_of(item).id in ids]
    parts.rollout.load_inflight(kept, state["rollout"].get("version", 0))
    parts.grader.load_state_dict(state["grader"])
    if parts.val_rows is not None and state["validations"] is not None:
        parts.val_rows.load_state_dict(state["validations"])
    return kept, dropped


def _group_of(item):
    """A kept in-flight item: a group still generating (its `_Pending`) or one being graded."""
    return getattr(item, "group", item)


def load_state(checkpoint: Path) -> dict:
    with open(Path(checkpoint) / STATE_FILE, "rb") as f:
        return pickle.load(f)


def _quiet_accelerate() -> None:
    """Accelerate logs each file it saves at INFO, and warns on every save that tied embeddings
    (lm_head = embed_tokens, as in Qwen3's small models) are stored once, which reloads fine."""
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    logging.getLogger("accelerate.utils.other").addFilter(
        lambda record: "Removed shared tensor" not in record.getMessage())


class Checkpointer:
    """Writes checkpoints of one run (every rank calls `save`: the trainer state is collective)."""

    def __init__(self, run_dir: Path, accelerator, trainer, config: dict, keep: int, model_path: str | None = None,
                 weights: Callable[[int], list | None] | None = None, barrier: Callable[[], None] | None = None,
                 on_saved: Callable[[int], None] | None = None):
        """``weights(version)``: θ_version as (name, tensor) on rank 0, if at hand (`WeightSync.weights`;
        every rank calls it), written as the checkpoint's `model/`. ``barrier``: the waits on rank
        0's writing (the pool, θ as a model directory); train.py passes its control group's
        (pace/control.py), outside the trainer's collective timeout. ``on_saved(version)``, rank 0:
        who hears of each checkpoint saved (the best checkpoint: what a resume needs of it)."""
        _quiet_accelerate()
        self.model_path = model_path
        self.weights = weights or (lambda version: None)
        self.run_dir = Path(run_dir)
        self.acc = accelerator
        self.barrier = barrier or accelerator.wait_for_everyone
        self.trainer = trainer
        self.config = config
        self.keep = keep
        self.last: Path | None = None
        self.on_saved = on_saved or (lambda version: None)

    def save(self, reason: str, parts: RunParts | None, meta: dict | None = None) -> Path:
        """Write θ_version's checkpoint. ``parts`` on rank 0 (None elsewhere)."""
        t0 = time.perf_counter()
        version = self.trainer.version
        path = step_dir(self.run_dir, version)
        tmp = path.with_name(path.name + ".tmp")
        main = self.acc.is_main_process
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        self.barrier()
        self.trainer.save(tmp)  # every rank
        weights = self.weights(version)  # every rank (a collective with the nccl backend)
        if main:
            blob = capture(parts)
            (tmp / STATE_FILE).write_bytes(blob)
            (tmp / "config.yaml").write_text(OmegaConf.to_yaml(self.config))
            info = {"version": version, "reason": reason, "time": time.time(), "trainer": self.trainer.state_dict(),
                    **(meta or {})}
            (tmp / "meta.json").write_text(json.dumps(info, indent=1))
            if weights is not None and self.model_path is not None:
                save_weights(tmp / "model", weights, self.model_path)
        self.barrier()
        if main:
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
            for old in list_checkpoints(self.run_dir)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            self.on_saved(version)
        self.barrier()
        self.last = path
        if main:
            print(f"checkpoint ({reason}): {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return path

    def stop_and_save(self, parts: RunParts | None, why: str) -> Path:
        """Stop the rollout and checkpoint θ_version with what is in flight (`rollout.resume_inflight`:
        kept as it stands, continued on `resume=`; otherwise dropped, prompts back to the sampler).
        Every rank calls it."""
        if parts is not None:
            stopped = parts.rollout.stop(timeout=STOP_WAIT_S)  # a launcher's grace period is short (torchrun: 30 s)
            if not stopped:
                print(f"the rollout thread did not stop within {STOP_WAIT_S:.0f} s (an engine call that does not return): "
                      "checkpointing without it; its groups in flight are dropped", file=sys.stderr, flush=True)
            if not (stopped and parts.rollout.cfg.rollout.resume_inflight):
                dropped = parts.pool.drop_inflight(self.trainer.version, reason=f"stopped: {why}")
                parts.sampler.give_back([g.prompt_id for g in dropped])
            parts.logger.log_groups(parts.pool.drain_decided(), step=-1)
        return self.save(why, parts)

    def save_after_failure(self, parts: RunParts | None, batch, exc: BaseException) -> Path | None:
        """A failure in the training step or the loop: checkpoint if the state is consistent (one
        process, and no update of the failed step applied); the failed step's batch is not trained
        on, so its groups become dropped_shutdown and their prompts go back to the sampler."""
        if self.acc.num_processes > 1 or self.trainer.mid_step:
            why = "several processes" if self.acc.num_processes > 1 else "the weights are between two versions"
            print(f"no checkpoint after the failure ({why}); the last one: {self.last}", file=sys.stderr)
            return None
        try:
            if batch is not None and parts is not None:
                parts.pool.abandon(batch, reason=f"training step failed: {type(exc).__name__}")
                parts.sampler.give_back([g.prompt_id for g in batch.groups])
            return self.stop_and_save(parts, f"failure: {type(exc).__name__}")
        except Exception as save_exc:  # noqa: BLE001 - the original failure is what must surface
            print(f"could not write a checkpoint after the failure: {save_exc!r}", file=sys.stderr)
            return None
