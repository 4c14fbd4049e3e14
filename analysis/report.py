"""report.md: the figures, the in-training validation and the claims in words, for a reader who has not read the code."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

CAPTIONS = {
    "validation": ("Validation accuracy (Figure 1)",
                   "Average mean@k over the validation sets against the training step whose weights were "
                   "validated (left) and against the training wall time at which those weights existed "
                   "(right), Sync, Async and PACE. Lines are means over seeds; shading spans the seeds."),
    "stalek": ("Stale-k sweep, early training (Figure 3)",
               "Accuracy of every completed rollout group (before dynamic-sampling filtering), 10-step running "
               "mean (left), and validation on the first of `eval.figure_sets` (right), over the first half of "
               "training. Stale-k discards a group at consumption when its staleness exceeds k; Sync is the "
               "on-policy reference."),
    "benchmarks": ("Validation on the named benchmarks (Figure 5)",
                   "Validation mean@k of every method on each of `eval.figure_sets` (the paper: AIME 2024 and "
                   "BeyondAIME) over the first 300 training steps (a shorter run: all of it)."),
    "pace_staleness": ("What PACE keeps and what it rejects (Figure 6)",
                       "Waiting, Generation and Effective Staleness of the groups PACE trained on (retained) and "
                       "of the groups it rejected, at the step their fate was decided, over a window of "
                       "training updates (the figure's title names the steps)."),
    "consumed_staleness": ("Staleness of the data each method trained on (Figure 7)",
                           "Waiting, Generation and Effective Staleness of consumed groups, PACE and Async. Async's "
                           "Effective Staleness exists only in runs that recorded it (`pool.record_effective=0.125`: that "
                           "share of the groups; 1: all); the panel says when it was not recorded. A fourth panel, the KV "
                           "Staleness K_kv (the oldest weights in a token's context), when the runs logged it."),
    "pool_over_time": ("The pool over time",
                       "Groups waiting in the pool at each training step (left, log scale; dashed: PACE's "
                       "target occupancy n*), and the groups PACE rejects per step to hold the pool near it (right). "
                       "Lines are means over seeds; shading spans the seeds."),
    "walltime": ("Where the time goes (Figure 8)",
                 "Seconds per training step. Solid: the step's critical path (waiting for a batch, training, "
                 "weight sync, the rest). Hatched, beside it: work that overlaps the step: generation on the "
                 "rollout engine, and PACE's prefix rescoring."),
    "large_model": ("The large model (Figure 9)",
                    "Validation on the first of `eval.figure_sets` and seconds per training step of the runs of the "
                    "paper's 30B model (here: the runs' one model, named in the title)."),
    "appendix_b": ("Complete validation trajectories (Appendix B)",
                   "Validation mean@k of every method on every validation set and their average."),
    "appendix_c1": ("Score variants and γ (Appendix C.1)",
                    "Validation average and training reward (10-step mean) of Async, PACE (raw) and PACE (top), "
                    "and of PACE at each γ (bottom), for the paper's 4B model (here: the runs' one model)."),
}

CLAIMS = {
    "a_stale_k": "(a) A larger Stale-k lag slows early optimisation",
    "b_backlog": "(b) Without filtering, a backlog forms and the Waiting Staleness of consumed data grows",
    "c_pace_vs_async": "(c) PACE lowers Waiting Staleness and learns at least as well as Async per step, at close to Async's wall time",
    "d_long_rejections": "(d) Effective ranking rejects fewer long responses than Raw ranking",
    "e_time_to_peak": "(e) PACE reaches its peak validation accuracy earlier in wall time than Sync and Async (Figure 1)",
    "f_rejected_staler": "(f) The groups PACE rejects are staler than those it keeps, in Waiting, Generation and "
                         "Effective Staleness (Figure 6)",
    "g_score_ablation": "(g) Ranking by Effective Staleness learns at least as well as by Raw, and Raw at least as well "
                        "as by Generation Staleness (the score ablation)",
    "h_gamma": "(h) γ = 1, 2 and 4 give similar validation and training-reward trajectories",
    "i_kv_recompute": "(i) Keeping the KV cache across a weight update (the default) learns as well as recomputing it, "
                      "for Async and for PACE; recomputing removes the stale-context error of the tokens generated "
                      "after an update",
}


DEFINITIONS = """\
Staleness of a group consumed at training step j is K = j − c̄, where c̄ is the mean policy version
at which its responses were completed. It splits exactly into Generation Staleness K_gen (how many
versions its tokens span while they were generated) and Waiting Staleness K_wait (steps it then
waited in the pool). PACE rejects, when the pool holds more than its target, the groups with the
highest Effective Staleness S_eff = K_wait + u^γ K_gen, where u is the percentile of the group's
Prefix Forgetting Score: how far the current policy has moved on the group's first tokens."""


