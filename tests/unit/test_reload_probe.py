"""The reload probe's decision (pace/rollout/reload_probe.py) without an engine: the shift between two
scorings, the tolerance by dtype, the one line naming the engine, stop / warn / off, which runs probe,
and the mixin's requests on a stand-in fleet (one an engine and phase, greedy, apart from the rollout's
ids; an engine reloaded before or lost meanwhile left out). On the real engine:
tests/integration/test_reload_probe_run.py."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from pace.rollout import reload_probe as rp

pytestmark = pytest.mark.unit


def test_the_tolerance_is_the_dtypes_unless_configured():
    assert rp.tolerance("float32", None) == 1e-5
    assert rp.tolerance("bfloat16", None) == rp.tolerance("float16", None) == 1e-2
    assert rp.tolerance("bfloat16", 0.05) == 0.05 and rp.tolerance("float32", 1e-3) == 1e-3


def test_the_shift_is_the_largest_difference_of_one_token():
    assert rp.shift([-1.0, -2.0, -3.0], [-1.0, -2.5, -2.75]) == 0.5
    assert rp.shift([-1.0, -2.0], [-1.0, -2.0]) == 0.0
    assert rp.shift([-math.inf, -1.0], [-math.inf, -1.0]) == 0.0  # equal, though −inf − −inf is NaN
    assert rp.shift([-1.0, -2.0], [-1.0, math.nan]) == math.inf  # not a number: never within a tolerance
    assert rp.shift([-math.inf], [-1.0]) == math.inf
    assert rp.shift([-1.0, -2.0], [-1.0]) == math.inf  # another length: not the same prompt's scores
    assert rp.shift([], []) == 0.0


NAMES = {0: "rollout engine 0 (http://a:1)", 1: "rollout engine 1 (http://b:2)", 2: "rollout engine 2 (http://c:3)"}


def test_within_the_tolerance_nothing_is_said_and_the_largest_shift_is_returned():
    before = {0: [-1.0, -2.0], 1: [-0.5, -0.25]}
    after = {0: [-1.0, -2.0], 1: [-0.5, -0.2578125]}  # 2^-7 apart: within bf16's 1e-2, not float32's 1e-5
    assert rp.judge(before, after, 1e-2, "bfloat16", NAMES) == (0.0078125, None)
    worst, line = rp.judge(before, after, 1e-5, "float32", NAMES)
    assert worst == 0.0078125 and line.startswith("reload probe: rollout engine 1 (http://b:2) computes")


def test_above_the_tolerance_one_line_names_the_worst_engine_the_shift_and_the_key():
    before = {0: [-1.0, -2.0, -3.0], 1: [-1.0, -2.0, -3.0], 2: [-1.0, -2.0, -3.0]}
    after = {0: [-1.0, -2.0, -3.0], 1: [-1.0, -2.03125, -3.0], 2: [-1.0625, -2.0, -3.0]}
    worst, line = rp.judge(before, after, 1e-2, "bfloat16", NAMES)
    assert worst == 0.0625 and "\n" not in line
    assert line.startswith("reload probe: rollout engine 2 (http://c:3) (and 1 more engine) computes other log-probs "
                           "once it is sent the weights it already holds (θ_0, as loaded from disk): "
                           "|Δ log-prob| up to 6.25e-02 over 3 prompt tokens, above 1e-02 (bfloat16);")
    assert line.endswith("rollout.reload_probe=warn goes on with a warning, rollout.reload_probe=off skips the probe")
    # an engine not scored after (lost meanwhile) is not judged; none scored both times: nothing to say
    assert rp.judge(before, {0: [-1.0, -2.0, -3.0]}, 1e-2, "bfloat16", NAMES) == (0.0, None)
    assert rp.judge(before, {}, 1e-2, "bfloat16", NAMES) == (None, None)


def test_which_runs_probe(tmp_path):
    """Servers (θ_0 published anyway), a resume, an MoE model; not a dense fresh run in this host; never off."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    Qwen3Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(dense)
    Qwen3MoeConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                   num_experts=4).save_pretrained(moe)
    cfg = lambda mode: SimpleNamespace(rollout=SimpleNamespace(reload_probe=mode))  # noqa: E731
    assert rp.is_moe(str(moe)) and not rp.is_moe(str(dense))
    for mode in ("stop", "warn"):
        assert not rp.wanted(cfg(mode), "inproc", False, str(dense))
        assert not rp.wanted(cfg(mode), "child", False, str(dense))
        assert rp.wanted(cfg(mode), "server", False, str(dense))
        assert rp.wanted(cfg(mode), "inproc", True, str(dense))
        assert rp.wanted(cfg(mode), "inproc", False, str(moe)) and rp.wanted(cfg(mode), "child", False, str(moe))
    for args in (("server", False, str(dense)), ("inproc", True, str(dense)), ("child", False, str(moe))):
        assert not rp.wanted(cfg("off"), *args)


