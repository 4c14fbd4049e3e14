"""Table 1, end to end: score each run's selected checkpoint with eval.py, then gather by method.

    python -m analysis.table1 runs/multirun/pace_qwen3_8b/<time> runs/... --out reports/table1
    python -m analysis.table1 runs/tiny_study --out /tmp/t1                   # the tiny lab: arithmetic levels
    python -m analysis.table1 --project pace --group <group> --out reports/table1   # online wandb runs, already scored

The paper: "mean@32 for all six benchmarks … at the evaluation with the highest six-benchmark
average within 300 updates". Each run selected that version while it trained (best.json: the
in-training validation, mean@`eval.val_k`, best average among versions ≤ `eval.best_within`) and
kept its weights (`<run>/best`, pace/validation.py). This command runs `python eval.py
model.path=<run>` for every local run whose selection has no score at mean@k yet (k: `--k`, else
the run's `eval.k`: 32 in the paper's presets, 4 on the tiny lab), then reads the scores from
`<run>/eval/mean@<k>.json` (wandb: the run's summary, `eval/<bench>/mean@<k>`) and nothing else:
the in-training validation only selects. Writes table1.{md,tex,csv,json} (Sync, Async, M2PO, PACE,
any other method after them, and the ranking ablation PACE (gen) / (raw) / (effective)) and, for
multi-turn runs (`rollout.max_tool_calls` > 0), table1_multiturn.*: mean over seeds, ± the standard
deviation over seeds where there are two or more, the selected versions in the caption.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis.runs import Labelled, find_run_dirs  # noqa: E402
from pace.selection import SelectionError, result_path, run_config, selection, val_k  # noqa: E402

MAIN = ["Sync", "Async", "M2PO", "PACE"]  # the paper's rows; other methods follow them
ABLATION = {"PACE (gen)": "PACE (gen)", "PACE (raw)": "PACE (raw)", "PACE": "PACE (effective)"}  # ranking by score


@dataclass
class Entry(Labelled):
    """One run: its config, its selection (best.json) and eval.py's score of it (None: not scored yet)."""

    name: str
    source: str  # a run directory, or wandb:<path>
    config: dict
    selected: dict
    k: int
    scores: dict[str, float] | None = None

    @property
    def multiturn(self) -> bool:
        return bool((self.config.get("rollout") or {}).get("max_tool_calls"))


def local_entry(run_dir: Path, k: int | None = None, name: str | None = None) -> Entry:
    """A run folder (made absolute: eval.py runs from the repository): its selection (fails in one
    line if the selected version has no weights) and the score eval.py wrote for that version, if any."""
    run_dir = Path(run_dir).resolve()
    cfg = run_config(run_dir)
    chosen = selection(run_dir, cfg)
    k = k or int(cfg["eval"]["k"])
    entry = Entry(name or run_dir.name, str(run_dir), cfg, chosen, k)
    path = result_path(run_dir, k)
    if path.is_file():
        result = json.loads(path.read_text())
        if result["selected"]["version"] == chosen["version"]:  # else scored before the selection moved
            entry.scores = result[f"mean@{k}"]
    return entry


def wandb_entries(project: str, group: str, entity: str | None = None, k: int | None = None, api=None) -> list[Entry]:
    """Every training run of a wandb group, with the selection and the scores its summary holds
    (eval.py writes them there: `eval/<bench>/mean@<k>`, `eval/version`)."""
    import wandb

    from analysis.runs import _unwrap_wandb_config

    api = api or wandb.Api()
    prefix = f"{entity}/{project}" if entity else project
    out = []
    for run in api.runs(prefix, filters={"group": group}):
        if getattr(run, "job_type", None) == "eval":  # an offline-scored run's own eval run, synced
            continue
        cfg, summary = _unwrap_wandb_config(dict(run.config)), dict(run.summary)
        best = summary.get("best")
        if not best:
            raise SelectionError(f"wandb:{prefix}/{run.id}: no selection in its summary (no in-training validation)")
        kk = k or int(cfg["eval"]["k"])
        entry = Entry(run.name or run.id, f"wandb:{prefix}/{run.id}", cfg,
                      {**best, "val_k": val_k(cfg), "best_within": cfg["eval"].get("best_within")}, kk)
        scores = {key.split("/")[1]: float(v) for key, v in summary.items()
                  if key.startswith("eval/") and key.endswith(f"/mean@{kk}")}
        if scores and summary.get("eval/version") == best["version"]:
            entry.scores = scores
        out.append(entry)
    return out