def _setup_text(s: dict) -> str:
    model = "the embedded tiny model (2 layers, width 128, Qwen3 architecture, SFT warm start)" \
        if s.get("model") is None else f"`{s['model']}`"
    data = "generated multi-term arithmetic of four difficulty levels" if s.get("data") == "arithmetic" else "`" + str(s.get("data")) + "`"
    val = (f" Validation: mean@{s['eval_k']} on {', '.join(map(str, s.get('eval_sets') or []))}"
           + (f" (first {s['eval_problems']} problems of each set)" if s.get("eval_problems") else "")
           + f" every {s['eval_every']} steps, on the rollout engine." if s.get("eval_every") else "")
    varies = f" Settings that differ between runs: {', '.join(s['varies'])}." if s.get("varies") else ""
    if s.get("kv_probe"):
        varies += (f" KV probe: {s['kv_probe']:g} of the responses an update landed in while they generated are "
                   "rescored on the engine right after they finish (`rollout.kv_probe`).")
    return (f"Fully asynchronous DAPO on {model}, trained on {data}: a vLLM engine generates in a thread "
            f"while the trainer updates the policy; B = {s.get('B')} prompts × G = {s.get('G')} responses per step, "
            f"responses up to {s.get('max_tokens')} tokens, learning rate {s.get('lr')}, up to {s.get('steps')} steps per run."
            + val + varies)


def _verdict(c: dict) -> str:
    if not c.get("tested"):
        return f"**not tested** ({c.get('why', 'runs missing')})"
    ivs = [c["interval"]] if "n" in c["interval"] else list(c["interval"].values())
    one = min(iv["n"] for iv in ivs) < 2
    why = "one seed: no interval to decide on" if one else "the interval over seeds straddles the boundary"
    return {"holds": "**holds**", "does not hold": "**does not hold** at this scale",
            "inconclusive": f"**inconclusive** ({why})"}[c["verdict"]]


def _f(x, nd=3) -> str:
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _iv(iv: dict, nd: int = 3, sign: bool = True) -> str:
    """mean [lo, hi] (95% interval over n seeds)."""
    fmt = (lambda x: f"{x:+.{nd}f}") if sign else (lambda x: f"{x:.{nd}f}")
    if iv["n"] < 2:
        return f"{fmt(iv['mean'])} (one seed: no interval)"
    return f"{fmt(iv['mean'])} [{fmt(iv['lo'])}, {fmt(iv['hi'])}] ({iv['level']:.0%} t-interval, {iv['n']} seeds)"


def seeds_to_decide(iv: dict, bound: float, most: int = 200) -> int | None:
    """Seeds an interval like this one (same mean and spread) would need to exclude ``bound``: the
    smallest n with t(q, n−1)·sd/√n < |mean − bound|, q from the interval's level (None: no spread
    measured, or over ``most``)."""
    from scipy import stats

    xs = iv.get("values", [])
    if len(xs) < 2:
        return None
    sd, gap = float(np.std(xs, ddof=1)), abs(iv["mean"] - bound)
    if sd == 0 or gap == 0:
        return None
    q = 0.5 + iv["level"] / 2
    return next((n for n in range(2, most + 1) if stats.t.ppf(q, n - 1) * sd / math.sqrt(n) < gap), None)


