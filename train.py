"""Fully-asynchronous DAPO with a pool policy (PACE and baselines). The whole run, top to bottom.

    python train.py                          # embedded tiny default on CPU (async pool)
    python train.py +exp=sync_tiny           # presets in conf/exp/ only override
    accelerate launch --config_file conf/accelerate/fsdp.yaml train.py +exp=async_qwen3_8b

Data flow (DESIGN §5): rollout thread (vLLM engines) → grading → pool → [main thread] batch →
DAPO step → weight sync (vLLM weight transfer) → engines. Rank 0 owns the rollout, the pool and
the logs; every rank trains and takes part in the weight sync.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pace import checkpoint as ckpt
from pace import rundir
from pace.algo.memory_check import check_memory
from pace.algo.precision import mixed_precision
from pace.config import register, validate
from pace.control import Control
from pace.errors import ConfigError, DataError, RolloutError
from pace.memory import release_free_heap, rss_mib
from pace.mismatch import MismatchGuard, SyncMismatch
from pace.placement import Placement
from pace.records import Fate
from pace.rollout import stopping
from pace.signals import deafen_children
from pace.tasks import loading

register()
rundir.register()  # ${pace.rank0_dir:…} in conf/config.yaml's hydra section


class UserError(Exception):
    """Bad input: printed as one line, exit status 2."""


def resolve_device(cfg) -> str:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"device=cuda (set by +exp={cfg.exp_name}) but no CUDA GPU is available here; "
            "run a *_tiny preset on CPU, or this preset on a GPU machine"
        )
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def resolve_model(cfg, progress: bool) -> str:
    """A local directory or a hub id; `model.path: null` builds (or reuses) the tiny model."""
    if cfg.model.path is None:
        from pace.tiny import build_tiny

        return str(build_tiny(OmegaConf.to_object(cfg.model.tiny), cfg.model.cache_dir, progress=progress))
    path = cfg.model.path
    if Path(path).exists():
        return path
    if path.startswith((".", "/", "~")):
        raise UserError(f"model.path: directory not found: {path}")
    try:  # a hub id: resolve it now so a typo or an offline machine fails here, in one line
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"model.path: {path!r} is not a local directory and cannot be fetched from the hub ({type(exc).__name__})") from exc


def default_group(cfg) -> str | None:
    """The jobs of one Hydra multirun share a wandb group (`logger.group` overrides)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # called outside a Hydra app (scripts)
        return None
    hc = HydraConfig.get()
    if cfg.logger.group is None and hc.mode == RunMode.MULTIRUN:
        return f"{cfg.exp_name}-{Path(hc.sweep.dir).name}"
    return None


def step_metrics(batch, pool, decided, t_wait: float, tools: bool = False) -> dict:
    """Staleness of the consumed groups, pool state, rollout throughput (DESIGN §6 names).

    `train/*` describe the consumed batch, which dynamic sampling restricts to mixed groups;
    `rollout/{acc,reward}_mean` describe every group completed since the last step, filtered or
    not: the unbiased view of how good the current policy is.
    """
    ks = [g.staleness(batch.step) for g in batch.groups]
    trajs = batch.trajectories
    n = len(ks)
    arrived = pool.drain_arrived()
    produced = [t for g in arrived for t in g.trajectories]
    rollout = {"rollout/groups_completed": len(arrived)}
    if all("s_eff" in g.scores for g in batch.groups):  # PACE scored them
        # S_eff = K_wait + u^γ K_gen of the consumed groups (DESIGN §2), as the policy scored them
        rollout["staleness/effective_mean"] = sum(g.scores["s_eff"] for g in batch.groups) / n
    if produced:
        rollout["rollout/acc_mean"] = sum(t.correct for t in produced) / len(produced)
        rollout["rollout/reward_mean"] = sum(t.reward for t in produced) / len(produced)
        if tools:
            from pace.tools.runner import usage_metrics

            rollout.update(usage_metrics(produced))
    return {
        **rollout,
        "train/reward_mean": sum(t.reward for t in trajs) / len(trajs),
        "train/acc_mean": sum(t.correct for t in trajs) / len(trajs),
        "train/response_len": sum(len(t) for t in trajs) / len(trajs),
        # model-generated tokens (tool output excluded): what the loss averages over
        "train/action_len": sum(t.num_actions for t in trajs) / len(trajs),
        "staleness/k_mean": sum(k[0] for k in ks) / n,
        "staleness/k_gen_mean": sum(k[1] for k in ks) / n,
        "staleness/k_wait_mean": sum(k[2] for k in ks) / n,
        "staleness/k_max": max(k[0] for k in ks),
        "pool/occupancy": pool.occupancy,
        "pool/rejected": sum(g.fate == Fate.REJECTED for g in decided),
        "pool/filtered": sum(g.fate == Fate.FILTERED for g in decided),
        **{f"pool/{k}": v for k, v in pool.last_metrics.items()},
        "rollout/inflight": pool.inflight,
        "version": batch.step,
        "time/wait_data": t_wait,
    }


