"""Fully-asynchronous DAPO with a pool policy (PACE and baselines). The whole run, top to bottom.

    python train.py                          # embedded tiny default on CPU (async pool)
    python train.py +exp=sync_tiny           # presets in conf/exp/ only override
    accelerate launch --config_file conf/accelerate/fsdp.yaml train.py +exp=async_qwen3_8b

Data flow (docs/design.md §5): rollout thread (vLLM engines) → grading → pool → [main thread] batch →
DAPO step → weight sync (vLLM weight transfer) → engines. Rank 0 owns the rollout, the pool and
the logs; every rank trains and takes part in the weight sync.
"""
from __future__ import annotations

import gc
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
from pace.algo.memory_check import check_host_memory, check_memory
from pace.algo.precision import mixed_precision
from pace.config import register
from pace.config_checks import check_model, check_processes, validate
from pace.control import Control
from pace.errors import ConfigError, DataError, RolloutError, StoppedWithRank0, UpdateFailed, UserError
from pace.launch import default_group, resolve_device, resolve_model
from pace.loop import step_metrics, wait_for_batch
from pace.memory import release_free_heap, rss_mib
from pace.placement import Placement
from pace.rehearsal import fsdp as rehearsal_fsdp
from pace.rehearsal import overlay as rehearsal
from pace.rollout import stopping
from pace.signals import StopSignal, deafen_children
from pace.tasks import loading
from pace.weights.mismatch import MismatchGuard, SyncMismatch