def score(entries: list[Entry], out: Path, k: int | None, extra: list[str]) -> None:
    """eval.py on every local run not scored at its selection yet, one process per run."""
    from tqdm import tqdm

    todo = [e for e in entries if e.scores is None]
    remote = [e for e in todo if e.source.startswith("wandb:")]
    if remote:
        raise SelectionError(f"{remote[0].source}: θ_{remote[0].selected['version']} has no eval.py score in its summary "
                             "(score its run folder: python eval.py model.path=<run>)")
    for e in tqdm(todo, desc="eval.py mean@k of the selected checkpoints", disable=not todo):
        cmd = [sys.executable, str(ROOT / "eval.py"), f"model.path={_quoted(e.source)}", "logger.progress=false",
               f"hydra.run.dir={_quoted(Path(out).resolve() / 'eval' / e.name)}", *([f"eval.k={k}"] if k else []), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.strip().splitlines() if "HYDRA_FULL_ERROR" not in line]
            tail = (lines or ["(no output)"])[-1]
            raise SelectionError(f"{e.source}: eval.py failed (exit {proc.returncode}): {tail}")
        fresh = local_entry(Path(e.source), k, e.name)
        if fresh.scores is None:
            raise SelectionError(f"{e.source}: eval.py wrote no score for θ_{e.selected['version']}")
        e.scores = fresh.scores


def run_names(dirs: list[Path]) -> list[str]:
    """Names that tell runs apart: each folder's path below the folders' common parent (sweeps
    name their runs alike: `0_seed=0`), its own name for a single run."""
    dirs = [Path(d).resolve() for d in dirs]
    if len(dirs) < 2:
        return [d.name for d in dirs]
    import os

    common = Path(os.path.commonpath(dirs))
    return [d.relative_to(common).as_posix() if d != common else d.name for d in dirs]


def _quoted(path) -> str:
    """A path as a Hydra override value: sweep folders are named after overrides (`=`, `,`)."""
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def gather(entries: list[Entry]) -> dict:
    """Rows by method (mean and spread over seeds) and the ablation, from eval.py's scores only."""
    from analysis.figures import by_label

    ks = {e.k for e in entries}
    if len(ks) != 1:
        raise SelectionError(f"runs scored at different k ({sorted(ks)}): pass --k")
    groups = by_label(entries)
    order = [m for m in MAIN if m in groups] + [m for m in groups if m not in MAIN and m not in ABLATION]
    rows = {m: _row(groups[m]) for m in order}
    ablation = {name: _row(groups[m]) for m, name in ABLATION.items() if m in groups}
    if len(ablation) < 2:  # one ranking alone is no ablation
        ablation = {}
    return {"k": ks.pop(), "rows": rows, "ablation": ablation, "runs": [_describe(e) for e in entries]}


def _row(entries: list[Entry]) -> dict:
    names = list(entries[0].scores)
    scores = np.array([[e.scores[n] for n in names] for e in entries])
    return {"mean": dict(zip(names, scores.mean(0).tolist())),
            "std": dict(zip(names, scores.std(0, ddof=1).tolist())) if len(entries) > 1 else None,
            "selected": [{"run": e.name, "seed": e.seed, "version": int(e.selected["version"])} for e in entries]}


def _describe(e: Entry) -> dict:
    return {"run": e.name, "source": e.source, "label": e.label, "seed": e.seed, "version": int(e.selected["version"]),
            "val/avg": e.selected["val/avg"], "val_k": e.selected["val_k"], "best_within": e.selected["best_within"],
            "k": e.k, "scores": e.scores}


def caption(table: dict, entries: list[Entry]) -> str:
    from pace.evaluation import title

    vk = sorted({e.selected["val_k"] for e in entries})
    within = sorted({e.selected["best_within"] for e in entries}, key=lambda w: (w is None, w or 0))
    window = " / ".join("the whole run" if w is None else f"{w} updates" for w in within)
    shown = {**table["rows"], **{m: r for m, r in table["ablation"].items() if m not in table["rows"]}}
    versions = "; ".join(f"{m}: " + ", ".join(f"θ_{s['version']} (seed {s['seed']})" for s in r["selected"])
                         for m, r in shown.items())
    sets = ", ".join(title(n) for n in next(iter(table["rows"].values()))["mean"] if n != "avg")
    return (f"mean@{table['k']} (%) by eval.py on {sets}, of each run's checkpoint at its in-training validation "
            f"(mean@{' / '.join(map(str, vk))}) with the best average within {window}; mean over seeds"
            f"{', ± standard deviation over seeds' if any(r['std'] for r in table['rows'].values()) else ''}. "
            f"Selected versions: {versions}.")