def test_the_config_keys_are_checked_by_name():
    from pace.config_checks import validate
    from pace.errors import ConfigError
    from tests.helpers import compose_cfg

    assert compose_cfg([]).rollout.reload_probe == "stop"  # on by default
    for ok in (["rollout.reload_probe=warn"], ["rollout.reload_probe=off"], ["rollout.reload_probe_tolerance=0.05"]):
        validate(compose_cfg(ok))
    with pytest.raises(ConfigError, match=r"rollout\.reload_probe='maybe' is not one of stop, warn, off"):
        validate(compose_cfg(["rollout.reload_probe=maybe"]))
    with pytest.raises(ConfigError, match=r"rollout\.reload_probe_tolerance must be > 0"):
        validate(compose_cfg(["rollout.reload_probe_tolerance=0"]))


def test_its_requests_are_not_the_rollouts():
    from pace.rollout import request_ids

    assert request_ids.reload_probe("before", 3) == "reload-probe-before-3"
    with pytest.raises(ValueError):
        request_ids.parse(request_ids.reload_probe("after", 0))


# ---------------------------------------------------------------- the mixin on a stand-in fleet

class _Fleet:
    """Engines answering each scoring request at the next step with ``scores(phase, engine, n)``."""

    def __init__(self, engines: int, scores, reloaded=()):
        self.alive, self.scores, self.reloaded = list(range(engines)), scores, set(reloaded)
        self.sent, self.aborted, self._queue = [], [], []

    def weights_reloaded(self):
        return {i: i in self.reloaded for i in self.alive}

    def add_request(self, rid, prompt, params, priority=0, group=None, engine=None):
        self.sent.append(SimpleNamespace(rid=rid, prompt=prompt, params=params, priority=priority, group=group,
                                         engine=engine))
        self._queue.append((rid, engine, prompt["prompt_token_ids"]))

    def step(self, timeout=0.01):
        out = []
        for rid, engine, ids in self._queue:
            if engine not in self.alive:
                continue  # a failed server answers nothing
            phase = rid.split("-")[2]
            plp = [None] + [{tok: SimpleNamespace(logprob=v)} for tok, v in zip(ids[1:], self.scores(phase, engine, len(ids) - 1))]
            out.append(SimpleNamespace(request_id=rid, engine=engine, finished=True, prompt_logprobs=plp))
        self._queue = [q for q in self._queue if q[1] not in self.alive]
        return out

    def abort_request(self, ids):
        self.aborted += ids


def _tokenizer(text, add_special_tokens=True):
    return SimpleNamespace(input_ids=[ord(c) for c in text])


class _Worker(rp.ReloadProbeMixin):
    """What the mixin reads of a `RolloutWorker`; its update loads at `_apply_update` (shm) and calls
    back as `_updated` does."""

    def __init__(self, fleet, mode="stop", dtype="float32", tolerance=None):
        self.fleet, self.tokenizer, self.ident, self.cpu_threads, self.stale = fleet, _tokenizer, None, 0, None
        self.sampler = SimpleNamespace(prompts=[SimpleNamespace(text="12+34=?\n"), SimpleNamespace(text="5*6=?\n")])
        self.cfg = SimpleNamespace(model=SimpleNamespace(dtype=dtype), rollout=SimpleNamespace(
            reload_probe=mode, reload_probe_tolerance=tolerance, max_model_len=256, engine_timeout_s=5.0))
        self.stats = dict(rp.STATS)
        self.only = None

    def _apply_update(self):
        self.only = self._reload_probe_after()


