"""Rank 0's training-data load at the size of the DAPO-Math-17k hub file: main's path (every row read
into a Prompt, rendered and tokenised) against the load deduplicated by problem, side by side.

    python scripts/bench_data_load.py [--copies 100] [--before-fraction 0.05]

The data: a synthetic parquet in the hub file's layout (data_source, prompt = [{content: the
template-wrapped problem, role}], ability, reward_model {ground_truth, style}, extra_info {index: a
UUID}), made from the 17,917 real rows of shared/benchmarks/dapo_math_17k.jsonl and repeated
`--copies` times, as BytedTsinghua-SIA/DAPO-Math-17k repeats them (1,791,700 rows at 100). It is read
as the default config reads the hub id: `datasets.load_dataset`, here pointed at the local parquet
(its arrow cache prepared before the clock starts, as a second start finds it).

  before  main's `load_math_prompts` (the commit `--main`, imported from git): `list(load_dataset(..))`,
          one Prompt per row; then `with_chat_template` and `fit_train_prompts` on all of them.
          Linear in rows; at 1.79 M rows its token lists alone need several GiB, so by default it
          runs on the file's first `--before-fraction` of rows and the full-size time is that / fraction.
  after   this tree's `load_math_prompts` (data.dedup=true) on the whole file, then the same two steps.

The tokenizer is the tiny model's character-level one with a ChatML template (no BPE vocabulary is
on this machine): about 3-4× the tokens of Qwen3's, so tokenising weighs more here than with the
real model. The prompt limit is the 8B presets' (rollout.max_model_len 22528 − max_tokens 20480).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from pace.config import Config  # noqa: E402
from pace.tasks.base import Prompt, with_chat_template  # noqa: E402
from pace.tasks.loading import fit_train_prompts  # noqa: E402
from pace.tasks.math import DAPO_PREFIX, DAPO_SUFFIX  # noqa: E402
from pace.tiny import build_tokenizer  # noqa: E402

BLOCK = ROOT.parent / "shared" / "benchmarks" / "dapo_math_17k.jsonl"
HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_parquet(block: Path, copies: int, out: Path) -> int:
    """The real block in the hub file's layout, repeated `copies` times; returns the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for line in block.read_text().splitlines():
        r = json.loads(line)
        rows.append({"data_source": "math_dapo",
                     "prompt": [{"content": DAPO_PREFIX + r["prompt"][0]["content"] + DAPO_SUFFIX, "role": "user"}],
                     "ability": "MATH",
                     "reward_model": {"ground_truth": r["reward_model"]["ground_truth"], "style": "rule-lighteval/MATH_v2"},
                     "extra_info": {"index": str(uuid.UUID(int=len(rows) + 1))}})
    table = pa.Table.from_pylist(rows)
    pq.write_table(pa.concat_tables([table] * copies), out, row_group_size=100_000)
    return table.num_rows * copies


def main_module(commit: str):
    """pace/tasks/math.py as it is on `commit`, imported under another name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:pace/tasks/math.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "math_on_main.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("math_on_main", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def point_hub_at(files: dict[str, Path], cache: Path) -> None:
    """`datasets.load_dataset(HUB_ID)` reads `files[HUB_ID]` (the parquet builder, arrow cache in `cache`)."""
    import datasets

    real = datasets.load_dataset

    def load(path, *args, split="train", **kwargs):
        return real("parquet", data_files=str(files[path]), split=split, cache_dir=str(cache))

    datasets.load_dataset = load


def config(path: str):
    cfg = OmegaConf.structured(Config)
    for key, value in {"data.source": "math", "data.path": path, "data.template": "dapo", "data.chat_template": True,
                       "rollout.max_model_len": 22528, "rollout.max_tokens": 20480}.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=100, help="times the 17,917-row block is repeated (hub file: 100)")
    ap.add_argument("--before-fraction", type=float, default=0.05, help="share of the rows main's path reads")
    ap.add_argument("--main", default="c5c38e7", help="the commit whose loader is 'before'")
    args = ap.parse_args()

    import datasets

    datasets.disable_progress_bars()
    load0 = os.getloadavg()[0]
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        n_full = write_parquet(BLOCK, args.copies, tmp / "full.parquet")
        before_copies = max(1, round(args.copies * args.before_fraction))
        n_before = write_parquet(BLOCK, before_copies, tmp / "part.parquet")
        files = {HUB_ID: tmp / "full.parquet", HUB_ID + "@part": tmp / "part.parquet"}
        point_hub_at(files, tmp / "hf")
        for hub_id in files:  # prepare the arrow caches (a download's one-time cost, not a start's)
            datasets.load_dataset(hub_id, split="train")
        print(f"data: {n_full:,} rows ({args.copies} × the 17,917-row block), before on {n_before:,} rows "
              f"({before_copies} copies); built and cached in {time.perf_counter() - t0:.0f} s", flush=True)

        with_chat_template([Prompt("warm", "x", "1")], tokenizer), tokenizer(["x"])  # template compiled once
        old = main_module(args.main)
        t_before, before_n = stages(lambda: old.load_math_prompts(HUB_ID + "@part", "train", "dapo"), tokenizer)
        from pace.tasks.math import load_math_prompts

        t_after, after_n = stages(lambda: load_math_prompts(HUB_ID, "train", "dapo"), tokenizer)

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(f"\ncommit {head.strip()}, {os.cpu_count()} CPU cores, load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end (above the core count, other work shares the cores)")
    scale = n_full / n_before
    print(f"{'':34s} {'before (main)':>14s} {'× ' + format(scale, 'g'):>10s} {'after (dedup)':>14s}  ratio")
    print(f"{'rows read':34s} {n_before:>14,} {n_full:>10,} {n_full:>14,}")
    print(f"{'prompts (after dropping overlong)':34s} {before_n:>14,} {'':>10s} {after_n:>14,}")
    for step in t_before:
        b, a = t_before[step], t_after[step]
        print(f"{step + ' (s)':34s} {b:>14.2f} {b * scale:>10.0f} {a:>14.2f}  {b * scale / a:.0f}×")
    print(f"(before at {n_full:,} rows = its time on {n_before:,} rows × {scale:g}: every step is linear in rows)")


def stages(load, tokenizer) -> tuple[dict[str, float], int]:
    """Seconds of each step of `train_prompts` (the load given; the chat template; the overlong check,
    which tokenises), and the prompts left."""
    t = {}
    t0 = time.perf_counter()
    prompts = load()
    t["load (read, Prompts)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    prompts = with_chat_template(prompts, tokenizer)
    t["chat template"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    kept = fit_train_prompts(config(HUB_ID), prompts, tokenizer)
    t["tokenise (fit_train_prompts)"] = time.perf_counter() - t0
    t["all"] = sum(t.values())
    return t, len(kept)


if __name__ == "__main__":
    main()
