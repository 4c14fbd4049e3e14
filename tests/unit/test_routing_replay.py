"""MoE routing replay, trainer side (pace/algo/routing_replay.py with collate and response_logprobs),
against an independent reference: a tiny random Qwen3-MoE (float32) whose sparse MoE blocks are
replaced by a plain loop over the experts that routes as an "engine" chose — the top-k of router
logits perturbed by fixed noise, so that a known share of the tokens goes to other experts than the
live top-k — with the gate weights of those experts from the live logits (softmax, renormalised).
The engine's routes and log-probs (ℓ^μ) are that reference's; the trainer must reproduce them with
replay (fp32 floor), differ without it, count the planted share, and give the router the
reference's gradient. (The CPU vLLM build cannot return routes: docs/routing-replay.md.)"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pace.algo.logprobs import response_logprobs
from pace.algo.microbatch import collate
from pace.algo.routing_replay import RoutingReplay
from pace.errors import ConfigError
from pace.records import Trajectory

pytestmark = pytest.mark.unit

V, E, K, LAYERS = 128, 8, 2, 2
SHAPES = [(5, 13), (9, 4), (4, 21)]  # (prompt, response) tokens


def _model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16, decoder_sparse_step=1,
                         norm_topk_prob=True, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # routers and experts that matter (the default init's std 0.02 makes routing ~irrelevant)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.3)
            layer.mlp.experts.down_proj.normal_(0.0, 0.3)
    return model


class _Engine:
    """The reference forward, one sequence at a time: each MoE block a plain loop over the tokens'
    experts; the experts of the first ``recorded`` positions are the top-k of the router logits
    plus noise (0.5 × the logits' std, fixed by the seed), the other positions' the live top-k."""

    def __init__(self, model, seed: int = 1):
        self.model = copy.deepcopy(model)
        self.seed = seed
        for i, layer in enumerate(self.model.model.layers):
            layer.mlp.forward = lambda hidden, block=layer.mlp, i=i: self._moe(block, i, hidden)

    def _moe(self, block, layer, hidden):
        b, n, h = hidden.shape
        x = hidden.reshape(-1, h)
        logits = x @ block.gate.weight.T
        probs = torch.softmax(logits.float(), dim=-1)
        live = probs.topk(K, dim=-1).indices
        gen = torch.Generator().manual_seed(self.seed * 100 + layer)
        noisy = logits.detach() + 0.5 * logits.detach().std() * torch.randn(logits.shape, generator=gen)
        idx = torch.where((torch.arange(n) < self.recorded)[:, None], noisy.topk(K, dim=-1).indices, live)
        self.routes[:, layer] = idx
        self.differ[:, layer] = (idx.sort(-1).values != live.sort(-1).values).any(-1) & (torch.arange(n) < self.recorded)
        w = probs.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        rows = []
        for r in range(x.shape[0]):
            out = 0
            for j in range(K):
                e = int(idx[r, j])
                gate, up = (block.experts.gate_up_proj[e] @ x[r]).chunk(2)
                out = out + w[r, j] * (block.experts.down_proj[e] @ (F.silu(gate) * up))
            rows.append(out)
        return torch.stack(rows).reshape(b, n, h)

    def run(self, prompt: list[int], response: list[int], recorded: int | None = None):
        """ℓ of each response token, the routes [n, layers, k], which (position, layer) were routed
        otherwise than the live top-k [n, layers]; ``recorded`` positions replayed (default n − 1:
        every input position, as vLLM returns them)."""
        ids = torch.tensor([prompt + response])
        n = ids.shape[1]
        self.recorded = n - 1 if recorded is None else recorded
        self.routes = torch.zeros(n, LAYERS, K, dtype=torch.int64)
        self.differ = torch.zeros(n, LAYERS, dtype=torch.bool)
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(prompt):, None])[:, 0]
        return logp, self.routes.clone(), self.differ.clone()


def _pairs(engine, recorded=None, seed=2):
    """(prompt, trajectory) pairs whose ℓ^μ and routes are the engine's (``recorded``: per pair, how
    many positions it recorded; None: all but the last; 0: none, no route record at all), and the
    engine's per-pair (ℓ, differ) for the checks."""
    gen = torch.Generator().manual_seed(seed)
    pairs, ref = [], []
    for i, (n_p, n_r) in enumerate(SHAPES):
        prompt = torch.randint(1, V, (n_p,), generator=gen).tolist()
        resp = torch.randint(1, V, (n_r,), generator=gen).tolist()
        n_rec = None if recorded is None else recorded[i]
        with torch.no_grad():
            logp, routes, differ = engine.run(prompt, resp, n_rec)
        traj = Trajectory(resp, logp.tolist(), [0] * n_r, 0, "stop", advantage=1.0)
        n_rec = n_p + n_r - 1 if n_rec is None else n_rec
        if n_rec:
            traj.add_routes(routes[:n_rec].numpy().astype(np.uint8), 0, n_p)  # as the engine hands them over
        pairs.append((prompt, traj))
        ref.append((logp, differ))
    return pairs, ref


