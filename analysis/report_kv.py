"""The KV study's part of report.md (scripts/kv_study.sh): claim (i)'s numbers in words, the
validation interval claim (e)'s runs used, and the table of KV-cache staleness per method."""
from __future__ import annotations

from analysis.report import _f, _iv


def validated(c: dict) -> str:
    """(e): how often its runs validated (the time to the peak takes one of that many values a run)."""
    every, n = c.get("eval_every") or [], c.get("validations_per_run") or []
    if not every:
        return ""
    return (f" The runs validated every {'/'.join(map(str, every))} steps ({'/'.join(map(str, n))} validations a run, "
            "θ_0 included: the values a run's time to the peak can take).")


def kv_text(c: dict) -> str:
    iv, p, out = c["interval"], c["parts"], []
    for m, d in c["methods"].items():
        k, cost = m.lower(), c["cost"][m]
        e, s = d["error"], d["score"]
        time = (f"seconds per step {_f(cost['seconds_per_step']['recompute'], 2)} vs {_f(cost['seconds_per_step']['keep'], 2)}, "
                f"ratio {_iv(cost['time_ratio'], 3, sign=False)}" if cost["time_ratio"]["n"] else "no seconds-per-step "
                "ratio (no pair of runs measured alone)")
        reprefill = (f"; {_f(cost['reprefill_tokens']['mean'], 0)} tokens re-prefilled per step"
                     if cost["reprefill_tokens"]["n"] else "")
        out.append(f"{m}: stale-context error |ℓ^μ − ℓ_fresh| per post-update token, keep {e['keep']:.3g} vs recompute "
                   f"{e['recompute']:.3g}; recompute − keep {_iv(iv[f'{k}_error'], 4)}: {p[f'{k}_error']} (needs it "
                   f"below 0). {d['score_metric'].capitalize()}, keep {_f(s['keep'])} vs recompute {_f(s['recompute'])}; "
                   f"recompute − keep {_iv(iv[f'{k}_score'])}: {p[f'{k}_score']} (needs it inside ±{c['margin']:.2f}). "
                   f"Cost, beside the verdict: {time}{reprefill}.")
    return " ".join(out)


def kv_table(kv: dict) -> list[str]:
    """Per method: consumed K_gen and K_kv, and what the KV probe and the re-prefills logged."""
    if not kv:
        return []
    cell = lambda x, nd: "–" if x is None else f"{x:.{nd}f}" if nd else f"{x:.3g}"  # noqa: E731
    out = ["## KV-cache staleness", "",
           "K_kv counts, for each response token, the versions since the oldest weights its context's KV was computed "
           "under (its request's last prefill): K_kv ≥ K_gen when the cache is kept across updates, K_kv = K_gen when "
           "it is recomputed. Means over each method's runs; the probe's error is per post-update token.", "",
           "| method | runs | consumed K_gen | consumed K_kv | probed post-update tokens per step | "
           "\\|ℓ^μ − ℓ_fresh\\| per probed token | re-prefilled tokens per step |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, row in kv.items():
        out.append(f"| {label} | {row['runs']} | {cell(row['k_gen'], 2)} | {cell(row['k_kv'], 2)} | "
                   f"{cell(row['kv_tokens_per_step'], 1)} | {cell(row['kv_error'], 0)} | {cell(row['reprefill_tokens_per_step'], 1)} |")
    return out + [""]
