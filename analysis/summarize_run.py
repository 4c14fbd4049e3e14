"""Print what a run did: learning, staleness decomposition, fates, time per phase; check the invariants.

    python analysis/summarize_run.py runs/async_tiny/2026-11-29_16-30-00 [more run dirs ...]

Checks, per run: Lemma 1 (K = K_gen + K_wait, to 1e-9) on every group with a decided step, K_kv ≥ K_gen
on those (runs that log K_kv, the KV staleness: docs/pool-policies.md), the logged K, K_gen, K_wait against their recomputation from each response's per-token version spans
and c(τ) (runs that log them), and the fate accounting (groups submitted = Σ fates = rows logged).
Exit status 1 if one fails.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.runs import load_run, recomputed_kv, recomputed_staleness  # noqa: E402

PHASES = ["time/step", "time/generate", "time/wait_data", "time/train", "time/sync"]


def summarize(run_dir: str, window: int = 20) -> bool:
    run = load_run(run_dir)
    s, g = run.steps, run.groups
    print(f"== {run.dir}  ({run.summary.get('status', 'no summary')}, {len(s)} steps)")
    r = s["train/reward_mean"]
    print(f"reward mean: first {window} steps {r.head(window).mean():+.3f}   last {window} steps {r.tail(window).mean():+.3f}")
    print(f"accuracy:    first {window} steps {s['train/acc_mean'].head(window).mean():.3f}   last {window} steps {s['train/acc_mean'].tail(window).mean():.3f}")
    if "rollout/acc_mean" in s:
        a = s["rollout/acc_mean"]
        print(f"accuracy of all completed groups (incl. filtered): first {window} steps {a.head(window).mean():.3f}   last {window} steps {a.tail(window).mean():.3f}")
    if "tools/used_frac" in s:  # multi-turn tool runs
        for key, what in (("tools/used_frac", "responses calling the tool"),
                          ("tools/used_frac_correct", "correct answers that used the tool"),
                          ("tools/acc_with_tool", "accuracy with the tool"),
                          ("tools/acc_without_tool", "accuracy without it")):
            if key in s:
                print(f"{what}: first {window} steps {s[key].head(window).mean():.3f}   last {window} steps {s[key].tail(window).mean():.3f}")
    times = "  ".join(f"{k.split('/')[1]} {s[k].mean():.3f}" for k in PHASES if k in s)
    print(f"seconds per step (mean): {times}")
    if "sync/bytes" in s:  # rollout.weight_delta: what the weight syncs sent (docs/weight-sync.md)
        synced = s.dropna(subset=["sync/bytes"])
        whole = synced["sync/full"] == 1
        frac = synced.loc[~whole, "sync/changed_frac"] if "sync/changed_frac" in synced else synced.loc[[], "sync/bytes"]
        print(f"weight syncs: {len(synced)} ({int(whole.sum())} whole, {int((~whole).sum())} patches)   MB a sync: whole "
              f"{synced.loc[whole, 'sync/bytes'].mean() / 1e6:.3f}, patches {synced.loc[~whole, 'sync/bytes'].mean() / 1e6:.3f}"
              f"   changed fraction {frac.mean():.4f}   engines paused {s['sync/pause_s'].mean() if 'sync/pause_s' in s else float('nan'):.3f} s a step")
    fleet = fleet_line(s, run.summary)
    if fleet:
        print(fleet)
    ok = True
    if not g.empty:
        consumed = g[g.fate == "consumed"]
        print(
            f"consumed groups: {len(consumed)}  K {consumed.k.mean():.3f} = K_gen {consumed.k_gen.mean():.3f}"
            f" + K_wait {consumed.k_wait.mean():.3f}   with K_gen > 0: {(consumed.k_gen > 0).sum()}"
            f"   spanning >1 version: {(consumed.versions_spanned > 1).sum()}"
        )
        if "k_kv" in g:  # KV staleness (runs logged before it have no column)
            print(f"consumed K_kv {consumed.k_kv.mean():.3f} (K_gen {consumed.k_gen.mean():.3f})"
                  f"   with K_kv > K_gen: {(consumed.k_kv > consumed.k_gen + 1e-9).sum()}")
        decided = g.dropna(subset=["k"])
        err = (decided.k - decided.k_gen - decided.k_wait).abs().max() if len(decided) else 0.0
        lemma = err <= 1e-9
        print(f"Lemma 1 on {len(decided)} groups: max |K - K_gen - K_wait| = {err:.2e}  {'ok' if lemma else 'FAILED'}")
        ok &= bool(lemma)
        if "k_kv" in decided:  # a token's context is never newer than the token: w_t ≤ v_t
            kv = decided.dropna(subset=["k_kv"])
            bad = int((kv.k_kv < kv.k_gen - 1e-9).sum())
            print(f"K_kv >= K_gen on {len(kv)} groups: {bad} violate it  {'ok' if not bad else 'FAILED'}")
            ok &= not bad
        if "version_spans" in decided and len(decided):  # the logged values against the per-token records
            logged = decided[["k", "k_gen", "k_wait"]].to_numpy()
            redo = [recomputed_staleness(row) for _, row in decided.iterrows()]
            err = float(abs(logged - redo).max())
            agree = err <= 1e-9
            print(f"K, K_gen, K_wait recomputed from per-token version spans: max error {err:.2e}  "
                  f"{'ok' if agree else 'FAILED'}")
            ok &= agree
            kv = [(row.k_kv, recomputed_kv(row)) for _, row in decided.iterrows() if "k_kv" in row and row.k_kv == row.k_kv]
            kv = [(a, b) for a, b in kv if b is not None]
            if kv:  # runs logged before the request starts have none
                err = max(abs(a - b) for a, b in kv)
                print(f"K_kv recomputed from the version spans and request starts: max error {err:.2e}  "
                      f"{'ok' if err <= 1e-9 else 'FAILED'}")
                ok &= err <= 1e-9
    fates = run.summary.get("fates")
    if fates:
        total = sum(v for k, v in fates.items() if k != "submitted")
        # a run stopped into a checkpoint has no rows for its pooled groups and those in flight (kept
        # for in-flight resume): the resumed run logs them
        stopped = run.summary.get("status") != "finished" and run.summary.get("checkpoint")
        held = fates.get("pooled", 0) + fates.get("inflight", 0) if stopped else 0
        acct = total == fates["submitted"] == len(g) + held
        note = f" + {held} pooled or in flight in the checkpoint" if held else ""
        resumed = run.summary.get("rollout", {}).get("resumed_groups", 0)
        if resumed and "resumed_tokens" in g:  # groups in flight at a checkpoint, continued after a restart
            cont = g[g.resumed_tokens.map(lambda r: r is not None and any(x > 0 for x in r))]
            tokens = int(cont.resumed_tokens.map(sum).sum())
            print(f"resumed: {resumed} groups in flight at a checkpoint continued after a restart; {len(cont)} of them "
                  f"logged with {tokens} kept tokens (the rest still in flight, or complete when kept)")
        print(f"fates: {fates}  sum {total} == submitted {fates['submitted']} == rows {len(g)}{note}: {'ok' if acct else 'FAILED'}")
        ok &= acct
    return ok


def fleet_line(s, summary: dict) -> str | None:
    """The rollout fleet over the run (runs that log `rollout/engines_alive`): engines failed, restarted
    and joined, the fewest and most serving, how long a join took (from a server's failure, or its
    registration, to serving again), the tokens lost to failovers, and each engine's largest on-policy
    mismatch (`mismatch/abs_logp_diff/engine<i>`: at the float floor from its first request when the
    engine rejoined with the trainer's weights)."""
    if "rollout/engines_alive" not in s:
        return None
    rollout = summary.get("rollout", {})
    alive = s["rollout/engines_alive"].dropna()
    restarts = s["rollout/engine_restarts"].dropna() if "rollout/engine_restarts" in s else alive.iloc[:0]
    joins = s["rollout/engine_join_s"].dropna() if "rollout/engine_join_s" in s else alive.iloc[:0]
    line = (f"fleet: {rollout.get('engine_failures', 0)} engine failures, "
            f"{int(restarts.iloc[-1]) if len(restarts) else 0} restarts, {len(joins)} joins")
    if len(joins):
        line += f" (median {joins.median():.1f} s, max {joins.max():.1f} s)"
    line += (f"   engines alive {int(alive.min())}-{int(alive.max())}"
             f"   failover lost tokens {rollout.get('failover_lost_tokens', 0)}")
    engines = sorted((k for k in s if k.startswith("mismatch/abs_logp_diff/engine")),
                     key=lambda k: int(k.rsplit("engine", 1)[1]))
    if engines:
        line += "   on-policy mismatch max " + ", ".join(f"{k.rsplit('/', 1)[1]} {s[k].max():.1e}" for k in engines)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--window", type=int, default=20)
    args = ap.parse_args()
    try:
        ok = all([summarize(r, args.window) for r in args.runs])
    except FileNotFoundError as exc:
        sys.exit(f"error: {exc}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