def _trainer(model, replay, pairs, packed, enabled=True, chunk=4):
    """The trainer's path: collate with routes, response_logprobs inside the replay."""
    b = collate([t for _, t in pairs], [p for p, _ in pairs], packed=packed, route_shape=replay.shape)
    with replay.replay(b["routes"], b["route_mask"], b["route_measure"], enabled=enabled) as r:
        logp, _ = response_logprobs(model, b, 1.0, chunk)
    return logp, b, r


@pytest.fixture(scope="module")
def setup():
    model = _model()
    engine = _Engine(model)  # a copy, before the hooks go on
    return model, RoutingReplay(model), engine


@pytest.mark.parametrize("packed", [False, True])
def test_replay_reproduces_the_engines_logprobs_and_counts_the_planted_share(setup, packed):
    model, replay, engine = setup
    pairs, ref = _pairs(engine)
    want = torch.cat([lp for lp, _ in ref])
    with torch.no_grad():
        logp, b, r = _trainer(model, replay, pairs, packed)
        live, _, _ = _trainer(model, replay, pairs, packed, enabled=False)
    assert (logp - want).abs().max() < 1e-5  # the fp32 floor: the engine's ℓ^μ
    assert (live - want).abs().max() > 1e-3  # the live router's top-k: a different sub-network
    # the planted share, counted where a loss token is scored (positions n_p − 1 .. n − 2, all recorded)
    planted = torch.cat([d[len(p) - 1 : len(p) + len(t) - 1] for (p, t), (_, d) in zip(pairs, ref)])
    positions = sum(len(p) + len(t) for p, t in pairs)
    sums = replay.stats(r, float(positions))
    assert sums["moe_measured"] == len(want)
    for i in range(LAYERS):
        assert sums[f"moe_diff/layer{i}"] == planted[:, i].sum().item() > 0
    metrics = replay.metrics(sums)
    shares = planted.float().mean(0)
    assert 0.1 < metrics["moe/route_diff_share"] == pytest.approx(shares.mean().item())
    assert metrics["moe/route_diff_share/layer1"] == pytest.approx(shares[1].item())
    assert metrics["moe/replayed_share"] == pytest.approx((positions - len(pairs)) / positions)  # all but the last tokens


def test_padded_and_packed_layouts_agree(setup):
    model, replay, engine = setup
    pairs, _ = _pairs(engine)
    with torch.no_grad():
        padded, bp, rp = _trainer(model, replay, pairs, packed=False)
        packed, bk, rk = _trainer(model, replay, pairs, packed=True)
    torch.testing.assert_close(padded, packed, atol=1e-5, rtol=0)
    assert {i: int(v) for i, v in rp.diff.items()} == {i: int(v) for i, v in rk.diff.items()}
    # the same routes at each token, whichever the layout: row order is input_ids.reshape(-1)'s
    for b in (bp, bk):
        assert b["route_mask"].sum() == sum(len(p) + len(t) - 1 for p, t in pairs)
    at = 0
    width = bp["input_ids"].shape[1]
    for row, (p, t) in enumerate(pairs):
        n = len(p) + len(t)
        want = np.concatenate([t.prompt_routes, t.routes]).astype(np.int64)
        assert torch.equal(bk["routes"][at : at + n - 1], torch.from_numpy(want))
        assert torch.equal(bp["routes"][row * width : row * width + n - 1], torch.from_numpy(want))
        assert not bk["route_mask"][at + n - 1] and not bp["route_mask"][row * width + n - 1 : (row + 1) * width].any()
        at += n


