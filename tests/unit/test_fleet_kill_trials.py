"""scripts/fleet_kill_trials.py's pure pieces: the run's stderr lines it reads and the table it prints
(the trials themselves are run by the script, not by the suite)."""
from __future__ import annotations

import importlib.util

from tests.helpers import ROOT

spec = importlib.util.spec_from_file_location("fleet_kill_trials", ROOT / "scripts" / "fleet_kill_trials.py")
trials = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trials)

URL = "(http://127.0.0.1:40123)"
LINES = [  # as pace/rollout/failover.py, healing.py and pace/validation.py write them
    (5.0, f"warning: rollout engine 0 {URL} failed: /health failed 3 times in a row; going on with 1 engine(s), its 3 requests sent to them"),
    (10.2, f"warning: rollout engine 0 {URL} failed: its process exited with code -9; going on with 1 engine(s), its 2 requests sent to them"),
    (10.5, f"warning: rollout engine 1 {URL} failed: a response stream broke (ClientPayloadError: x); going on with 1 engine(s), its 7 requests sent to them"),
    (11.0, f"warning: rollout engine 1 {URL}: restart budget spent (rollout.max_engine_restarts=1; it failed: x); going on with 1 engine(s)"),
    (40.0, f"rollout engine 1 (http://127.0.0.1:40999) started again (restart 1 of at most 1) at θ_12: it joins at the next weight update"),
    (41.0, "validation of θ_12: avg mean@4 = 0.412 in 3.1 s"),
    (44.0, f"rollout engine 1 (http://127.0.0.1:40999) serves again: caught up with θ_14"),
]


def test_lines_are_parsed_by_event_engine_and_version():
    events = [trials.parse(line) for _, line in LINES]
    assert events == [("failed", 0, None), ("failed", 0, None), ("failed", 1, None), ("budget", 1, None), ("ready", 1, 12),
                      ("validated", None, 12), ("serving", 1, 14)]
    assert trials.parse(f"error: rollout engine 1 {URL} failed during the weight broadcast (RuntimeError): the run stops") \
        == ("failed", 1, None)
    assert trials.parse(f"error: rollout engine 1 {URL} did not answer during the weight broadcast, which raised "
                        "RuntimeError") == ("failed", 1, None)
    both = (f"error: the weight update to θ_22 failed: EngineFailed: rollout engines 0 {URL} and 1 "
            "(http://127.0.0.1:40999) did not answer during the weight broadcast, which raised RuntimeError: x")
    assert trials.parse(both) == ("failed", (0, 1), None)
    assert trials.timings([(12.0, both)], kill_t=10.0, engine=1, sync_every=1)["detect_s"] == 2.0
    assert trials.parse("step 3: loss 0.1") is None


def test_timings_count_from_the_kill_for_the_killed_engine_only():
    # engine 0's failures (before the kill, and after it) are not engine 1's detection; the versions 12 → 14 are 2 updates (1 at sync_every 2)
    assert trials.timings(LINES, kill_t=10.0, engine=1, sync_every=1) == {"detect_s": 0.5, "ready_s": 30.0, "ready_updates": 2.0}
    assert trials.timings(LINES, kill_t=10.0, engine=1, sync_every=2)["ready_updates"] == 1.0
    # nothing after the kill: nothing measured
    assert trials.timings(LINES, kill_t=50.0, engine=1, sync_every=1) == {"detect_s": None, "ready_s": None, "ready_updates": None}


def test_the_table_has_a_row_per_trial_and_dashes_where_nothing_applies():
    rows = [{"trial": 0, "preset": "sync_tiny", "window": "update", "kill_step": 4, "outcome": "stopped", "detect_s": 1.234,
             "ready_s": None, "ready_updates": None, "join_s": float("nan"), "mismatch_after_join": None, "checks": "ok"},
            {"trial": 1, "window": "generation", "kill_step": 3, "outcome": "finished", "detect_s": 0.5, "ready_s": 31.0,
             "ready_updates": 1.0, "join_s": 33.25, "mismatch_after_join": 3.8e-7, "checks": "ok"}]
    lines = trials.table(rows).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == len(trials.COLUMNS) + 1
    assert lines[2] == "| 0 | sync_tiny | update | 4 | stopped | 1.2 | — | — | — | — | ok |"
    assert lines[3] == "| 1 | — | generation | 3 | finished | 0.5 | 31.0 | 1.0 | 33.2 | 3.80e-07 | ok |"
