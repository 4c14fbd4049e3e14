"""Multi-turn tool rollouts on the real vLLM CPU engine with the tiny tool model and the real
sandbox: the worker stops at </code>, runs the program, appends the interpreter tokens as masked
context and continues; versions, log-probs and masks line up, the loss mask and the staleness
averages leave tool tokens out, and an update landing between turns is recorded."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llm(tiny_tool_model_path):
    from pace.config import RolloutConfig
    from pace.rollout import engine as engine_lib

    llm = engine_lib.build_engine(tiny_tool_model_path, RolloutConfig(max_model_len=224), "float32", seed=0)
    yield llm
    engine_lib.shutdown(llm)


def _worker(llm, levels, groups=4, max_tool_calls=2):
    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.pool import Pool, build_policy
    from pace.grading import Grader
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.base import PromptSampler
    from pace.tasks.tool_arithmetic import ToolArithmeticSpec, make_prompts

    cfg = OmegaConf.structured(Config)
    cfg.data.batch_prompts, cfg.data.group_size, cfg.rollout.max_inflight_groups = groups, 8, groups
    cfg.rollout.max_tokens, cfg.rollout.max_model_len, cfg.rollout.max_tool_calls = 160, 224, max_tool_calls
    cfg.tools.output_chars = 64
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ToolArithmeticSpec(levels=levels), "train"), seed=0)
    grader = Grader(workers=1)
    return RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), sampler, pool, grader=grader, cfg=cfg), grader


def _drive(worker, llm, on_step=None):
    """Step the worker by hand until every group is graded; ``on_step(i)`` after each engine step."""
    import time

    i = 0
    while worker._pending or worker._grading:
        if llm.llm_engine.has_unfinished_requests():
            worker._consume(worker.fleet.step())
            i += 1
            if on_step is not None:
                on_step(i)
        else:
            time.sleep(0.01)
        worker._collect_tools()
        worker._collect_grades()
    return worker.pool.drain_arrived()


def _spans(mask):
    """(start, end) of each run of False in ``mask``."""
    out, start = [], None
    for t, a in enumerate([*mask, True]):
        if not a and start is None:
            start = t
        elif a and start is not None:
            out.append((start, t))
            start = None
    return out


def test_tool_turns_are_masked_context_with_versions_and_logprobs(llm):
    import torch

    from pace.algo.microbatch import collate
    from pace.reward import extract_answer
    from pace.rollout import request_ids
    from pace.staleness import group_staleness
    from pace.tools.protocol import CODE_STOP, OUTPUT_END, OUTPUT_START

    worker, grader = _worker(llm, levels=[2, 4])
    tok = llm.get_tokenizer()
    worker._admit()
    update_at = 12  # an update between engine steps: lands within turns of some responses, between turns of others
    weights = [(n, p.clone()) for n, p in _model_weights(llm)]

    def on_step(i):
        if i == update_at:
            worker.set_trainer_version(1)
            worker.post_weights(1, weights)
            assert worker._apply_update()

    groups = _drive(worker, llm, on_step)
    worker.tools.close()
    grader.close()
    assert len(groups) == 4
    trajs = [t for g in groups for t in g.trajectories]
    used = [t for t in trajs if t.tool_calls]
    assert len(used) >= 4, f"only {len(used)} of {len(trajs)} responses called the tool"
    for t in trajs:
        assert len(t.versions) == len(t.logprobs) == len(t.response_ids)
        assert t.completed_at == 1
        if not t.tool_calls:
            assert t.action_mask is None
            continue
        spans = _spans(t.action_mask)
        assert len(spans) == t.tool_calls <= 2
        for start, end in spans:
            assert tok.decode(t.response_ids[:start]).endswith(CODE_STOP)  # the turn stopped at </code>
            text = tok.decode(t.response_ids[start:end])
            assert text.startswith(OUTPUT_START) and (text.endswith(OUTPUT_END) or end == len(t))
            assert all(lp == 0.0 for lp in t.logprobs[start:end])  # no behaviour log-prob
        acts = [lp for lp, a in zip(t.logprobs, t.action_mask) if a]
        assert all(lp <= 0.0 for lp in acts) and any(lp < 0.0 for lp in acts)
        assert t.action_versions.tolist() == sorted(t.action_versions.tolist())
        assert t.num_actions == sum(t.action_mask) < len(t)
    # graded on the model's own final answer, not on the interpreter output (which may hold the number)
    for g in groups:
        for t in g.trajectories:
            assert t.correct == (extract_answer(tok.decode(t.action_ids, skip_special_tokens=True)) == g.answer)
    # updates within and between turns are both on record
    assert any(t.versions[0] == 0 and t.action_versions[-1] == 1 for t in used)

    # PACE's prefix rescoring compares model tokens only: θ_1 holds θ_0's values, so rescoring whole
    # responses (tool output inside) gives a PFS of ~0; the tool tokens' placeholder 0.0 against
    # their real log-probs would not
    worker.prefix_tokens = 160
    worker._rescore(groups)
    while worker._rescoring:
        for out in llm.llm_engine.step():
            if request_ids.kind(out.request_id) == request_ids.SCORING and out.finished:
                worker._consume_score(out)
    for g in groups:
        assert g.pfs is not None and g.pfs < 1e-3 and g.pfs_version == 1

    # the loss mask is the action mask (prompt tokens and tool output excluded)
    g = max(groups, key=lambda g: sum(t.tool_calls for t in g.trajectories))
    batch = collate(g.trajectories, [g.prompt_ids] * len(g.trajectories))
    p, width = len(g.prompt_ids), batch["input_ids"].shape[1]
    offset = 0
    for row, t in enumerate(g.trajectories):
        n = len(t)
        # response token k is scored at position p − 1 + k of its row (flat index row·L + p − 1 + k)
        assert batch["index"][offset : offset + n].tolist() == [row * width + p - 1 + k for k in range(n)]
        mask = batch["loss_mask"][offset : offset + n].bool().tolist()
        assert mask == (t.action_mask.tolist() if t.action_mask is not None else [True] * n)
        assert batch["logp_behavior"][offset : offset + n].tolist() == pytest.approx(t.logprobs.tolist())
        offset += n
    # staleness averages run over model tokens only (Lemma 1 on them)
    for g in groups:
        k, k_gen, k_wait = g.staleness(3)
        ref = group_staleness([t.action_versions for t in g.trajectories], [t.completed_at for t in g.trajectories], 3)
        assert (k, k_gen, k_wait) == pytest.approx(ref)
        assert k == pytest.approx(k_gen + k_wait)
        assert torch.isfinite(torch.tensor([k, k_gen, k_wait])).all()


def _model_weights(llm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llm.llm_engine.vllm_config.model_config.model)
    return list(model.state_dict().items())


def test_evaluation_runs_tool_calls_per_sample(llm):
    """eval.py / in-training validation with tools: each of the k samples is its own multi-turn
    request; graded texts contain the interpreter output of the calls they made."""
    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.evaluation import EvalRun, load_sets, sampling_params, tool_runner
    from pace.grading import Grader

    cfg = OmegaConf.structured(Config)
    cfg.rollout.max_tool_calls, cfg.rollout.max_tokens, cfg.rollout.max_model_len = 2, 160, 224
    cfg.eval.k = 4
    sets = {name: ps[:6] for name, ps in load_sets(["tool_arithmetic"], None, "dapo").items()}
    tools = tool_runner(cfg, llm.get_tokenizer())
    texts = []
    with Grader(workers=1) as grader:
        run = EvalRun(sets, sampling_params(cfg, llm.get_tokenizer(), seeded=False), grader, tools=tools)
        original = run._sample_done

        def record(key):  # keep every finished sample's text
            texts.append(llm.get_tokenizer().decode(run._turns[key][1]))
            assert len(run._turns[key][3]) <= len(run._turns[key][1])  # the model's own tokens
            original(key)

        run._sample_done = record
        run.submit(llm.llm_engine)
        import time

        deadline = time.monotonic() + 300
        while not run.poll():
            assert time.monotonic() < deadline
            if llm.llm_engine.has_unfinished_requests():
                for out in llm.llm_engine.step():
                    if run.owns(out.request_id):
                        run.on_output(out)
            else:
                time.sleep(0.01)
    assert sorted(run.results) == ["tool_l1", "tool_l2", "tool_l3", "tool_l4"]
    assert all(len(r) == 6 and all(len(c) == 4 for c in r) for r in run.results.values())
    assert len(texts) == 4 * 6 * 4 == len(run.lengths)
    with_tool = [t for t in texts if "<interpreter>" in t]
    assert run.tool_calls >= len(with_tool) > 0
    assert all("</code>" in t.split("<interpreter>")[0] for t in with_tool)


def test_a_stop_between_and_within_tool_turns_is_continued_after_a_restart(llm):
    """Groups in flight at a stop with responses waiting on their program, and responses mid-turn
    after a tool call, kept and continued by a fresh worker on θ_1: the programs run again and the
    kept tokens (interpreter output included, masked) are unchanged; every response finishes with
    its calls, masks, log-probs and versions lined up."""
    import pickle

    from pace.tools.protocol import CODE_STOP
    from pace.tools.runner import NO_CODE

    first, grader = _worker(llm, levels=[2, 4], groups=4)
    first._admit()
    import time

    def waiting_now():
        return {(p.group.id, i) for p in first._pending.values() for i in p.tool_wait}

    def mid_turn_now():  # responses generating a turn after a tool call
        return {(p.group.id, i) for p in first._pending.values() for i, t in p.responses.items()
                if i not in p.tool_wait and t.completed_at < 0 and t.tool_calls}

    def collect_all_but_two():  # every program's output but the first two submitted: their responses stay waiting
        first.tools.wait()
        held = {key: first.tools._running.pop(key) for key in list(first.tools._running)[:2]}
        first._collect_tools()
        first.tools._running.update(held)

    # Which programs have finished at a given engine step depends on the machine's speed (a slow one
    # collected every call at once, leaving none waiting: CI failed so); holding two back does not
    # (one may be stopped within its program below, the other stays waiting). It takes three responses
    # calling a tool: the tiny tool model calls it in about a quarter of its responses, and 2 of 16 did
    # on one machine (its weights, trained there, differ a little): 4 groups, 32 responses.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (len(waiting_now()) >= 2 and mid_turn_now()):
        if not llm.llm_engine.has_unfinished_requests():
            callers = {(p.group.id, i) for p in first._pending.values() for i, t in p.responses.items()
                       if t.tool_calls or i in p.tool_wait}
            assert len(callers) >= 3, f"only {len(callers)} responses called a tool: the state is out of reach"
            time.sleep(0.01)  # every response waits on its program
        first._consume(first.fleet.step())
        if len(waiting_now()) >= 3:
            collect_all_but_two()
    assert len(waiting_now()) >= 2 and mid_turn_now(), "no response was waiting on a program while another ran a later turn"
    tok = llm.get_tokenizer()

    def writing_now():  # responses stopped while writing a program (not waiting on one)
        return {(p.group.id, i) for p in first._pending.values() for i, t in p.responses.items()
                if t.completed_at < 0 and i not in p.tool_wait
                and "<code>" in tok.decode(t.response_ids[p.code_from.get(i, 0):].tolist())}

    # Stopped here, in the state reached. (Stepping on until a program was being written lost every
    # response mid-turn at times: four continued after their calls all finished at one step, CI failed so.)
    first._abort_all()
    first.tools.close()
    if not writing_now():  # none stopped mid-program: stop a waiting one a few tokens earlier, before its </code>
        p, i = next((p, i) for p in first._pending.values() for i in p.tool_wait)
        t = p.responses[i]
        while "</code>" in tok.decode(t.response_ids[p.code_from.get(i, 0):].tolist()):
            t.truncate(len(t) - 1)
        p.tool_wait.discard(i)
    writing = writing_now()
    rollout = first.state_dict()
    kept = {getattr(item, "group", item).id for item in rollout["inflight"]}  # generating, or complete and grading
    blob = pickle.dumps({"pool": first.pool.state_dict(keep=kept), "rollout": rollout})
    before = {(p.group.id, i): (t.response_ids.copy(), t.logprobs.copy(), t.versions.copy(), t.tool_calls, i in p.tool_wait)
              for p in rollout["inflight"] if hasattr(p, "group") for i, t in p.responses.items() if t.completed_at < 0}

    state = pickle.loads(blob)
    second, grader2 = _worker(llm, levels=[2, 4], groups=4)
    pool = second.pool
    pool.load_state_dict(state["pool"])
    second.load_inflight(state["rollout"]["inflight"], version=1)
    second.set_trainer_version(1)
    second.post_weights(1, _model_weights(llm))
    assert second._apply_update() and second._continue_resumed()
    groups = {g.id: g for g in _drive(second, llm)}
    second.tools.close()
    grader.close()
    grader2.close()
    pool.check_accounting()
    for (gid, i), (ids, lps, vs, calls, was_waiting) in before.items():
        t = groups[gid].trajectories[i]
        n = t.resumed  # the kept tokens, less any that ended within `</code>` (cut, generated again)
        assert len(ids) - len(CODE_STOP) < n <= len(ids) and t.completed_at == 1
        assert t.response_ids[:n].tolist() == ids[:n].tolist() and t.logprobs[:n].tolist() == lps[:n].tolist()
        assert t.versions[:n].tolist() == vs[:n].tolist()
        assert t.tool_calls >= calls + was_waiting
        if was_waiting:  # the program it waited on ran (again): its output follows the kept tokens
            assert n == len(ids) and len(t) > n and not t.action_mask[n]
        if (gid, i) in writing and t.tool_calls > calls:  # it went on writing its program, which then ran
            start, end = next(span for span in _spans(t.action_mask) if span[0] >= n)  # as written before and after
            assert NO_CODE not in tok.decode(t.response_ids[start:end])
        assert len(_spans(t.action_mask)) == t.tool_calls if t.tool_calls else t.action_mask is None
        assert (t.action_versions[sum(t.action_mask[:n]) if t.action_mask is not None else n:] == 1).all()
    assert writing, "no response was stopped while writing a program"
    assert any(w for *_, w in before.values()), "no response was stopped waiting on its program"
    assert any(calls and not w for *_, calls, w in before.values()), "no response was stopped in a turn after a call"


def test_a_response_kept_within_the_code_stop_string_is_cut_before_it(llm):
    """vLLM matches a stop string in a request's own output only: kept text ending with `</co` (or
    `<`) would never stop at `</code>` once continued. The tokens holding the partial stop string
    are cut (generated again); text without one is kept whole."""
    from pace.records import Group, Trajectory
    from pace.rollout.generation import _Pending
    from pace.tools.protocol import CODE_STOP

    worker, grader = _worker(llm, levels=[2], groups=1)
    tok = llm.get_tokenizer()
    for text, partial in (("<code>\nprint(2)\n</co", 4), ("<code>\nx = 3 <", 1), ("<code>\nprint(2)\n", 0),
                          ("<code>\nprint(2)\n</code", 6)):
        ids = tok(text, add_special_tokens=False).input_ids
        traj = Trajectory(ids, [-0.1] * len(ids), [0] * len(ids))
        worker._cut_partial_stop(_Pending(Group(0, "p", [1], "2", 0), 1, {0: traj}), 0)
        kept = tok.decode(traj.response_ids.tolist())
        assert text.startswith(kept) and len(kept) <= len(text) - partial, (text, kept)
        assert not any(kept.endswith(CODE_STOP[:k]) for k in range(1, len(CODE_STOP))), (text, kept)
        if partial == 0:
            assert len(traj) == len(ids)
    worker.tools.close()
    grader.close()