def check_shares(cfg, world: int) -> None:
    """Every rank needs at least one trajectory of every mini-batch (each joins every gradient
    all-reduce): the smallest mini-batch (B split into `trainer.mini_batches` as the trainer
    splits it) must hold at least one trajectory per process."""
    import math

    b, n_mini, g = cfg.data.batch_prompts, cfg.trainer.mini_batches, cfg.data.group_size
    smallest = (b - (n_mini - 1) * math.ceil(b / n_mini)) * g
    if smallest < world:
        raise UserError(f"data.batch_prompts={b} in trainer.mini_batches={n_mini} leaves {max(smallest, 0)} trajectories "
                        f"in the last mini-batch, fewer than the {world} trainer processes: lower trainer.mini_batches")


def wait_for_batch(pool, rollout, step: int, stop: StopSignal):
    """Block until the pool policy forms batch `step`; re-raise a rollout failure within 0.5 s.
    None once a stop is requested (no batch is formed then)."""
    while not stop.requested:
        rollout.check()  # before forming: a batch once formed is trained on (or counted as dropped)
        batch = pool.form_batch(step, timeout=0.5)
        if batch is not None:
            return batch
    return None


STOP_WAIT_S = 10.0  # the longest a stop waits for the rollout thread before it checkpoints without it