def _parts(key: str, c: dict) -> list[tuple[str, dict, float, str]]:
    """(name, interval, boundary, verdict) of each part of a claim, for the seeds an undecided one would need."""
    from analysis.claims import above, below

    iv = c["interval"]
    if key in ("a_stale_k", "d_long_rejections"):
        return [("", iv, 0.0, below(iv, 0.0))]
    if key == "b_backlog":
        return [(k, iv[k], 0.0, above(iv[k], 0.0)) for k in ("occupancy", "k_wait")]
    if key == "c_pace_vs_async":
        p = c["parts"]
        return [("k_wait", iv["k_wait"], 0.0, p["lower_k_wait"]), ("score", iv["score"], -c["margin"], p["learns_as_well"]),
                ("time_ratio", iv["time_ratio"], 1 + c["time_slack"], p["close_wall_time"])]
    if key == "e_time_to_peak":
        return [(f"vs {k}", iv[k], 0.0, c["parts"][f"earlier_than_{k.lower()}"]) for k in ("Sync", "Async")]
    if key == "f_rejected_staler":
        return [(k, iv[k], 0.5, c["parts"][k]) for k in iv]
    if key == "g_score_ablation":
        return [(k.replace("_", " "), iv[k], -c["margin"], c["parts"][k]) for k in iv]
    if key == "h_gamma":  # the nearer edge of the margin: inside it (or wholly past it) is what decides
        margin = lambda k: c["margins"]["score" if k.endswith("score") else "reward"]  # noqa: E731
        return [(k.replace("_", " "), iv[k], margin(k) if iv[k]["mean"] >= 0 else -margin(k), c["parts"][k]) for k in iv]
    if key == "i_kv_recompute":  # the error below 0; the score inside ±margin (its nearer edge, as for (h))
        edge = lambda k: 0.0 if k.endswith("error") else c["margin"] if iv[k]["mean"] >= 0 else -c["margin"]  # noqa: E731
        return [(k.replace("_", " "), iv[k], edge(k), c["parts"][k]) for k in iv]
    return []


def _needs(key: str, c: dict) -> str:
    """For an inconclusive claim: how many seeds the observed spread would take to decide each part."""
    if not c.get("tested") or c["verdict"] != "inconclusive":
        return ""
    from analysis.claims import OPEN

    out = []
    for name, iv, bound, verdict in _parts(key, c):
        if iv["n"] < 2 or verdict != OPEN:
            continue  # one seed (no spread to extrapolate from), or decided
        n = seeds_to_decide(iv, bound)
        label = f"{name}: " if name else ""
        out.append(f"{label}{'about ' + str(n) if n else 'more than 200 (or no spread measured)'} seeds")
    if not out:
        return ""
    return " At the spread observed, an interval would exclude the boundary with " + "; ".join(out) + "."


# What would test a claim this study leaves undecided or sees fail: text, not a rule (written while
# seed 2 was running, before the verdicts of seeds 0-2 were computed; which lines appear depends on them).
NEXT = {
    "a_stale_k": "at this scale a lag of up to 8 versions moves the tiny policy little within 50 steps; a setting in which "
                 "8 versions are a large move (a larger learning rate or model, longer runs: a GPU) would test it",
    "b_backlog": "more seeds, or longer runs in which the backlog reaches pool.capacity",
    "c_pace_vs_async": "for its learning part, more seeds or longer runs (a difference in validation smaller than the "
                       "seed spread at 100 steps cannot be told apart); for its wall-time part, every run with nothing "
                       "else on the machine",
    "d_long_rejections": "a task whose long responses are the ones whose prefixes drift least (the paper's long "
                         "reasoning traces), i.e. a larger model on math with long responses: a GPU",
    # (e)–(h): written with their rules, before any run was made or read for them
    "e_time_to_peak": "validations more often (the time to the peak takes one of as many values per run as the run "
                      "validates), more seeds, and every run made with nothing else on the machine",
    "f_rejected_staler": "more PACE runs that reject (a run that rejected nothing leaves its seed out)",
    "g_score_ablation": "more seeds or longer runs: differences in learning smaller than the seed spread at 100 steps "
                        "cannot be told apart",
    "h_gamma": "more seeds (an equivalence holds only once the whole interval fits inside the margin)",
    # (i): written with its rule, before any run of the KV study
    "i_kv_recompute": "for the learning part, more seeds (an equivalence holds only once the whole interval fits inside "
                      "the margin) or a setting where an update moves the policy further (a larger learning rate or "
                      "model: a GPU); for the error part, runs in which the probe sees post-update tokens in every seed",
}