def _cells(row: dict, names: list[str]) -> list[str]:
    std = row["std"]
    return [f"{100 * row['mean'][n]:.2f}" + ("" if std is None else f" ± {100 * std[n]:.2f}") for n in names]


def write(out: Path, stem: str, table: dict, text: str) -> list[Path]:
    from pace.evaluation import title

    names = [n for n in next(iter(table["rows"].values()))["mean"] if n != "avg"] + ["avg"]
    head = ["method", *(title(n) for n in names[:-1]), "Avg."]
    blocks = [("", table["rows"])] + ([("Ranking ablation (PACE's score)", table["ablation"])] if table["ablation"] else [])
    md = [f"**Table 1.** {text}", ""]
    tex = [r"\begin{table}", r"\centering", r"\caption{" + text.replace("_", r"\_").replace("%", r"\%").replace("θ", r"$\theta$") + "}",
           r"\begin{tabular}{l" + "c" * len(names) + "}", r"\toprule", " & ".join(head).replace("%", r"\%") + r" \\"]
    csv_rows = [["block", *head, "seeds", "selected versions"]]
    for name, rows in blocks:
        if name:
            md += ["", name, ""]
            tex += [r"\midrule", rf"\multicolumn{{{len(head)}}}{{l}}{{\textit{{{name}}}}} \\"]
        md += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        tex.append(r"\midrule")
        for method, row in rows.items():
            cells = _cells(row, names)
            md.append("| " + " | ".join([method, *cells]) + " |")
            tex.append(" & ".join([method, *(c.replace("±", r"$\pm$") for c in cells)]) + r" \\")
            csv_rows.append([name or "Table 1", method, *cells, str(len(row["selected"])),
                             " ".join(f"{s['run']}:{s['version']}" for s in row["selected"])])
    tex += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    import csv
    import io

    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(csv_rows)
    paths = [out / f"{stem}.{ext}" for ext in ("md", "tex", "csv", "json")]
    for path, content in zip(paths, ["\n".join(md) + "\n", "\n".join(tex) + "\n", buf.getvalue(),
                                     json.dumps({**table, "caption": text}, indent=1)]):
        path.write_text(content)
    return paths


def build(entries: list[Entry], out: Path) -> list[Path]:
    """table1.* from the single-turn runs, table1_multiturn.* from the multi-turn ones."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, part in (("table1", [e for e in entries if not e.multiturn]), ("table1_multiturn", [e for e in entries if e.multiturn])):
        if part:
            table = gather(part)
            written += write(out, stem, table, caption(table, part))
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", help="run directories or folders of them (a multirun sweep)")
    ap.add_argument("--project", help="online wandb project (with --group): runs scored already")
    ap.add_argument("--entity")
    ap.add_argument("--group", help="every run of this wandb group")
    ap.add_argument("--k", type=int, help="mean@k to score and gather (default: each run's eval.k)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-score", action="store_true", help="gather only: fail on a run that is not scored yet")
    ap.add_argument("--eval-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for eval.py (e.g. eval.data_dir=../shared/benchmarks); repeatable")
    args = ap.parse_args(argv)
    if not args.specs and not args.group:
        ap.error("give run directories, or --project and --group")
    if args.group and not args.project:
        ap.error("--group needs --project")
    try:
        dirs = []
        for spec in args.specs:
            found = find_run_dirs(spec)
            if not found:
                raise SelectionError(f"{spec}: no run directories (no metrics.jsonl below it)")
            dirs += found
        entries = [local_entry(d, args.k, name) for d, name in zip(dirs, run_names(dirs))]
        if args.group:
            entries += wandb_entries(args.project, args.group, args.entity, args.k)
        if args.no_score:
            missing = [e for e in entries if e.scores is None]
            if missing:
                raise SelectionError(f"{missing[0].source}: θ_{missing[0].selected['version']} not scored at "
                                     f"mean@{missing[0].k} (run without --no-score)")
        else:
            score(entries, args.out, args.k, args.eval_arg)
        written = build(entries, args.out)
    except (SelectionError, FileNotFoundError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    print(f"{len(entries)} runs → {', '.join(str(p) for p in written)}")


if __name__ == "__main__":
    main()