class StopSignal:
    """SIGTERM (preemption, `kill`) or SIGINT (Ctrl-C): the first lets the step in progress finish,
    then the run checkpoints and exits with 128 + the signal number; a second, `REPEAT_S` or more
    later, stops at once, without a checkpoint. Sooner it is the same stop arriving twice: a cluster
    signals every process and torchrun forwards what it got to each rank's process group."""

    REPEAT_S = 3.0

    def __init__(self):
        self.signum: int | None = None
        self._at = 0.0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:
            if time.monotonic() - self._at < self.REPEAT_S:
                return
            raise KeyboardInterrupt
        self.signum, self._at = signum, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: stopping after the step in progress, then checkpointing "
              "(send it again to stop at once, without a checkpoint)", file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        return self.signum is not None


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (UserError, ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except SyncMismatch as exc:  # checkpointed; the cause in one line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as exc:  # a RolloutError too
        from pace.errors import EngineFailed

        failed = exc if isinstance(exc, EngineFailed) else exc.__cause__
        if not isinstance(failed, EngineFailed):
            raise
        print(f"error: {failed}", file=sys.stderr)  # checkpointed; the engine and the cause in one line
        sys.exit(1)


def run(cfg: DictConfig) -> None:
    checkpoint = None
    if cfg.resume is not None:  # continue a run: its config, its directory, its wandb run
        from hydra.core.hydra_config import HydraConfig

        checkpoint = ckpt.resolve(cfg.resume)
        cfg = ckpt.resume_config(cfg, checkpoint, list(HydraConfig.get().overrides.task))
    validate(cfg)
    device = resolve_device(cfg)

    # --- build the parts ------------------------------------------------------------------
    from pace.rollout import engine as engine_lib

    engine_lib.configure_environment(cfg.rollout, device)  # before vLLM is imported anywhere
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if device == "cpu":
        torch.set_num_threads(cfg.trainer.cpu_threads)
    # the trainer steps its LR schedule once per optimizer update, whatever the number of processes
    from accelerate.utils import InitProcessGroupKwargs

    pg = [] if cfg.trainer.dist_timeout_s is None else [InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.trainer.dist_timeout_s))]
    accelerator = Accelerator(cpu=device == "cpu", step_scheduler_with_optimizer=False, kwargs_handlers=pg,
                              mixed_precision=mixed_precision(device, cfg.model.dtype, os.environ.get("ACCELERATE_MIXED_PRECISION")))
    control = Control(accelerator, cfg.trainer.control_timeout_s)  # waits on rank 0's long work
    world = accelerator.num_processes
    check_shares(cfg, world)
    placement = Placement.of(cfg.rollout, device, world)  # the engines' process, backend, GPUs: once
    if cfg.rollout.deterministic and placement.mode != "inproc":
        raise UserError(f"rollout.deterministic needs the in-process engine, which runs with one trainer process on CPU "
                        f"(here: {world} processes on {device})")
    set_seed(cfg.seed)
    main_rank = accelerator.is_main_process
    if checkpoint is not None:
        run_dir = ckpt.run_dir_of(checkpoint)
    else:
        run_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    run_dir = Path(control.decide(str(run_dir)))  # rank 0's on every rank: each rank's `now` is its own (pace/rundir.py)
    progress = cfg.logger.progress and main_rank

    with control.main_first():  # rank 0 builds the tiny model (or downloads the hub model) once; the others reuse it
        model_path = resolve_model(cfg, progress)
    check_memory(cfg, model_path, accelerator, device)  # the trainer's states fit a device, or stop now (one line)
    val_sets = None
    if main_rank:  # bad data fails here, before the trainer and the engine are built
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompts = loading.train_prompts(cfg, tokenizer)
        stopping.stop_token_ids(tokenizer, cfg.data)  # a template with no turn end to stop on fails here
        if cfg.eval.every > 0:  # in-training validation on the rollout engine
            val_sets = loading.val_sets(cfg, tokenizer)

    from pace.algo.trainer import DAPOTrainer

    control.barrier()  # rank 0 read the data meanwhile (a hub read may be slow): the others wait here, not in the
    # trainer's first collective (model preparation) under the process group's timeout
    trainer = DAPOTrainer(model_path, cfg, accelerator)
    config = OmegaConf.to_container(cfg, resolve=True)
    checkpointer = ckpt.Checkpointer(run_dir, accelerator, trainer, config, cfg.trainer.keep_checkpoints, model_path)
    checkpointer.barrier = control.barrier  # rank 0 writes the pool and θ's model directory meanwhile

    rollout = pool = logger = fleet = grader = best = validations = parts = sync = None
    if main_rank:
        from pace.algo.advantages import is_informative
        from pace.grading import Grader
        from pace.logger import RunLogger
        from pace.pool import Pool, build_policy
        from pace.rollout.worker import RolloutWorker
        from pace.tasks.base import PromptSampler

        sampler = PromptSampler(prompts, seed=cfg.data.seed)
        metric = (lambda t: float(t.correct)) if cfg.algo.filter_on == "acc" else (lambda t: t.reward)
        pool = Pool(build_policy(cfg), informative=lambda g: is_informative([metric(t) for t in g.trajectories]),
                    capacity=cfg.pool.capacity)
        # every process rank 0 starts from here on (engines, grading workers, wandb's service) leaves
        # SIGTERM/SIGINT to the run, which checkpoints before it stops them (pace/signals.py)
        deafen_children()
        grader = Grader(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s,
                        max_failed_in_row=cfg.reward.max_failed_in_row)
        fleet = engine_lib.build_fleet(model_path, cfg, placement, tokenizer=tokenizer, log_dir=run_dir)
        if val_sets is not None:
            from pace.validation import BestCheckpoint, Validations

            best = BestCheckpoint(run_dir, model_path, cfg.eval.best_within)
        rollout = RolloutWorker(fleet, tokenizer, sampler, pool, grader, cfg, val_sets)
        if best is not None:
            from pace.selection import val_k

            validations = Validations(rollout, best, val_k(cfg), cfg.trainer.steps)
            checkpointer.on_saved = best.saved  # a checkpoint records the best: what its resume needs
        state = ckpt.load_state(checkpoint) if checkpoint is not None else None
        logger = RunLogger(cfg, run_dir, config, group=default_group(cfg), resume=state and state["logger"])
        parts = ckpt.RunParts(pool, sampler, rollout, grader, logger, validations)
        if state is not None:
            kept, dropped = ckpt.restore(state, parts)
            print(f"resuming {run_dir} from {checkpoint.name}: {pool.occupancy} pooled groups; of those in flight "
                  f"at the checkpoint {len(kept)} continued, {len(dropped)} dropped (prompts returned)", file=sys.stderr)
        print(f"run directory: {run_dir}", file=sys.stderr)
    from pace import validation
    from pace.sync import WeightSync

    control.barrier()  # rank 0 built the engines meanwhile: the others wait here, not in a collective below
    sync = WeightSync(cfg, trainer, rollout, device, barrier=control.barrier)  # every rank: the trainer side of vLLM weight transfer
    checkpointer.weights = sync.weights  # a checkpoint keeps θ_version as a model directory

    def publish(version: int) -> None:
        """Every rank: the engines load θ_version, and a copy of it is kept for `<run>/best` if the
        engines validate it and no host copy reaches the validation (nccl, gloo, ipc)."""
        validation.publish(sync, version, best, rollout, control.decide, keep=cfg.eval.every > 0,
                           within=cfg.eval.best_within)

    if checkpoint is not None:  # every rank: weights, optimizer, LR schedule, RNG states
        trainer.load(checkpoint)
    if checkpoint is not None or placement.mode == "server":
        # the engines start from θ_version (a server may hold an earlier run's weights)
        sync.prepare(trainer.version)
        publish(trainer.version)
    if main_rank:
        rollout.set_trainer_version(trainer.version)
        rollout.start()

    stop = StopSignal()
    guard = MismatchGuard.from_config(cfg)  # weights that do not reach the engines stop the run

    # --- the loop: pool → train → sync → log -------------------------------------------------
    from tqdm import tqdm

    bar = tqdm(range(trainer.version, cfg.trainer.steps), desc=cfg.exp_name, disable=not progress,
               dynamic_ncols=True, initial=trainer.version, total=cfg.trainer.steps)
    status, failure, batch, saved = "finished", None, None, None
    try:
        for step in bar:
            t_step = time.perf_counter()
            batch = None
            if main_rank:
                try:
                    batch = wait_for_batch(pool, rollout, step, stop)
                except RolloutError as exc:  # the rollout (or grading) died: stop together, checkpoint
                    failure = exc
            if control.decide(batch is None if main_rank else False):
                break
            t_wait = time.perf_counter() - t_step

            metrics = trainer.step(batch)
            if main_rank:
                rollout.set_trainer_version(trainer.version)  # θ_{step+1} exists from here on
            batch_done, batch = batch, None  # trained: a failure from here on does not undo it

            t_sync = time.perf_counter()
            due = trainer.version % cfg.rollout.sync_every == 0 or trainer.version == cfg.trainer.steps
            if due:
                sync.prepare(trainer.version)  # every rank (all-gathers under FSDP); shm: θ into its slot
            metrics["time/sync"] = time.perf_counter() - t_sync

            if main_rank:
                if validations is not None:
                    metrics.update(validations.next_row())
                decided = pool.drain_decided()
                metrics.update(step_metrics(batch_done, pool, decided, t_wait, tools=cfg.rollout.max_tool_calls > 0))
                metrics["time/trim"] = release_free_heap()  # pace/memory.py: flat host memory
                metrics["host/rss_mib"] = rss_mib()
                metrics["time/step"] = time.perf_counter() - t_step
                metrics.update(rollout.metrics())
                metrics.update(grader.stats())  # reward/{graded,timeouts,errors,restarts}
                logger.log(step, metrics)
                logger.log_groups(decided, step)
                bar.set_postfix(
                    reward=f"{metrics['train/reward_mean']:+.2f}",
                    pool=metrics["pool/occupancy"],
                    K=f"{metrics['staleness/k_mean']:.2f}",
                    wait=f"{t_wait:.1f}s",
                )
            mismatch = (guard.check(step, metrics) or rollout.stale) if main_rank else None  # stale: pace/fingerprint.py
            if control.decide(mismatch is not None):
                failure = mismatch or SyncMismatch("stopped with rank 0 (on-policy mismatch)")
                break
            if cfg.trainer.save_every and trainer.version % cfg.trainer.save_every == 0 and trainer.version < cfg.trainer.steps:
                checkpointer.save(f"every {cfg.trainer.save_every} steps", parts)
            if due:  # after the checkpoint: a sync run has nothing in flight in it
                publish(trainer.version)
        else:
            if validations is not None:  # the final weights' validation, logged after the last step
                validations.finish(logger, cfg.trainer.steps, stop=lambda: stop.requested)
            if cfg.trainer.save_every:
                checkpointer.save("end of training", parts)
        if stop.requested or failure is not None:
            status = "failed" if failure is not None else "interrupted"
            why = (signal.Signals(stop.signum).name if failure is None else failure.why
                   if isinstance(failure, SyncMismatch) else f"rollout failure: {type(failure.__cause__).__name__}")
            saved = stop_and_checkpoint(checkpointer, parts, trainer.version, why)
        if failure is not None:
            raise failure
    except KeyboardInterrupt:  # a second signal: stop now, no checkpoint
        status = "interrupted"
        print("\ninterrupted: stopping the rollout and shutting the engine down (no checkpoint)", file=sys.stderr)
    except BaseException as exc:
        status = "failed"
        if saved is None and failure is None:  # the trainer (or the loop) failed
            saved = checkpoint_after_failure(checkpointer, parts, trainer, batch, exc, accelerator)
        raise
    finally:
        bar.close()
        if main_rank:
            rollout.stop(timeout=STOP_WAIT_S if stop.requested or status == "failed" else 30.0)
            grader.close()
            if saved is None:  # nothing went into a checkpoint: log what is left as pooled/in flight
                logger.log_groups(pool.drain_decided(), step=-1)
            counts = pool.counts()
            summary = {"status": status, "steps": trainer.version, "fates": counts, "rollout": dict(rollout.stats),
                       "processes": world, "engine_process": placement.mode,
                       "train/nonfinite_skipped": trainer.nonfinite_skipped,
                       "checkpoint": str(saved or checkpointer.last) if (saved or checkpointer.last) else None,
                       "resumed_from": str(checkpoint) if checkpoint is not None else None}
            if best is not None:
                best.close()  # candidates of validations that will not come (a resume redoes them)
                summary.update(best.summary())
            logger.close(pool.remaining() if saved is None else [], summary)
            fleet.shutdown(timeout=2.0)  # deaf to SIGTERM (pace/signals.py): killed after 2 s
            if sync is not None:
                sync.close()
            pool.check_accounting()
            print(f"{status}: {trainer.version} steps, fates {counts}, logs in {run_dir}", file=sys.stderr)
    code = 128 + stop.signum if stop.requested else 130 if status == "interrupted" else 0
    if stop.requested and saved is not None:
        print(f"resume with: python train.py resume={run_dir}", file=sys.stderr)
    if world > 1:  # gloo's threads can abort the interpreter's exit (pace/teardown.py); every rank ends here
        from pace.teardown import end_processes

        end_processes(code, barrier=control.barrier if status == "finished" else None)
    if code:
        sys.exit(code)