def test_unrecorded_positions_fall_back_to_the_live_top_k(setup):
    model, replay, engine = setup
    # the first sequence recorded up to 3 response positions, the second not at all, the third fully
    pairs, ref = _pairs(engine, recorded=[SHAPES[0][0] + 3, 0, None])
    assert pairs[1][1].routes is None and len(pairs[0][1].routes) == 3
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out)) for layer in model.model.layers]
    try:
        with torch.no_grad():
            logp, b, _ = _trainer(model, replay, pairs, packed=True)
    finally:
        for h in hooks:
            h.remove()
    assert (logp - torch.cat([lp for lp, _ in ref])).abs().max() < 1e-5
    mask = b["route_mask"]
    for layer, (logits, _, idx) in enumerate(seen):  # what the experts got: live where unrecorded, else the record
        live = torch.softmax(logits.float(), -1).topk(K, dim=-1).indices
        assert torch.equal(idx[~mask], live[~mask])
        assert torch.equal(idx[mask], b["routes"][mask, layer])
    assert (~mask).sum() == sum(len(p) + len(t) for p, t in pairs) - (SHAPES[0][0] + 3) - (sum(SHAPES[2]) - 1)


def test_the_router_gets_the_references_gradient_under_gradient_checkpointing():
    model = _model()
    engine = _Engine(model)
    pairs, _ = _pairs(engine)
    weights = torch.linspace(-1.0, 1.0, sum(len(t) for _, t in pairs))
    # the reference's gradient: its loop over experts, with the engine's routes and live gate weights
    for p in engine.model.parameters():
        p.grad = None
    ref = [engine.run(p, t.response_ids.tolist())[0] for p, t in pairs]
    (torch.cat(ref) * weights).sum().backward()
    # the trainer's, with gradient checkpointing: the routers run again in backward, inside the replay
    model.gradient_checkpointing_enable()
    model.train()
    replay = RoutingReplay(model)
    b = collate([t for _, t in pairs], [p for p, _ in pairs], packed=True, route_shape=replay.shape)
    with replay.replay(b["routes"], b["route_mask"], b["route_measure"]):
        logp, _ = response_logprobs(model, b, 1.0, 4)
        (logp * weights).sum().backward()
    grads = dict(engine.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().max() > 1e-4


def test_a_model_without_a_qwen3_moe_router_is_refused_in_one_line():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ConfigError, match=r"^algo.routing_replay: tiny-dense has no MoE router \(a dense model\)"):
        RoutingReplay(dense, "tiny-dense")

    class MixtralTopKRouter(torch.nn.Module):
        pass

    model = _model()
    model.model.layers[1].mlp.gate = MixtralTopKRouter()
    with pytest.raises(ConfigError, match=r"^algo.routing_replay: .*MixtralTopKRouter is not supported"):
        RoutingReplay(model)


def test_routes_of_another_shape_are_refused(setup):
    model, replay, engine = setup
    pairs, _ = _pairs(engine)
    with pytest.raises(ValueError, match=r"algo.routing_replay: a trajectory's routes have \[layers, top-k\] \[2, 2\], the model \[2, 4\]"):
        collate([t for _, t in pairs], [p for p, _ in pairs], route_shape=(LAYERS, 4))
    b = collate([t for _, t in pairs], [p for p, _ in pairs], route_shape=replay.shape)
    with pytest.raises(ValueError, match="algo.routing_replay: routes of shape"):
        with replay.replay(b["routes"][:, :1], b["route_mask"]):
            pass