def _shifted(engine: int, by: float):
    """Scores that move by ``by`` on one token of ``engine`` after the update."""
    def scores(phase, e, n):
        out = [-1.0 - 0.25 * t for t in range(n)]
        if phase == "after" and e == engine:
            out[n // 2] += by
        return out
    return scores


def test_stop_one_request_an_engine_and_phase_then_the_one_line(capsys):
    fleet = _Fleet(2, _shifted(1, 0.03125))
    w = _Worker(fleet)
    w.arm_reload_probe(only=True)
    assert [(r.rid, r.engine) for r in fleet.sent] == [("reload-probe-before-0", 0), ("reload-probe-before-1", 1)]
    ids = [ord(c) for c in "12+34=?\n5*6=?\n"]  # the first prompts, joined (fewer than 64 tokens)
    for r in fleet.sent:
        assert r.prompt["prompt_token_ids"] == ids and r.priority == -1 and r.group is None
        assert r.params.temperature == 0.0 and r.params.max_tokens == 1 and r.params.prompt_logprobs == 0
    found = w.reload_probe_result()  # the posted update loads here; the scores after it are judged
    assert w.only is True and w._reload_probe is None
    assert [r.rid for r in fleet.sent[2:]] == ["reload-probe-after-0", "reload-probe-after-1"]
    assert fleet.sent[0].prompt["cache_salt"] != fleet.sent[2].prompt["cache_salt"]  # no prefix of before's reused
    assert isinstance(found, rp.ReloadShift) and found.why == "an engine's weight reload changes what it computes"
    assert str(found).startswith("reload probe: rollout engine 1 computes other log-probs once it is sent the weights "
                                 "it already holds (θ_0, as loaded from disk): |Δ log-prob| up to 3.12e-02 over 13 "
                                 "prompt tokens, above 1e-05 (float32);")
    assert w.stats["reload_probe_engines"] == 2 and w.stats["reload_probe_shift"] == 0.03125
    assert w.reload_shift is None  # taken once
    assert capsys.readouterr().err == ""


def test_warn_says_it_and_goes_on():
    fleet = _Fleet(1, _shifted(0, 0.5))
    w = _Worker(fleet, mode="warn")
    w.arm_reload_probe(only=False)
    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        assert w.reload_probe_result() is None
    assert err.getvalue().startswith("warning: reload probe: rollout engine 0 computes other log-probs")
    assert err.getvalue().count("\n") == 1 and w.only is False and w.stats["reload_probe_shift"] == 0.5


@pytest.mark.parametrize("dtype, stops", [("float32", True), ("bfloat16", False), ("float16", False)])
def test_a_shift_of_4e_3_stops_float32_only(dtype, stops):
    w = _Worker(_Fleet(1, _shifted(0, 0.00390625)), dtype=dtype)
    w.arm_reload_probe(only=True)
    assert (w.reload_probe_result() is not None) == stops
    w = _Worker(_Fleet(1, _shifted(0, 0.00390625)), dtype=dtype, tolerance=0.005)  # configured: for every dtype
    w.arm_reload_probe(only=True)
    assert w.reload_probe_result() is None


def test_an_engine_reloaded_before_is_named_and_not_probed(capsys):
    fleet = _Fleet(2, _shifted(0, 1.0), reloaded={0})  # engine 0 would move: it holds an earlier run's weights
    w = _Worker(fleet)
    w.arm_reload_probe(only=False)
    err = capsys.readouterr().err
    assert err.startswith("warning: reload probe: rollout engine 0 has loaded weight updates since it started")
    assert [r.engine for r in fleet.sent] == [1]
    assert w.reload_probe_result() is None and w.stats["reload_probe_engines"] == 1


def test_an_engine_lost_meanwhile_is_left_out_and_its_request_aborted():
    fleet = _Fleet(2, _shifted(0, 1.0))
    w = _Worker(fleet)
    w.arm_reload_probe(only=True)
    fleet.alive = [1]  # engine 0 failed after its first score: its failure is the rollout's, not the probe's
    assert w.reload_probe_result() is None
    assert fleet.aborted == ["reload-probe-after-0"] and w.stats["reload_probe_engines"] == 1


def test_an_engine_that_does_not_answer_fails_within_the_engine_timeout():
    from pace.errors import EngineFailed

    fleet = _Fleet(1, _shifted(0, 0.0))
    fleet.step = lambda timeout=0.01: []
    w = _Worker(fleet)
    w.cfg.rollout.engine_timeout_s = 0.2
    with pytest.raises(EngineFailed, match=r"reload probe: rollout engine 0 returned no prompt log-probs within "
                                           r"rollout\.engine_timeout_s=0\.2"):
        w.arm_reload_probe(only=True)
    assert fleet.aborted == ["reload-probe-before-0"]


def test_weights_found_stale_are_named_first_and_a_probe_needs_its_update():
    from pace.weights.fingerprint import StaleEngine

    w = _Worker(_Fleet(1, _shifted(0, 1.0)))
    w.arm_reload_probe(only=True)
    w.stale = StaleEngine("rollout engine worker 0 is labelled θ_0 but received other weights")
    assert w.reload_probe_result() is w.stale  # the probe's shift is then not the reload's

    w = _Worker(_Fleet(1, _shifted(0, 0.0)))
    w.arm_reload_probe(only=True)
    w._apply_update = lambda: None  # nothing was posted
    with pytest.raises(RuntimeError, match="no weight update loaded"):
        w.reload_probe_result()
    w.ident = 123
    with pytest.raises(RuntimeError, match="before the rollout thread starts"):
        w.arm_reload_probe(only=True)