def _summary(claims: dict) -> list[str]:
    """What held, what did not, what stays open, and what would test the rest."""
    names = {k: v.split(" ", 1)[0] for k, v in CLAIMS.items()}
    by = {v: [names[k] for k, c in claims.items() if c.get("tested") and c["verdict"] == v]
          for v in ("holds", "does not hold", "inconclusive")}
    out = ["## What held", "",
           f"Held: {', '.join(by['holds']) or 'none'}. Did not hold at this scale: {', '.join(by['does not hold']) or 'none'}. "
           f"Inconclusive: {', '.join(by['inconclusive']) or 'none'}.", ""]
    for key, c in claims.items():
        if c.get("tested") and c["verdict"] != "holds":
            out += [f"- {names[key]} — to decide it: {NEXT[key]}.", ""]
    return out


def _claim_text(key: str, c: dict) -> str:
    from analysis.report_kv import kv_text, validated

    if not c.get("tested"):
        return ""
    iv = c["interval"]
    if key == "a_stale_k":
        parts = ", ".join(f"{k}: {_f(v)}" for k, v in c["early_rollout_acc"].items())
        return (f"Mean rollout accuracy over the first half of training, by lag (mean over seeds): {parts} "
                f"({'monotone' if c['monotone'] else 'not monotone'} in the lag). Slope per doubling of k, "
                f"per seed: {_iv(iv, 4)}; the claim needs it below 0."
                + ("" if c["monotone"] else " The means are not ordered lag by lag: the slope is a trend over the lags "
                   "run, so a verdict on it speaks of the trend, not of every pair of neighbouring lags."))
    if key == "b_backlog":
        return (f"Async ({c['seeds']} seed(s)): pool occupancy {_f(c['occupancy_first_tenth'], 1)} groups in the "
                f"first tenth of training → {_f(c['occupancy_last_tenth'], 1)} in the last (change "
                f"{_iv(iv['occupancy'], 1)}); consumed K_wait {_f(c['k_wait_first_tenth'], 2)} → "
                f"{_f(c['k_wait_last_tenth'], 2)} steps (change {_iv(iv['k_wait'], 2)}); the claim needs both above 0.")
    if key == "c_pace_vs_async":
        s, p = c["scores"], c["parts"]
        return (f"Consumed K_wait: PACE {_f(c['k_wait_mean']['PACE'], 2)} vs Async {_f(c['k_wait_mean']['Async'], 2)}; "
                f"PACE − Async {_iv(iv['k_wait'], 2)}: {p['lower_k_wait']}. {c['score_metric'].capitalize()}: PACE "
                f"{', '.join(_f(x) for x in s['PACE'])} vs Async {', '.join(_f(x) for x in s['Async'])}; PACE − Async "
                f"{_iv(iv['score'])}, against a margin of −{c['margin']:.2f}: {p['learns_as_well']}. Seconds per step: PACE "
                f"{_f(c['seconds_per_step']['PACE'], 2)} vs Async {_f(c['seconds_per_step']['Async'], 2)}; ratio "
                f"{_iv(iv['time_ratio'], 3, sign=False)}, against {1 + c['time_slack']:.2f}: {p['close_wall_time']}.")
    if key == "d_long_rejections":
        e, r = c["PACE"], c["PACE (raw)"]
        return (f"Share of rejected groups longer than the run's median: effective {_f(e['share_long'])} "
                f"({e['rejected']} rejected, mean length {_f(e['rejected_len_mean'], 1)} tokens) vs raw "
                f"{_f(r['share_long'])} ({r['rejected']} rejected, mean length {_f(r['rejected_len_mean'], 1)}); "
                f"effective − raw {_iv(iv)}; the claim needs it below 0.")
    if key == "e_time_to_peak":
        t, pk, p = c["time_to_peak_s"], c["peak"], c["parts"]
        left = f" Left out (wall time not measured alone): {', '.join(c['left_out'])}." if c["left_out"] else ""
        return (f"Training wall time to the peak validation average (mean over seeds): PACE {_f(t['PACE'], 0)} s "
                f"(peak {_f(pk['PACE'])}), Sync {_f(t['Sync'], 0)} s ({_f(pk['Sync'])}), Async {_f(t['Async'], 0)} s "
                f"({_f(pk['Async'])}). PACE − Sync {_iv(iv['Sync'], 0)}: {p['earlier_than_sync']}; PACE − Async "
                f"{_iv(iv['Async'], 0)}: {p['earlier_than_async']}; the claim needs both below 0.{left}"
                + validated(c))
    if key == "i_kv_recompute":
        return kv_text(c)
    if key == "f_rejected_staler":
        from analysis.claims import STALENESS_COLUMNS

        parts = "; ".join(f"{STALENESS_COLUMNS[k]} {_iv(iv[k], 3, sign=False)}: {c['parts'][k]}" for k in iv)
        return (f"Probability that a rejected group is staler than a retained (consumed) one, ties counted half, per "
                f"PACE run: {parts}; the claim needs each above 0.5.")
    if key == "g_score_ablation":
        sc, p = c["scores"], c["parts"]
        return (f"{c['score_metric'].capitalize()}: effective {_f(sc['PACE'])}, raw {_f(sc['PACE (raw)'])}, generation "
                f"{_f(sc['PACE (gen)'])}. Effective − raw {_iv(iv['effective_vs_raw'])}: {p['effective_vs_raw']}; "
                f"raw − generation {_iv(iv['raw_vs_generation'])}: {p['raw_vs_generation']}; against a margin of "
                f"−{c['margin']:.2f}.")
    if key == "h_gamma":
        m, p, mg = c["means"], c["parts"], c["margins"]
        what = {"score": "validation", "reward": "training reward"}
        parts = "; ".join(f"{what[q]}, γ={g} − γ=1 {_iv(iv[f'gamma{g}_{q}'])}: {p[f'gamma{g}_{q}']}"
                          for q in ("score", "reward") for g in (2, 4))
        return (f"{c['score_metric'].capitalize()} by γ (1, 2, 4): {', '.join(_f(m['score'][g]) for g in (1, 2, 4))}; mean "
                f"training reward: {', '.join(_f(m['reward'][g]) for g in (1, 2, 4))}. Against γ = 1: {parts}. Equivalent when every "
                f"interval lies inside ±{mg['score']:.2f} (score) and ±{mg['reward']:.2f} (reward).")
    return ""