register()
rundir.register()  # ${pace.rank0_dir:…} in conf/config.yaml's hydra section


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (UserError, ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as exc:  # a RolloutError too
        if not report(exc):
            raise
        sys.exit(1)


def report(exc: BaseException) -> bool:
    """A failure whose cause is known (the run checkpointed it) as one `error:` line: a mismatch, a
    weight update that failed, a stop with rank 0, an engine failure. False for any other (its traceback says more)."""
    from pace.errors import EngineFailed

    line = exc if isinstance(exc, (SyncMismatch, UpdateFailed, StoppedWithRank0, EngineFailed)) else exc.__cause__
    if not isinstance(line, (SyncMismatch, UpdateFailed, StoppedWithRank0, EngineFailed)):
        return False
    print(f"error: {line}", file=sys.stderr)
    return True


def run(cfg: DictConfig) -> None:
    checkpoint = None
    if cfg.resume is not None:  # continue a run: its config, its directory, its wandb run
        from hydra.core.hydra_config import HydraConfig

        checkpoint = ckpt.resolve(cfg.resume)
        cfg = ckpt.resume_config(cfg, checkpoint, list(HydraConfig.get().overrides.task))
    swaps = rehearsal.apply(cfg, world=int(os.environ.get("WORLD_SIZE", 1)), say=int(os.environ.get("RANK", 0)) == 0)
    validate(cfg)
    device = resolve_device(cfg)

    # --- build the parts ------------------------------------------------------------------
    from pace.rollout import engine as engine_lib

    engine_lib.configure_environment(cfg.rollout, device)  # before vLLM is imported anywhere
    from pace import allocator
    from pace.placement import backend_kind

    allocator.configure_trainer(device, backend_kind(cfg.rollout, device))  # expandable segments: before CUDA starts
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if device == "cpu":
        torch.set_num_threads(cfg.trainer.cpu_threads)
    # the trainer steps its LR schedule once per optimizer update, whatever the number of processes
    from accelerate.utils import InitProcessGroupKwargs

    pg = [] if cfg.trainer.dist_timeout_s is None else [InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.trainer.dist_timeout_s))]
    sharded = rehearsal_fsdp.as_launched(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # +rehearsal=cpu: the preset's accelerate config
    accelerator = Accelerator(cpu=device == "cpu", step_scheduler_with_optimizer=False, kwargs_handlers=pg,
                              mixed_precision=mixed_precision(device, cfg.model.dtype, os.environ.get("ACCELERATE_MIXED_PRECISION")))
    if sharded:  # FSDP2 over gloo, as the preset's launcher makes it on GPUs (Accelerate keeps DDP on a CPU)
        rehearsal_fsdp.shard_on_cpu(accelerator, sharded)
    control = Control(accelerator, cfg.trainer.control_timeout_s)  # waits on rank 0's long work
    world = accelerator.num_processes
    placement = Placement.of(cfg.rollout, device, world)  # the engines' process, backend, GPUs: once
    check_processes(cfg, placement)  # every rank gets a share of every mini-batch; what needs the in-process engine
    if cfg.algo.routing_replay and not cfg.rollout.servers:  # before the model loads: can this vLLM return routes?
        from pace.rollout.routes import check_engine
        check_engine()
    set_seed(cfg.seed)
    main_rank = accelerator.is_main_process
    if checkpoint is not None:
        run_dir = ckpt.run_dir_of(checkpoint)
    else:
        run_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    run_dir = Path(control.decide(str(run_dir)))  # rank 0's on every rank: each rank's `now` is its own (pace/rundir.py)
    if swaps and main_rank:  # the run directory's config is the one that ran
        rehearsal.record(cfg, run_dir, swaps)
    progress = cfg.logger.progress and main_rank

    with control.main_first():  # rank 0 builds the tiny model (or downloads the hub model) once; the others reuse it
        model_path = resolve_model(cfg, progress)
    check_model(cfg, placement, model_path)  # what the model itself rules out (delta over nccl on an MoE), one line
    check_memory(cfg, model_path, accelerator, device)  # the trainer's states fit a device, or stop now (one line)
    check_host_memory(cfg, model_path, accelerator, gather=control.gather)  # and each node's host, the model's load
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

    rollout = pool = logger = fleet = grader = best = val_rows = parts = sync = faults = None
    if main_rank:
        from pace.algo.advantages import is_informative
        from pace.grading import Grader
        from pace.logger import RunLogger
        from pace.pool import Pool, build_policy
        from pace.rehearsal.faults import Faults
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
            from pace.validation import BestCheckpoint, ValRows

            best = BestCheckpoint(run_dir, model_path, cfg.eval.best_within)
        rollout = RolloutWorker(fleet, tokenizer, sampler, pool, grader, cfg, val_sets)
        faults = Faults.of(cfg, fleet, rollout,  # +rehearsal=cpu's injected faults (rehearsal.slow_engine, block_update)
                           resumed_at=None if checkpoint is None else ckpt.checkpoint_version(checkpoint))
        if best is not None:
            from pace.selection import val_k

            val_rows = ValRows(rollout, best, val_k(cfg), cfg.trainer.steps)
        state = ckpt.load_state(checkpoint) if checkpoint is not None else None
        logger = RunLogger(cfg, run_dir, config, group=default_group(cfg), resume=state and state["logger"])
        parts = ckpt.RunParts(pool, sampler, rollout, grader, logger, val_rows)
        if state is not None:
            kept, dropped = ckpt.restore(state, parts)
            print(f"resuming {run_dir} from {checkpoint.name}: {pool.occupancy} pooled groups; of those in flight "
                  f"at the checkpoint {len(kept)} continued, {len(dropped)} dropped (prompts returned)", file=sys.stderr)
        print(f"run directory: {run_dir}", file=sys.stderr)
    from pace import validation
    from pace.weights.sync import WeightSync

    control.barrier()  # rank 0 built the engines meanwhile: the others wait here, not in a collective below
    sync = WeightSync(cfg, trainer, rollout, placement, barrier=control.barrier,  # every rank: the trainer side of vLLM weight transfer
                      decide=control.decide)
    checkpointer = ckpt.Checkpointer(run_dir, accelerator, trainer, config, cfg.trainer.keep_checkpoints, model_path,
                                     weights=sync.weights,  # a checkpoint keeps θ_version as a model directory
                                     barrier=control.barrier,  # rank 0 writes the pool and θ's model directory meanwhile
                                     on_saved=best.saved if best is not None else None)  # the best: what a resume needs

    def publish(version: int) -> None:
        """Every rank: the engines load θ_version, and a copy of it is kept for `<run>/best` if the
        engines validate it and no host copy reaches the validation (nccl, gloo, ipc)."""
        validation.publish(sync, version, best, rollout, control.decide, keep=cfg.eval.every > 0,
                           best_within=cfg.eval.best_within)

    from pace.rollout import reload_probe

    try:
        # The reload probe (pace/rollout/reload_probe.py): the engines, which loaded θ_0 from disk, are sent
        # θ_0 again and must compute the same (server runs, resumes, MoE models); before a checkpoint's weights
        probed = reload_probe.wanted(cfg, placement.mode, checkpoint is not None, model_path)
        if probed:
            sync.prepare(0)
            if main_rank:  # one prompt scored on every engine before the update and after it
                rollout.arm_reload_probe(only=checkpoint is not None or placement.mode != "server")
            publish(0)
            shifted = rollout.reload_probe_result() if main_rank else None
            if control.decide(shifted is not None):
                raise shifted or reload_probe.ReloadShift("stopped with rank 0 (the reload probe: rollout.reload_probe)")
            if checkpoint is not None and sync.delta is not None:
                sync.delta.reset()  # a resume's θ_version goes whole, as without the probe
        if checkpoint is not None:  # every rank: weights, optimizer, LR schedule, RNG states
            trainer.load(checkpoint)
        if checkpoint is not None or (placement.mode == "server" and not probed):
            # the engines start from θ_version (a server may hold an earlier run's weights)
            sync.prepare(trainer.version)
            publish(trainer.version)
    except BaseException:  # nothing trained yet, nothing to checkpoint: the engines (servers) started here stop
        if main_rank:
            fleet.shutdown(timeout=2.0)
            grader.close()
        sync.close()
        raise
    # What is built by now lives for the run: out of the garbage collector's generations, its
    # collections scan only what the loop allocates (vLLM does so in its engine processes:
    # vllm/utils/gc_utils.py `freeze_gc_heap`); on rank 0 the rollout thread's collections otherwise
    # scan the whole heap (docs/benchmarks.md "The rollout client's cost"). Garbage first, as vLLM does:
    # what is frozen is never collected
    gc.collect()
    gc.freeze()
    if main_rank:
        rollout.set_trainer_version(trainer.version)
        rollout.start()
        if faults is not None:
            faults.start()

    stop = StopSignal()
    guard = MismatchGuard.from_config(cfg)  # weights that do not reach the engines stop the run

    # --- the loop: pool → train → sync → log -------------------------------------------------
    from tqdm import tqdm

    bar = tqdm(range(trainer.version, cfg.trainer.steps), desc=cfg.exp_name, disable=not progress,
               dynamic_ncols=True, initial=trainer.version, total=cfg.trainer.steps)
    status, failure, batch, saved = "finished", None, None, None
    # `time/step` is the loop's wall time from one step's row to the next: what happened after a row was
    # logged (a checkpoint, the update that publishes θ to the engines: `time/publish`) counts in the
    # next step, so that the steps' times add up to the run's
    t_row, t_publish = time.perf_counter(), 0.0
    try:
        for step in bar:
            t_step = time.perf_counter()
            batch = None
            if main_rank:
                try:
                    batch = wait_for_batch(pool, rollout, step, stop)
                except RolloutError as exc:  # the rollout (or grading) died: stop together, checkpoint
                    failure = exc
            why = control.decide(stop_reason(failure, stop) if main_rank and batch is None else None)
            if why is not None:  # every rank stops with rank 0, and writes the checkpoint with it
                if failure is None and not stop.requested:
                    failure = StoppedWithRank0(why)
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
                metrics.update(sync.metrics())  # rollout.weight_delta: sync/full, sync/bytes, sync/changed_frac
            metrics["time/sync"] = time.perf_counter() - t_sync

            if main_rank:
                if val_rows is not None:
                    metrics.update(val_rows.next_row())
                decided = pool.drain_decided()
                metrics.update(step_metrics(batch_done, pool, decided, t_wait, tools=cfg.rollout.max_tool_calls > 0))
                metrics["time/trim"] = release_free_heap()  # pace/memory.py: flat host memory
                metrics["host/rss_mib"] = rss_mib()
                metrics["time/publish"], t_publish = t_publish, 0.0  # θ_step to the engines, before this step's batch
                now = time.perf_counter()
                metrics["time/step"], t_row = now - t_row, now
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
            mismatch = (guard.check(step, metrics) or rollout.stale) if main_rank else None  # stale: pace/weights/fingerprint.py
            if control.decide(mismatch is not None):
                failure = mismatch or SyncMismatch("stopped with rank 0 (on-policy mismatch)")
                break
            if cfg.trainer.save_every and trainer.version % cfg.trainer.save_every == 0 and trainer.version < cfg.trainer.steps:
                checkpointer.save(f"every {cfg.trainer.save_every} steps", parts)
            if due:  # after the checkpoint: a sync run has nothing in flight in it
                try:
                    t_publish = time.perf_counter()
                    publish(trainer.version)
                    t_publish = time.perf_counter() - t_publish
                except UpdateFailed as exc:  # on every rank: the engines did not get θ (pace/weights/sync.py)
                    failure = exc
                    break
        else:
            if val_rows is not None:  # the final weights' validation, logged after the last step
                try:
                    val_rows.finish(logger, cfg.trainer.steps, stop=lambda: stop.requested)
                except RolloutError as exc:  # it could not run: the run stops with a checkpoint, resume= redoes it
                    failure = exc
            why = control.decide(stop_reason(failure, stop) if failure is not None else None)
            if why is not None and failure is None:
                failure = StoppedWithRank0(why)
            if failure is None and cfg.trainer.save_every:
                checkpointer.save("end of training", parts)
        if stop.requested or failure is not None:
            status = "failed" if failure is not None else "interrupted"
            why = stop_reason(failure, stop)
            saved = checkpointer.stop_and_save(parts, why)
        if failure is not None and world == 1:
            raise failure  # several processes: every rank stopped with it and leaves with the others (below)
    except KeyboardInterrupt:  # a second signal: stop now, no checkpoint
        status = "interrupted"
        print("\ninterrupted: stopping the rollout and shutting the engine down (no checkpoint)", file=sys.stderr)
    except BaseException as exc:
        status = "failed"
        if saved is None and failure is None:  # the trainer (or the loop) failed
            saved = checkpointer.save_after_failure(parts, batch, exc)
        raise
    finally:
        bar.close()
        if main_rank:
            rollout.stop(timeout=ckpt.STOP_WAIT_S if stop.requested or status == "failed" else 30.0)
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
            if faults is not None:
                faults.close()
            fleet.shutdown(timeout=2.0)  # deaf to SIGTERM (pace/signals.py): killed after 2 s
            if sync is not None:
                sync.close()
            pool.check_accounting()
            print(f"{status}: {trainer.version} steps, fates {counts}, logs in {run_dir}", file=sys.stderr)
    code = 128 + stop.signum if stop.requested else 130 if status == "interrupted" else 0
    if stop.requested and saved is not None:
        print(f"resume with: python train.py resume={run_dir}", file=sys.stderr)
    if failure is not None:  # several processes (one raised it above): every rank stopped together
        code = 1
        if not report(failure):
            import traceback

            traceback.print_exception(failure)
    if world > 1:  # gloo's threads can abort the interpreter's exit (pace/teardown.py); every rank ends here
        from pace.teardown import end_processes

        # together when every rank got here (a launcher stops the others once one exits non-zero)
        end_processes(code, barrier=control.barrier if status == "finished" or failure is not None else None)
    if code:
        sys.exit(code)


def stop_reason(failure: BaseException | None, stop: StopSignal) -> str:
    """Why the run stops, in a checkpoint's words: the signal, or the failure."""
    if failure is None:
        return signal.Signals(stop.signum).name if stop.signum else "stopped"
    if isinstance(failure, (SyncMismatch, UpdateFailed, StoppedWithRank0)):
        return failure.why
    return f"rollout failure: {type(failure.__cause__).__name__}"


if __name__ == "__main__":
    # ranks ≥ 1: a hydra.run.dir / hydra.sweep.dir given here holds nothing of theirs (pace/rundir.py)
    sys.argv[1:] = rundir.own_argv(sys.argv[1:])
    main()
