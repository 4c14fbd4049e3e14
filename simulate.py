"""Simulate a run's pool dynamics at any scale: the project's pool policies, modelled engines and trainer.

    python simulate.py                                        # the tiny CPU run's scenario, async pool
    python simulate.py +exp=pace_qwen3_8b +sim=qwen3_8b       # a paper run (method from +exp, cluster from +sim)
    python simulate.py -m +exp=pace_qwen3_8b +sim=qwen3_8b pace.target_pool=512,1024 rollout.engines=2,4

The same config groups as train.py (pool, algo, data, rollout, trainer, `+exp=` presets) plus `sim`
(pace/sim/config.py; scenarios in conf/sim/, each value with its source). Writes the run directory
train.py writes (metrics.jsonl, groups/*.parquet, summary.json): `python -m analysis.build <dir>`
draws its figures and `python analysis/summarize_run.py <dir>` checks Lemma 1 and the fates.
Put `+sim=` after `+exp=`: a scenario's engine layout overrides the preset's.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pace.config import register as register_run
from pace.errors import ConfigError
from pace.sim.config import register, validate_sim

register_run()
register()


@hydra.main(config_path="conf", config_name="simulate", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def run(cfg: DictConfig, run_dir: str | Path | None = None, on_step=None) -> dict:
    """Simulate ``cfg`` into ``run_dir`` (default: Hydra's output directory); returns the summary.
    ``on_step(step, metrics, decided groups)``, if given, sees every step after it is logged."""
    from pace.launch import default_group
    from pace.sim.output import SimLogger
    from pace.sim.run import Simulation

    validate_sim(cfg)
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    run_dir = Path(run_dir)
    if not (run_dir / ".hydra" / "config.yaml").exists():  # called outside Hydra: analysis reads the config there
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    config = OmegaConf.to_container(cfg, resolve=True)
    logger = SimLogger(cfg, run_dir, config, group=default_group(cfg), groups=cfg.sim.groups)

    def log(step: int, metrics: dict, decided: list) -> None:
        logger.log(step, metrics)
        logger.log_groups(decided, step)
        if on_step is not None:
            on_step(step, metrics, decided)

    sim = Simulation(cfg, on_step=log)
    stats = sim.run(progress=cfg.logger.progress)
    logger.log_groups(sim.pool.drain_decided() + sim.pool.remaining(), step=-1)  # pooled / in flight at the end
    counts = sim.pool.counts()
    # a preemption at a random step (the mean over steps) throws away, without in-flight resume:
    lost = {k: sum(r[f"sim/inflight_{k}"] for r in sim.rows) / max(len(sim.rows), 1) for k in ("tokens", "gpu_s")}
    summary = {"status": "finished", "steps": sim.trainer_version, "fates": counts, "simulated": True,
               "scenario": cfg.sim.name, "sim": stats, "preemption": lost}
    logger.close([], summary)
    print(f"simulated {sim.trainer_version} steps ({stats['sim_s']:.0f} s simulated) in {stats['wall_s']:.1f} s: "
          f"fates {counts}, logs in {run_dir}", file=sys.stderr)
    print(f"a preemption at a random step finds {lost['tokens']:,.0f} generated tokens in flight "
          f"({lost['gpu_s']:,.0f} engine GPU-seconds): lost without rollout.resume_inflight, kept with it", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