def _gist(c: dict) -> str:
    """A verdict and the mean(s) of the interval(s) it was decided on."""
    iv = c.get("interval")
    if not iv:
        return c["verdict"]
    def seeds(n: int) -> str:
        return "1 seed" if n == 1 else f"{n} seeds"

    if "n" in iv:
        return f"{c['verdict']} ({iv['mean']:+.3g}, {seeds(iv['n'])})"
    return (f"{c['verdict']} (" + "; ".join(f"{k} {v['mean']:+.3g}" for k, v in iv.items())
            + f", {seeds(min(v['n'] for v in iv.values()))})")


def _moved(numbers: dict) -> list[str]:
    """The previous report's verdicts beside these (the claims both decided; new ones as new)."""
    prev = numbers.get("previous")
    if not prev:
        return []
    out = ["## How the verdicts moved", "",
           f"Against the previous report ({prev['file']}: {prev['runs']} runs, seeds "
           f"{', '.join(map(str, prev['seeds']))}). Each verdict with the mean of the interval it was decided on.", "",
           "| claim | before | now |", "| --- | --- | --- |"]
    for key, name in CLAIMS.items():
        c = numbers["claims"].get(key, {})
        now = _gist(c) if c.get("tested") else "not tested"
        before = _gist(prev["claims"][key]) if key in prev["claims"] else "(not a claim then)"
        out.append(f"| {name.split(' ', 1)[0]} | {before} | {now} |")
    return out + [""]


