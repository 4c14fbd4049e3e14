"""Helpers shared by test modules (imported as ``from tests.helpers import ...``); fixtures and the
suite's tiers are in tests/conftest.py. A test module imports from here, never from another test module."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from pace.algo.advantages import is_informative
from pace.pool import Pool
from pace.pool.base import PoolPolicy
from pace.pool.policies import AsyncPolicy
from pace.records import Group, Trajectory

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
BENCH = SHARED / "benchmarks"


def needs_shared(*paths: Path) -> pytest.MarkDecorator:
    """Skip a test that reads ``paths`` (copies in ../shared) when they are missing on a developer's
    machine; in CI (``CI`` set) they must be there, so the test runs and fails instead of skipping."""
    missing = [p for p in paths if not p.exists()]
    return pytest.mark.skipif(bool(missing) and not os.environ.get("CI"),
                              reason=f"shared copies not found: {', '.join(map(str, missing))}")


def run_train(args: list[str], run_dir: Path, timeout: float = 600, **kw):
    """Run train.py in a subprocess with its run directory at ``run_dir``."""
    import subprocess

    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}", "logger.progress=false"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def wait_for_rows(proc, run_dir: Path, rows: int, timeout: float = 300) -> None:
    """Wait until a train.py started with Popen has logged ``rows`` metrics rows (fails if it exits)."""
    import time

    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)


def check_staleness(groups, kv: str | None = None) -> None:
    """Every decided, complete group: the logged staleness equals the recomputed one, no token is
    newer than its response's completion, and no response completed after the step it was decided.
    Its KV staleness is at least K_gen and recomputed from the spans and request starts; ``kv``: the
    run's rollout.kv_on_update, which every group's record must say."""
    from analysis.runs import recomputed_kv, recomputed_staleness

    decided = groups.dropna(subset=["k"])
    assert len(decided) > 0
    for _, row in decided.iterrows():
        k, k_gen, k_wait = recomputed_staleness(row)
        assert abs(row.k - k) < 1e-9 and abs(row.k_gen - k_gen) < 1e-9 and abs(row.k_wait - k_wait) < 1e-9, row.id
        for spans, c in zip(row.version_spans, row.completed_at):
            assert max(spans[0::2]) <= c <= row.step and list(spans[0::2]) == sorted(spans[0::2]), row.id
        if kv is None and "k_kv" not in row:
            continue
        assert row.k_kv >= row.k_gen - 1e-9, row.id
        assert abs(row.k_kv - recomputed_kv(row)) < 1e-9, row.id  # from the spans and the request starts
        if kv is not None:
            assert bool(row.kv_reprefill) == (kv == "recompute"), row.id
        if kv == "recompute":
            assert abs(row.k_kv - row.k_gen) < 1e-9, row.id


def check_continued(state: dict, groups, version: int, later: dict | None = None) -> tuple[int, int]:
    """The groups a checkpoint kept in flight (``state``: its run_state.pkl) were continued by the
    resumed run from θ_``version``, which logged ``groups`` (and wrote the checkpoint ``later``).
    Each is logged once (decided, or in flight at the end). Every response cut short keeps its
    tokens: in ``later`` (pooled or still in flight there) token for token, ids, ℓ^μ and versions;
    in the logged records its versions and `resumed_tokens`; the tokens after them come from
    θ_version or later. Returns (responses compared token for token, responses checked in the records)."""
    import numpy as np

    kept = state["rollout"]["inflight"]
    assert kept and {getattr(k, "group", k).id for k in kept} == {g.id for g in state["pool"]["inflight"]}
    after = {}
    for item in ([] if later is None else [*later["pool"]["pooled"], *later["rollout"]["inflight"]]):
        group = getattr(item, "group", item)
        responses = item.responses if hasattr(item, "group") else dict(enumerate(item.trajectories))
        after.update({(group.id, i): t for i, t in responses.items()})
    rows = groups.set_index("id")
    assert rows.loc[[getattr(k, "group", k).id for k in kept]].index.is_unique
    compared = checked = 0
    for item in kept:
        if not hasattr(item, "group"):  # it was being graded: complete already
            continue
        row = rows.loc[item.group.id]
        for i, traj in item.responses.items():
            if traj.completed_at >= 0 or len(traj) == 0:
                continue
            n = len(traj)
            t = after.get((item.group.id, i))
            if t is not None and len(t) > n:
                assert t.response_ids[:n].tolist() == traj.response_ids.tolist()
                assert t.logprobs[:n].tolist() == traj.logprobs.tolist() and t.resumed == n
                assert t.versions[:n].tolist() == traj.versions.tolist() and (t.versions[n:] >= version).all()
                compared += 1
            if row.fate != "inflight":  # a record with its tokens' versions
                spans = row.version_spans[i]
                versions = np.repeat(spans[0::2], spans[1::2])
                assert row.resumed_tokens[i] == n, (item.group.id, i)
                assert versions[:n].tolist() == traj.action_versions.tolist()
                assert (versions[n:] >= version).all() and row.completed_at[i] >= version
                checked += 1
    return compared, checked


# ---------------------------------------------------------------- adversarial model outputs

ADVERSARIAL = {
    "empty": "",
    "no_answer": "I refuse to answer.",
    "million_chars": "a" * 1_000_000,
    "million_chars_then_answer": "(" * 1_000_000 + "\nAnswer: 25",
    "huge_number": "Answer: 9" + "9" * 10_000,
    "huge_number_in_tail": "Answer: 9" + "9" * 3_000,
    "latex_soup": "Answer: " + "\\frac{" * 150,
    "latex_soup_long": "Answer: " + "\\frac{\\frac{\\frac{" * 2_000,
    "boxed_soup": "\\boxed{" * 600,
    "tower": "Answer: 10^{10^{10^{10}}}",
    "unicode": "Answer: \ud800\udfff ☃ 𝔸 \u202e ﷽",
    "null_bytes": "Answer: \x00\x00 25 \x00",
    "dollars": "Answer: " + "$" * 3_990,
    "only_marker": "Answer:",
}


# ---------------------------------------------------------------- pool groups (tests/unit/test_pool*.py)

MIXED = (1.0, -1.0, 1.0, -1.0)  # informative
ALL_RIGHT = (1.0, 1.0, 1.0, 1.0)  # filtered


def make_group(gid: int, rewards=MIXED, submitted_at: int = 0) -> Group:
    trajs = [
        Trajectory(response_ids=[5, 6, 7], logprobs=[-0.5] * 3, versions=[submitted_at] * 3,
                   completed_at=submitted_at, finish_reason="stop", correct=r > 0, reward=r)
        for r in rewards
    ]
    return Group(id=gid, prompt_id=f"p{gid}", prompt_ids=[1, 2], answer="3", submitted_at=submitted_at, trajectories=trajs)


def informative(g: Group) -> bool:
    return is_informative([t.reward for t in g.trajectories])


def make_pool(policy: PoolPolicy | None = None, batch_prompts: int = 2, max_inflight: int = 16) -> Pool:
    return Pool(policy or AsyncPolicy(batch_prompts=batch_prompts, max_inflight_groups=max_inflight), informative)


def submit_and_add(pool: Pool, g: Group, version: int = 0) -> bool:
    pool.on_submitted(g)
    return pool.add(g, version)


# ---------------------------------------------------------------- configs: the presets and Hydra's compose

CONF = ROOT / "conf"


PRESETS = sorted(p.stem for p in (CONF / "exp").glob("*.yaml") if not p.stem.startswith("_"))


def compose_cfg(overrides: list[str] = (), config_dir: Path = CONF):
    """The config train.py composes from ``config_dir`` with ``overrides`` (the typed schema registered)."""
    from hydra import compose, initialize_config_dir

    from pace.config import register

    register()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


PAPER_PRESETS = [p for p in PRESETS if "qwen3" in p]


# ---------------------------------------------------------------- run folders, read and made

def _read(run_dir):
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    groups = pd.read_parquet(run_dir / "groups")
    summary = json.loads((run_dir / "summary.json").read_text())
    return metrics, groups, summary


def _check_accounting(groups, summary, checkpointed: bool = False):
    """Every submitted group has one fate and one row with it. A run stopped into a checkpoint
    (``checkpointed``) has no rows of its pooled groups and of those in flight: they live on in the checkpoint."""
    fates = summary["fates"]
    assert fates["submitted"] == sum(v for k, v in fates.items() if k != "submitted")
    unrecorded = ("pooled", "inflight") if checkpointed else ()
    assert len(groups) == fates["submitted"] - sum(fates[f] for f in unrecorded)  # one row per recorded group
    assert groups["id"].is_unique
    for fate, n in fates.items():
        if fate != "submitted":
            assert (groups["fate"] == fate).sum() == (0 if fate in unrecorded else n), fate


def check_pace_decisions(groups, gamma: float) -> None:
    """PACE's logged decisions (effective score): at every step the rejected groups are the highest
    scoring (no consumed group scores above a rejected one), each score is K_wait + u^γ K_gen of
    the group's own logged values, u = 1 exactly where no PFS was computed, and some groups were
    really rescored (a PFS from a known engine version)."""
    decided = groups[groups.fate.isin(["rejected", "consumed"])]
    assert (decided.score - (decided.k_wait + decided.u ** gamma * decided.k_gen)).abs().max() < 1e-9
    assert (decided[decided.pfs.isna()].u == 1).all()
    assert (decided.u.between(0, 1)).all()
    rescored = decided[decided.pfs.notna()]
    assert len(rescored) > 0 and rescored.pfs_version.notna().all() and (rescored.pfs >= 0).all()
    for step, at in decided.groupby("step"):
        rejected, consumed = at[at.fate == "rejected"], at[at.fate == "consumed"]
        if len(rejected) and len(consumed):
            assert consumed.score.max() <= rejected.score.min() + 1e-12, step


LEVELS = ["arith_l1", "arith_l2"]


def make_run(root: Path, name: str, pool: str, seed: int, version: int, scores: list[float] | None,
             val: list[float] = (0.9, 0.8), checkpoint: bool = True, tools: int = 0, score: str = "effective") -> Path:
    """A run folder as train.py and eval.py leave it: config, validation rows (numbers unlike the
    scores), best.json and best/, and eval.py's result at mean@4 (when ``scores``)."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    cfg = {"seed": seed, "pool": {"name": pool}, "algo": {"name": "dapo"}, "pace": {"score": score},
           "rollout": {"max_tool_calls": tools}, "eval": {"k": 4, "val_k": 2, "best_within": 300}}
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": 0, "time/step": 1.0}, {"step": 1, "val/version": version, "val/avg": sum(val) / 2,
                                            **{f"val/{n}/mean@2": v for n, v in zip(LEVELS, val)}}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "best.json").write_text(json.dumps({"version": version, "val/avg": sum(val) / 2, "path": str(d / "best")}))
    if checkpoint:
        (d / "best").mkdir()
        (d / "best" / "config.json").write_text("{}")
    if scores is not None:
        (d / "eval").mkdir()
        result = {"run": str(d), "selected": {"version": version}, "k": 4,
                  "mean@4": {**dict(zip(LEVELS, scores)), "avg": sum(scores) / 2}}
        (d / "eval" / "mean@4.json").write_text(json.dumps(result))
    return d


