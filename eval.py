"""mean@k of a model on a prompt set, sampled with vLLM and graded by math-verify.

    python eval.py                                  # the tiny model on the arithmetic val split
    python eval.py model.path=runs/.../ckpt rollout.temperature=0.6

mean@k = the mean over problems of the fraction of k samples that are correct. For now this covers
the tiny arithmetic sets; the six math benchmarks and in-training validation are issue #4.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import hydra
from omegaconf import DictConfig

from pace.config import ConfigError, register, validate

register()


@hydra.main(config_path="conf", config_name="eval", version_base=None)
def main(cfg: DictConfig) -> None:
    from train import UserError, load_prompts, resolve_device, resolve_model

    try:
        validate(cfg)
        device = resolve_device(cfg)
        from pace.rollout import engine as engine_lib

        engine_lib.configure_environment(cfg.rollout, device)
        model_path = resolve_model(cfg, progress=True)
        from transformers import AutoTokenizer

        prompts = load_prompts(cfg, AutoTokenizer.from_pretrained(model_path))
    except (UserError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

    from tqdm import tqdm
    from vllm import SamplingParams

    from pace.reward import Grader

    k = cfg.data.group_size
    llm = engine_lib.build_engine(model_path, cfg.rollout, cfg.model.dtype, cfg.seed)
    params = SamplingParams(n=k, max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, seed=cfg.seed)
    outputs = llm.generate([{"prompt": p.text} for p in prompts], params, use_tqdm=cfg.logger.progress)
    per_level: dict[str, list[float]] = defaultdict(list)
    with Grader(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s) as grader:
        for prompt, out in tqdm(list(zip(prompts, outputs)), desc="grading", disable=not cfg.logger.progress):
            correct = grader.grade([c.text for c in out.outputs], [prompt.answer] * k)
            score = sum(correct) / k
            per_level["all"].append(score)
            if "level" in prompt.meta:
                per_level[f"level{prompt.meta['level']}"].append(score)
    engine_lib.shutdown(llm)
    result = {name: sum(v) / len(v) for name, v in sorted(per_level.items())}
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    (out_dir / "eval.json").write_text(json.dumps({"model": model_path, "k": k, f"mean@{k}": result}, indent=2))
    for name, v in result.items():
        print(f"{name:>8}  mean@{k} = {v:.3f}  ({len(per_level[name])} problems)")


if __name__ == "__main__":
    main()
