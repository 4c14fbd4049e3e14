"""Fully-asynchronous DAPO with a pool policy (PACE and baselines). The whole run, top to bottom.

    python train.py                          # embedded tiny default on CPU (async pool)
    python train.py +exp=sync_tiny           # presets in conf/exp/ only override
    accelerate launch --config_file conf/accelerate/fsdp.yaml train.py +exp=async_qwen3_8b

Data flow (DESIGN §5): rollout thread (vLLM) → grading → pool → [main thread] batch → DAPO step
→ weight sync → engine. Rank 0 owns the rollout, the pool and the logs; every rank trains.
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pace.config import ConfigError, register, validate
from pace.records import Fate

register()


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


def load_prompts(cfg, tokenizer):
    from pace.tasks.math import DataError, load_math_prompts

    if cfg.data.source == "arithmetic":
        from pace.tasks.arithmetic import make_prompts

        prompts = make_prompts(OmegaConf.to_object(cfg.data.arithmetic), cfg.data.split)
    else:
        try:
            prompts = load_math_prompts(cfg.data.path, cfg.data.split, cfg.data.template)
        except DataError as exc:
            raise UserError(f"data.path: {exc}") from exc
    if cfg.data.chat_template:
        from pace.tasks.base import with_chat_template

        prompts = with_chat_template(prompts, tokenizer)
    return prompts


def default_group(cfg) -> str | None:
    """The jobs of one Hydra multirun share a wandb group (`logger.group` overrides)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if cfg.logger.group is None and hc.mode == RunMode.MULTIRUN:
        return f"{cfg.exp_name}-{Path(hc.sweep.dir).name}"
    return None


