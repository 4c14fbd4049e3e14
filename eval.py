"""mean@k of a model on benchmark sets, sampled with vLLM and graded by math-verify.

    python eval.py                                               # tiny model, arithmetic val split by level
    python eval.py model.path=runs/<run>/best eval=math6         # Table 1's six benchmarks, mean@32 (hub)
    python eval.py model.path=Qwen/Qwen3-8B-Base eval=math6 eval.data_dir=../shared/benchmarks data.chat_template=true

mean@k = mean over problems of the fraction of k samples that are correct (one request per problem
with n = k); `avg` is the unweighted mean over benchmarks. Prompts use the training template
(`data.template`, and the chat template when `data.chat_template`). Writes eval.json,
results.md, results.csv and results.tex to the run directory.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pace.config import ConfigError, register, validate

register()

GRADE_ANSWERS = 64  # answers per grading job (whole problems; at least one problem's k)


@hydra.main(config_path="conf", config_name="evaluate", version_base=None)
def main(cfg: DictConfig) -> None:
    from train import UserError, resolve_device, resolve_model

    from pace.tasks.math import DataError

    try:
        validate(cfg)
        device = resolve_device(cfg)
        from pace.rollout import engine as engine_lib

        engine_lib.configure_environment(cfg.rollout, device)
        model_path = resolve_model(cfg, progress=True)
        from transformers import AutoTokenizer

        from pace.evaluation import sets_from_config

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        sets, dropped = sets_from_config(cfg, tokenizer)
    except (UserError, ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

    from pace import evaluation
    from pace.grading import Grader, GraderError

    k = cfg.eval.k
    params = evaluation.sampling_params(cfg, seeded=device == "cuda")
    llm = engine_lib.build_engine(model_path, cfg.rollout, cfg.model.dtype, cfg.seed)
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
    table = {str(cfg.model.path or "tiny"): scores}
    out = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({
        "model": model_path, "k": k, f"mean@{k}": scores,
        "problems": {name: len(r) for name, r in results.items()},
        "dropped": dropped,  # prompts too long for rollout.max_model_len with the response budget
        "correct": results, "grading": grading,
    }, indent=1))
    (out / "results.md").write_text(evaluation.markdown_table(table, k, dropped))
    (out / "results.csv").write_text(evaluation.csv_table(table))
    (out / "results.tex").write_text(evaluation.latex_table(table, k))
    if cfg.logger.mode != "disabled":
        _log_wandb(cfg, scores, table, k)
    for name, value in scores.items():
        notes = [f"{len(results[name])} problems"] if name in results else []
        if dropped.get(name):
            notes.append(f"{dropped[name]} dropped: prompt too long")
        note = "(" + ", ".join(notes) + ")" if notes else ""
        print(f"{evaluation.title(name):>16}  mean@{k} = {100 * value:6.2f}%  {note}")
    print(f"tables: {out}/results.md, results.csv, results.tex")


def _log_wandb(cfg, scores: dict, table: dict, k: int) -> None:
    from pace.logger import resolve_wandb_mode

    import wandb

    run = wandb.init(project=cfg.logger.project, mode=resolve_wandb_mode(cfg.logger.mode), job_type="eval",
                     name=cfg.logger.name or cfg.exp_name, config=OmegaConf.to_container(cfg, resolve=True))
    run.log({f"eval/{name}/mean@{k}": v for name, v in scores.items()})
    header = ["method", *[n for n in scores if n != "avg"], "avg"]
    run.log({"eval/table": wandb.Table(columns=header, data=[[m, *(s[n] for n in header[1:])] for m, s in table.items()])})
    run.finish()


if __name__ == "__main__":
    main()
