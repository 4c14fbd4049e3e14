"""mean@k of a model on benchmark sets, sampled with vLLM and graded by math-verify.

    python eval.py                                               # tiny model, arithmetic val split by level
    python eval.py model.path=runs/<run>                         # a training run's selected checkpoint (Table 1)
    python eval.py model.path=Qwen/Qwen3-8B-Base eval=math6 eval.data_dir=../shared/benchmarks data.chat_template=true

mean@k = mean over problems of the fraction of k samples that are correct (one request per problem
with n = k); `avg` is the unweighted mean over benchmarks. Prompts use the training template
(`data.template`, and the chat template when `data.chat_template`). Writes eval.json,
results.md, results.csv and results.tex to its own directory (hydra.run.dir).

`model.path=<run>` (a training run's directory, or `<run>/best`) scores the version the run
selected (best.json: pace/selection.py) with the run's own config (prompts, templates, sets,
token budget, `eval.k`); the command line's other overrides apply on top (e.g. `eval.data_dir=`,
`rollout.gpu_memory_utilization=`). The results go into the run: `<run>/eval/mean@<k>.{json,md,csv,tex}`,
and to wandb: online, into the run's own wandb run if it trained online (its summary,
`eval/<bench>/mean@<k>`; the run's id: summary.json's `wandb`); otherwise, to a run of its own
(job_type eval) in eval.py's directory.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pace import selection
from pace.config import register
from pace.config_checks import validate
from pace.errors import ConfigError
from pace.placement import Placement

register()

GRADE_ANSWERS = 64  # answers per grading job (whole problems; at least one problem's k)


@hydra.main(config_path="conf", config_name="evaluate", version_base=None)
def main(cfg: DictConfig) -> None:
    from pace.errors import DataError, UserError
    from pace.launch import resolve_device, resolve_model

    scored = selected = None
    try:
        scored = selection.run_dir_named(cfg.model.path)
        if scored is not None:
            cfg, selected = scored_config(cfg, scored)
        validate(cfg)
        device = resolve_device(cfg)
        from pace.rollout import engine as engine_lib

        engine_lib.configure_environment(cfg.rollout, device)
        model_path = resolve_model(cfg, progress=True)
        from transformers import AutoTokenizer

        from pace import evaluation

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        sets, dropped = evaluation.sets_from_config(cfg, tokenizer)
        params = evaluation.sampling_params(cfg, tokenizer, seeded=device == "cuda")  # a template with no turn end fails here
    except (UserError, ConfigError, DataError, selection.SelectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

    from pace.grading import Grader
    from pace.grading_job import GraderError

    k = cfg.eval.k
    placement = Placement.of(cfg.rollout, device, world=1)  # the engine's weight-transfer backend, as a run's
    llm = engine_lib.build_engine(model_path, cfg.rollout, cfg.model.dtype, cfg.seed, backend=placement.transfer)
    # Grading jobs hold ~GRADE_ANSWERS answers; reward.timeout_s is the deadline of a training
    # group's G answers, so each job's deadline is that per answer times the job's size.
    try:
        with Grader(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s,
                    max_failed_in_row=cfg.reward.max_failed_in_row) as grader:
            # rollout.max_tool_calls > 0 (the *_tool / *_retool presets): multi-turn, sandboxed tool calls
            results = evaluation.evaluate(llm.llm_engine, sets, params, grader, progress=cfg.logger.progress,
                                          grade_answers=GRADE_ANSWERS,
                                          answer_timeout_s=cfg.reward.timeout_s / cfg.data.group_size,
                                          tools=evaluation.tool_runner(cfg, tokenizer))
            grading = grader.stats()
    except GraderError as exc:  # the grader cannot grade: no scores rather than wrong ones
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    finally:
        engine_lib.shutdown(llm)

    scores = evaluation.summarize(results)
    hydra_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    if scored is None:
        table, out, stem = {str(cfg.model.path or "tiny"): scores}, hydra_dir, "results"
    else:  # into the run: <run>/eval/mean@<k>.*
        table = {f"{scored.name} θ_{selected['version']}": scores}
        out, stem = selection.result_path(scored, k).parent, f"mean@{k}"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "model": model_path, "k": k, f"mean@{k}": scores,
        "problems": {name: len(r) for name, r in results.items()},
        "dropped": dropped,  # prompts too long for rollout.max_model_len with the response budget
        "correct": results, "grading": grading,
    }
    if scored is not None:
        record = {"run": str(scored), "selected": selected, **record}
    (out / ("eval.json" if scored is None else f"{stem}.json")).write_text(json.dumps(record, indent=1))
    (out / f"{stem}.md").write_text(evaluation.markdown_table(table, k, dropped))
    (out / f"{stem}.csv").write_text(evaluation.csv_table(table))
    (out / f"{stem}.tex").write_text(evaluation.latex_table(table, k))
    if cfg.logger.mode != "disabled":
        _log_wandb(cfg, scores, table, k, hydra_dir, scored, selected)
    for name, value in scores.items():
        notes = [f"{len(results[name])} problems"] if name in results else []
        if dropped.get(name):
            notes.append(f"{dropped[name]} dropped: prompt too long")
        note = "(" + ", ".join(notes) + ")" if notes else ""
        print(f"{evaluation.title(name):>16}  mean@{k} = {100 * value:6.2f}%  {note}")
    if selected is not None:
        print(f"scored θ_{selected['version']} of {scored} (selected by in-training validation "
              f"mean@{selected['val_k']}: avg {selected['val/avg']:.3f})")
    print(f"tables: {out}/{stem}.md, {stem}.csv, {stem}.tex")


def scored_config(cfg: DictConfig, run_dir: Path) -> tuple[DictConfig, dict]:
    """The run's own config with this command line's overrides on top, and its selection (best.json)."""
    from hydra.core.hydra_config import HydraConfig

    from pace.config import saved_config

    chosen = selection.selection(run_dir, selection.run_config(run_dir))  # as the run selected: its own eval.*
    saved = saved_config(run_dir / ".hydra" / "config.yaml", cfg, list(HydraConfig.get().overrides.task),
                         keep=lambda key: key == "model.path")
    saved.model.path = chosen["path"]  # logger.mode stays the run's unless overridden: eval logs where it logged
    return saved, chosen


def _log_wandb(cfg, scores: dict, table: dict, k: int, out: Path, scored: Path | None, selected: dict | None) -> None:
    """Online, a scored run's results go into its own wandb run (resumed by id) if it trained online;
    otherwise (offline, a run trained offline, or a model that is not a run) into a run of their own,
    job_type eval, in eval.py's directory."""
    import os

    from pace.logger import resolve_wandb_mode

    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    mode = resolve_wandb_mode(cfg.logger.mode)
    values = {f"eval/{name}/mean@{k}": v for name, v in scores.items()}
    if selected is not None:
        values.update({"eval/version": selected["version"], "eval/k": k, "eval/val_k": selected["val_k"]})
    trained = selection.wandb_run(scored) if scored is not None else None
    run_id = trained and trained["id"]
    if mode == "online" and trained is not None and trained["mode"] == "online":  # a run trained offline is not on the server
        run = wandb.init(id=run_id, resume="must", project=cfg.logger.project, dir=str(out))
        run.summary.update(values)
        run.finish()
        return
    run = wandb.init(project=cfg.logger.project, mode=mode, job_type="eval", dir=str(out), group=cfg.logger.group,
                     name=f"{scored.name}-eval" if scored is not None else (cfg.logger.name or cfg.exp_name),
                     config={**OmegaConf.to_container(cfg, resolve=True), "scored_run": run_id})
    run.log(values)
    header = ["method", *[n for n in scores if n != "avg"], "avg"]
    run.log({"eval/table": wandb.Table(columns=header, data=[[m, *(s[n] for n in header[1:])] for m, s in table.items()])})
    run.finish()


if __name__ == "__main__":
    main()