# ---------------------------------------------------------------- the engine and the trainer on the tiny model

def _prompt(llm, text="12+34+5=?\n"):
    return llm.get_tokenizer()(text, add_special_tokens=False).input_ids


def _hf_logprobs(model, ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
    """The trainer's log π of ``ids[start:]`` (`token_logprobs` at ``temperature``)."""
    from pace.algo.logprobs import full_logprobs as token_logprobs

    full = torch.tensor([ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model(full).logits[:, :-1], full[:, 1:], temperature)
    return lp[0, start - 1:].tolist()


def sampled_vs_trainer(llm, model, temperature: float, seed: int = 11) -> tuple[float, int, int]:
    """Four 32-token samples of the engine at ``temperature`` (seeds ``seed`` …): the largest
    |ℓ^μ − log π_θ| over their tokens against ``model``, the responses finished and their tokens."""
    from vllm import SamplingParams

    prompt = _prompt(llm)
    for i in range(4):
        params = SamplingParams(max_tokens=32, temperature=temperature, logprobs=0, detokenize=False, seed=seed + i)
        llm.llm_engine.add_request(f"sync-{i}", {"prompt_token_ids": prompt}, params)
    outs = []
    while llm.llm_engine.has_unfinished_requests():
        outs += [o.outputs[0] for o in llm.llm_engine.step() if o.finished]
    worst = 0.0
    for c in outs:
        ids = list(c.token_ids)
        engine = [lp[t].logprob for t, lp in zip(ids, c.logprobs)]
        trainer = _hf_logprobs(model, prompt + ids, len(prompt), temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(engine, trainer)))
    return worst, len(outs), sum(len(c.token_ids) for c in outs)


def _moved(tiny_model_path, seed: int, scale: float = 0.05):
    """The tiny model with every parameter moved by N(0, scale²): (HF model, its state dict as the
    trainer's sync sends it). Parameters, not state-dict entries, are perturbed, so the tied
    embedding and lm_head stay one tensor."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model, [(n, t.detach().clone()) for n, t in model.state_dict().items()]


def moe_model(path: Path) -> str:
    """A tiny random Qwen3-MoE (the architecture of the 30B-A3B presets) with the tiny model's
    tokenizer, saved at ``path``: what test_reload.py and test_reload_probe_run.py load into vLLM."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from pace.tiny import build_tokenizer

    tok = build_tokenizer()
    # head_dim 32: vLLM's CPU attention has no kernel for 16 (the engine failed to start, which
    # test_reload.py's xfail took for the defect until it said which error it expects)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                         norm_topk_prob=True, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _batch(tokenizer, model, advantage: float, prompt_text="12+34=?\n"):
    """One group: the worked answer twice, both with the given advantage, behaviour = current policy.

    The advantage has one sign in the batch on purpose: with opposite signs on shared tokens the
    gradients cancel to rounding noise, which Adam's first (sign-like) step turns into a random move.
    """
    from pace.algo.logprobs import full_logprobs as token_logprobs
    from pace.records import Batch, Group, Trajectory

    prompt = tokenizer(prompt_text, add_special_tokens=False).input_ids
    resp = tokenizer("12+34=46\nAnswer: 46", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    full = torch.tensor([prompt + resp])
    with torch.no_grad():
        lp, _ = token_logprobs(model(full).logits[:, :-1], full[:, 1:], 1.0)
    logprobs = lp[0, len(prompt) - 1 :].tolist()
    trajs = [Trajectory(list(resp), list(logprobs), [0] * len(resp), 0, "stop", advantage=advantage) for _ in range(2)]
    return Batch(step=0, groups=[Group(0, "p0", prompt, "46", 0, trajs)])


# ---------------------------------------------------------------- a toy module through vLLM's reload

class _Cache(torch.nn.Module):  # as RotaryEmbedding: a buffer computed from the config, no parameter
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.arange(4.0), persistent=False)


def _embedding_method():
    """vLLM's UnquantizedEmbeddingMethod whose post-load processing packs `weight` into a kernel of
    the layer's own, as vLLM-CPU's `cpu_linear` does, which only re-processing refreshes."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    class Packing(UnquantizedEmbeddingMethod):
        def process_weights_after_loading(self, layer):
            layer.packed = layer.weight.detach().clone()

    return Packing()


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.rope = _Cache()
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two layers
        self.head.quant_method = _embedding_method()
        self.head.quant_method.process_weights_after_loading(self.head)

    def load_weights(self, weights) -> set[str]:
        """As a vLLM model's: each tensor through its parameter's (wrapped) loader; names loaded."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        names = set()
        for name, w in weights:
            p = self.get_parameter(name)
            getattr(p, "weight_loader", default_weight_loader)(p, w)
            names.add(name)
        return names


def _update(model, weights: dict, engine=None):
    """One update as a weight-transfer engine runs it: start, each tensor through its (wrapped)
    weight loader, finish; with ``engine`` (an ExactReload) its own start/finish."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )
    from pace.weights import reload

    record_metadata_for_reloading(model)
    shared = reload.shared_parameters(model)
    if engine is not None:
        engine.start_weight_update()
    else:
        initialize_layerwise_reload(model)
    model.load_weights(weights.items())
    if engine is not None:
        return engine.finish_weight_update()
    found = reload.audit(model, shared)
    finalize_layerwise_reload(model, type("ModelConfig", (), {"dtype": torch.float32})())
    return found


FULL = {"embed.weight": torch.ones(6, 4), "mid.weight": torch.full((4, 4), 2.0), "mid.bias": torch.full((4,), 3.0)}


class _Engine:
    """A worker-side weight-transfer engine's layerwise lifecycle, as vLLM's nccl/ipc engines run it."""

    def __init__(self, model):
        self.model = model

    def drain_pending(self):  # vLLM's base class: nothing deferred
        pass

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, type("ModelConfig", (), {"dtype": torch.float32})())
        self.finished = True