def stop_and_checkpoint(checkpointer, parts, version: int, why: str):
    """Stop the rollout and checkpoint θ_version with what is in flight (`rollout.resume_inflight`:
    kept as it stands, continued on `resume=`; otherwise dropped, prompts back to the sampler).
    Every rank calls it."""
    if parts is not None:
        stopped = parts.rollout.stop(timeout=STOP_WAIT_S)  # a launcher's grace period is short (torchrun: 30 s)
        if not stopped:
            print(f"the rollout thread did not stop within {STOP_WAIT_S:.0f} s (an engine call that does not return): "
                  "checkpointing without it; its groups in flight are dropped", file=sys.stderr, flush=True)
        if not (stopped and parts.rollout.cfg.rollout.resume_inflight):
            dropped = parts.pool.drop_inflight(version, reason=f"stopped: {why}")
            parts.sampler.give_back([g.prompt_id for g in dropped])
        parts.logger.log_groups(parts.pool.drain_decided(), step=-1)
    return checkpointer.save(why, parts)


def checkpoint_after_failure(checkpointer, parts, trainer, batch, exc, accelerator):
    """A failure in the training step or the loop: checkpoint if the state is consistent (one
    process, and no update of the failed step applied); the failed step's batch is not trained
    on, so its groups become dropped_shutdown and their prompts go back to the sampler."""
    if accelerator.num_processes > 1 or trainer.mid_step:
        why = "several processes" if accelerator.num_processes > 1 else "the weights are between two versions"
        print(f"no checkpoint after the failure ({why}); the last one: {checkpointer.last}", file=sys.stderr)
        return None
    try:
        if batch is not None and parts is not None:
            parts.pool.abandon(batch, reason=f"training step failed: {type(exc).__name__}")
            parts.sampler.give_back([g.prompt_id for g in batch.groups])
        return stop_and_checkpoint(checkpointer, parts, trainer.version, f"failure: {type(exc).__name__}")
    except Exception as save_exc:  # noqa: BLE001 - the original failure is what must surface
        print(f"could not write a checkpoint after the failure: {save_exc!r}", file=sys.stderr)
        return None


if __name__ == "__main__":
    main()