def _seed_table(runs: list[dict], best: dict) -> list[str]:
    """Per method, the validation average over seeds with its 95% t-interval: best (the selection),
    final, and the mean over the validated versions after θ_0 (claim (c)'s learning score)."""
    from analysis.claims import interval

    by = {}
    for r in runs:
        if r.get("validation_avg"):
            by.setdefault(r["label"], []).append(r)
    if not by:
        return []
    pct = lambda iv: f"{100 * iv['mean']:.1f}" + ("" if iv["n"] < 2 else f" [{100 * iv['lo']:.1f}, {100 * iv['hi']:.1f}]")  # noqa: E731
    out = ["Validation average (%) over seeds, mean [95% t-interval]:", "",
           "| method | seeds | best (selects Table 1's checkpoint) | final | mean after θ_0 |", "| --- | --- | --- | --- | --- |"]
    for label, rs in by.items():
        final = interval([r["validation_avg"][-1] for r in rs])
        after = interval([r["learning_score"] for r in rs])
        b = best.get(label)
        out.append(f"| {label} | {len(rs)} | {pct(b) if b else '–'} | {pct(final)} | {pct(after)} |")
    return out + [""]


def write_report(out: Path, numbers: dict, title: str = "") -> Path:
    from analysis.report_kv import kv_table

    runs = numbers["runs"]
    lines = [f"# {title or 'PACE reproduction report'}", "", _setup_text(numbers["setup"]), ""]
    setup = out / "setup.md"  # optional, written by the study script: machine, commit, command, time
    if setup.exists():
        lines += [setup.read_text().strip(), ""]
    lines += [DEFINITIONS, ""]
    lines += ["## Runs", "", "| method | seeds | steps | training wall time (min, all seeds) | validations per run |",
              "| --- | --- | --- | --- | --- |"]
    by = {}
    for r in runs:
        by.setdefault(r["label"], []).append(r)
    for label, rs in by.items():
        steps = sorted({r["steps"] for r in rs})
        vals = sorted({r["validations"] for r in rs})
        lines.append(f"| {label} | {', '.join(str(r['seed']) for r in rs)} | {'/'.join(map(str, steps))} | "
                     f"{sum(r['train_seconds'] for r in rs) / 60:.1f} | {'/'.join(map(str, vals))} |")
    noise = numbers.get("val_noise")
    if noise:
        lines += ["", "Validation noise: θ_0 is the same model in every run, and its validation average over "
                  f"{noise['runs']} seeds "
                  f"ranged {noise['min']:.3f}–{noise['max']:.3f} (standard deviation {noise['std']:.3f}) from sampling alone; "
                  "differences between single validations smaller than that are not evidence."]
    lines += ["", "## Claims", "",
              "Each rule was fixed before the runs (analysis/claims.py, whose docstring states it); the numbers below come "
              "from the run logs. A verdict is decided on a 95% Student-t interval over seeds (runs paired by seed): "
              "holds when the interval lies on the claimed side, does not hold when it lies on the other, "
              "inconclusive when it straddles the boundary.", ""]
    absent = []
    for key, name in CLAIMS.items():
        c = numbers["claims"].get(key, {"tested": False, "why": "not decided by this analysis"})
        if not c.get("tested"):
            absent.append(f"{name.split(' ', 1)[0]} {c.get('why', 'runs missing')}")
            continue
        lines += [f"- {name}: {_verdict(c)}. {_claim_text(key, c)}{_needs(key, c)}".rstrip(), ""]
    if absent:
        lines += [f"- Not tested here: {'; '.join(absent)}.", ""]
    lines += _summary(numbers["claims"])
    lines += kv_table(numbers.get("kv") or {})
    lines += _moved(numbers)
    for name in numbers["figures"]:
        head, caption = CAPTIONS[name]
        lines += [f"## {head}", "", f"![{head}]({name}.png)", "", caption, ""]
    if numbers["skipped"]:
        lines += [f"Not drawn (nothing in these runs to draw them from): {', '.join(numbers['skipped'])}.", ""]
    table = out / "val_best.md"
    if table.exists():
        m = numbers["val_best"]
        within = f"within {m['within']} updates" if m["within"] is not None else "over the whole run"
        lines += [f"## In-training validation mean@{m['k']}: best per run", "",
                  f"Per method, each run's best in-training validation average {within}, mean over seeds: the "
                  "versions Table 1 scores, not Table 1 (eval.py's mean@k of them: `python -m analysis.table1`).", "",
                  table.read_text().strip(), ""]
        lines += _seed_table(runs, m.get("avg_interval", {}))
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