def step_metrics(batch, pool, decided, t_wait: float) -> dict:
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
    if pool.policy.name == "pace":
        # S_eff = K_wait + u^γ K_gen of the consumed groups (DESIGN §2), as the policy scored them
        rollout["staleness/effective_mean"] = sum(g.scores["s_eff"] for g in batch.groups) / n
    if produced:
        rollout["rollout/acc_mean"] = sum(t.correct for t in produced) / len(produced)
        rollout["rollout/reward_mean"] = sum(t.reward for t in produced) / len(produced)
    return {
        **rollout,
        "train/reward_mean": sum(t.reward for t in trajs) / len(trajs),
        "train/acc_mean": sum(t.correct for t in trajs) / len(trajs),
        "train/response_len": sum(len(t) for t in trajs) / len(trajs),
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


def wait_for_batch(pool, rollout, step: int):
    """Block until the pool policy forms batch `step`; re-raise a rollout failure within 0.5 s."""
    while True:
        batch = pool.form_batch(step, timeout=0.5)
        rollout.check()
        if batch is not None:
            return batch


class Validations:
    """Finished in-training validations: each is offered to the best checkpoint on arrival and
    logged in the next step's row (one per row, so a wandb step never holds two)."""

    def __init__(self, rollout, best, cfg):
        self.rollout, self.best, self.k = rollout, best, cfg.eval.k
        self.final_version = cfg.trainer.steps
        self._rows: list[dict] = []

    def poll(self) -> None:
        from pace.validation import val_metrics

        for result in self.rollout.drain_validations():
            metrics = val_metrics(result, self.k)
            metrics["val/best"] = float(self.best.offer(result, metrics["val/avg"]))
            self._rows.append(metrics)
            tqdm_write(f"validation of θ_{result.version}: avg mean@{self.k} = {metrics['val/avg']:.3f}"
                       f" in {result.seconds:.1f} s{' (best so far)' if metrics['val/best'] else ''}")

    def next_row(self) -> dict:
        self.poll()
        return self._rows.pop(0) if self._rows else {}

    def finish(self, logger, step: int) -> None:
        """Wait for θ_steps's validation (the rollout starts no groups once training is done) and
        log what is left, one row per validation from step ``step`` on."""
        while not any(v["version"] == self.final_version for v in self.best.history):
            self.rollout.check()
            time.sleep(0.05)
            self.poll()
        for i, row in enumerate(self._rows):
            logger.log(step + i, row)
        self._rows.clear()


def tqdm_write(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (UserError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def run(cfg: DictConfig) -> None:
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
    accelerator = Accelerator(cpu=device == "cpu")
    set_seed(cfg.seed)
    main_rank = accelerator.is_main_process
    run_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    progress = cfg.logger.progress and main_rank

    with accelerator.main_process_first():  # rank 0 builds the tiny model once; the others reuse it
        model_path = resolve_model(cfg, progress)
    if main_rank:  # bad data fails here, before the trainer and the engine are built
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompts = load_prompts(cfg, tokenizer)

    from pace.algo.trainer import DAPOTrainer

    trainer = DAPOTrainer(model_path, cfg, accelerator)

    rollout = pool = logger = llm = grader = best = validations = None
    if main_rank:
        from pace.algo.advantages import is_informative
        from pace.logger import RunLogger
        from pace.pool import Pool, build_policy
        from pace.reward import Grader
        from pace.rollout.worker import RolloutWorker
        from pace.tasks.base import PromptSampler

        sampler = PromptSampler(prompts, seed=cfg.data.seed)
        metric = (lambda t: float(t.correct)) if cfg.algo.filter_on == "acc" else (lambda t: t.reward)
        pool = Pool(build_policy(cfg), informative=lambda g: is_informative([metric(t) for t in g.trajectories]))
        grader = Grader(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
        llm = engine_lib.build_engine(model_path, cfg.rollout, cfg.model.dtype, cfg.seed)
        val_sets = best = None
        if cfg.eval.every > 0:  # in-training validation on the rollout engine
            from pace.evaluation import sets_from_config
            from pace.validation import BestCheckpoint

            val_sets = sets_from_config(cfg, tokenizer)
            if cfg.eval.val_max_problems is not None:
                val_sets = {name: ps[: cfg.eval.val_max_problems] for name, ps in val_sets.items()}
            best = BestCheckpoint(run_dir, model_path, cfg.eval.best_within)
        rollout = RolloutWorker(llm, tokenizer, sampler, pool, grader, cfg, val_sets)
        if best is not None:
            validations = Validations(rollout, best, cfg)
        logger = RunLogger(cfg, run_dir, OmegaConf.to_container(cfg, resolve=True), group=default_group(cfg))
        print(f"run directory: {run_dir}", file=sys.stderr)
        rollout.start()

    signal.signal(signal.SIGTERM, _interrupt)  # preemption / `kill` stops the loop like Ctrl-C

    # --- the loop: pool → train → sync → log -------------------------------------------------
    from tqdm import tqdm

    bar = tqdm(range(cfg.trainer.steps), desc=cfg.exp_name, disable=not progress, dynamic_ncols=True)
    status = "finished"
    try:
        for step in bar:
            t_step = time.perf_counter()
            batch = wait_for_batch(pool, rollout, step) if main_rank else None
            t_wait = time.perf_counter() - t_step

            metrics = trainer.step(batch)
            if main_rank:
                rollout.set_trainer_version(trainer.version)  # θ_{step+1} exists from here on

            t_sync = time.perf_counter()
            if trainer.version % cfg.rollout.sync_every == 0 or trainer.version == cfg.trainer.steps:
                weights = trainer.full_state_dict()  # collective under FSDP: every rank calls it
                if main_rank:
                    rollout.post_weights(trainer.version, weights)
            metrics["time/sync"] = time.perf_counter() - t_sync

            if main_rank:
                if validations is not None:
                    metrics.update(validations.next_row())
                decided = pool.drain_decided()
                metrics.update(step_metrics(batch, pool, decided, t_wait))
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
        if validations is not None:  # the final weights' validation, logged after the last step
            validations.finish(logger, cfg.trainer.steps)
    except KeyboardInterrupt:
        status = "interrupted"
        print("\ninterrupted: stopping the rollout and shutting the engine down", file=sys.stderr)
    except BaseException:
        status = "failed"
        raise
    finally:
        bar.close()
        if main_rank:
            rollout.stop()
            grader.close()
            counts = pool.counts()
            summary = {"status": status, "steps": trainer.version, "fates": counts, "rollout": dict(rollout.stats)}
            if best is not None:
                summary.update(best.summary())
            logger.log_groups(pool.drain_decided(), step=-1)
            logger.close(pool.remaining(), summary)
            engine_lib.shutdown(llm)
            pool.check_accounting()
            print(f"{status}: {trainer.version} steps, fates {counts}, logs in {run_dir}", file=sys.stderr)
    if status == "interrupted":
        sys.exit(130)


if __name__ == "__main__":
    main()
