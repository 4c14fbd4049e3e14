"""MoE routing replay (`algo.routing_replay`): the trainer's forward routes every token to the
experts the engine routed it to, instead of its own router's top-k.

The engine (vLLM's routed experts) records, for each token as a model input, the top-k expert ids
of every layer; the rollout stores them on the `Trajectory` (``prompt_routes``, ``routes``) and
`pace.algo.microbatch.collate` lays them out in the micro-batch's flattened row order
(``input_ids.reshape(-1)``: right-padded rows or one packed row alike) as ``routes`` [N, layers, k]
and ``route_mask`` [N] (False: padding, the last token, positions no request recorded).

`RoutingReplay` puts a forward hook on every router of a transformers Qwen3-MoE
(`Qwen3MoeTopKRouter`, layer index from its module name ``….layers.<i>.mlp.gate``). Inside
`RoutingReplay.replay` the hook replaces the router's output (logits, weights, indices) by

    idx = recorded routes where ``route_mask``, else the live top-k
    w   = softmax(logits.float(), −1).gather(1, idx);  w /= Σ w  (norm_topk_prob);  w.to(logits.dtype)

so the experts are the engine's and the gate weights come from the *live* logits at those experts:
the router gets its gradient through the k replayed logits (the softmax over all E experts, then
renormalised over the k: the softmax of the k replayed logits when norm_topk_prob). This is the
variant every framework ships: miles `miles/backends/fsdp_utils/models/replay_routers.py::
_qwen3_router_forward` with `miles/utils/replay_base.py::get_topk_fn`, prime-rl
`src/prime_rl/trainer/models/layers/moe/routing.py::TokenChoiceTopKRouter.forward`, Megatron-core
`RouterReplay.get_replay_topk` (scores.gather(1, top_indices)). Gathering from the top-k-masked
scores instead would give a replayed expert outside the live top-k weight 0 and no gradient.

The context must stay open over the backward too: gradient checkpointing runs each layer's
forward, the router included, again in backward, and that recompute must route as the forward
did (NeMo-RL's rule).

Metrics, from the live top-k the router computes anyway (so in a replay run they say what would
differ without replay): per MoE layer, the number of ``measure`` positions (the positions whose
hidden state scores a loss token, that have a recorded route) whose live top-k *set* differs from
the recorded set. `metrics` turns the sums into `moe/route_diff_share/layer<i>`,
`moe/route_diff_share` (their mean over the MoE layers) and `moe/replayed_share`.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch

from pace.errors import ConfigError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _Replay:
    """One micro-batch's replay: its routes, what is replayed and measured, and the sums so far."""

    routes: torch.Tensor  # [N, layers, k] int64
    mask: torch.Tensor  # [N] bool: replay this position's recorded route
    measure: torch.Tensor  # [N] bool: count this position in the metrics
    enabled: bool  # False: measure only, route as the live router does
    diff: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → positions whose top-k set differs


class RoutingReplay:
    """Forward hooks on every `Qwen3MoeTopKRouter` of ``model``; inert outside `replay`."""

    def __init__(self, model: torch.nn.Module, name: str = "the model"):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        routers: dict[int, torch.nn.Module] = {}
        for path, module in model.named_modules():
            if isinstance(module, Qwen3MoeTopKRouter):
                layer = _LAYER.search(path)
                if layer is None:
                    raise ConfigError(f"algo.routing_replay: no layer index in the router's module name {path!r}")
                routers[int(layer.group(1))] = module
            elif "router" in type(module).__name__.lower():
                raise ConfigError(f"algo.routing_replay: {name}'s MoE router {type(module).__name__} is not supported "
                                  "(transformers' Qwen3MoeTopKRouter only)")
        if not routers:
            config = model.config
            if any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
                raise ConfigError(f"algo.routing_replay: {name} ({type(model).__name__}) has no transformers "
                                  "Qwen3MoeTopKRouter, the only MoE router supported")
            raise ConfigError(f"algo.routing_replay: {name} has no MoE router (a dense model); "
                              "set algo.routing_replay=false")
        self.layers = sorted(routers)
        self.shape = (model.config.num_hidden_layers, next(iter(routers.values())).top_k)  # a route record's [layers, k]
        self._active: _Replay | None = None
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in routers.items()]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @contextlib.contextmanager
    def replay(self, routes: torch.Tensor, mask: torch.Tensor, measure: torch.Tensor | None = None,
               enabled: bool = True):
        """Route the forwards (and the backward's recomputes) inside as ``routes`` [N, layers, k]
        says where ``mask`` [N]; yields the `_Replay` whose ``diff`` the hooks fill. ``measure``
        (default ``mask``): the positions the metrics count. ``enabled`` False: measure only."""
        if routes.shape[0] != mask.shape[0] or routes.shape[1:] != self.shape:
            raise ValueError(f"algo.routing_replay: routes of shape {tuple(routes.shape)} for {mask.shape[0]} positions, "
                             f"expected [positions, {self.shape[0]}, {self.shape[1]}]")
        measure = mask if measure is None else measure & mask
        self._active = _Replay(routes, mask, measure, enabled)
        try:
            yield self._active
        finally:
            self._active = None

    def _hook(self, layer: int):
        def hook(module, args, output):
            r = self._active
            if r is None:
                return None
            logits, _, live = output
            if logits.shape[0] != r.routes.shape[0]:
                raise ValueError(f"algo.routing_replay: layer {layer}'s router saw {logits.shape[0]} positions, "
                                 f"the micro-batch's routes cover {r.routes.shape[0]}")
            recorded = r.routes[:, layer]
            if layer not in r.diff:  # once: gradient checkpointing runs the router again in backward
                with torch.no_grad():
                    differ = (live.sort(-1).values != recorded.sort(-1).values).any(-1)
                    r.diff[layer] = (differ & r.measure).sum()
            if not r.enabled:
                return None
            idx = torch.where(r.mask[:, None], recorded, live)
            weights = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), idx

        return hook

    # --- metrics ---------------------------------------------------------------------------
    def stat_keys(self) -> tuple[str, ...]:
        """The sums a trainer step accumulates (the same on every rank)."""
        return ("moe_measured", "moe_replayed", "moe_positions", *(f"moe_diff/layer{i}" for i in self.layers))

    def stats(self, r: _Replay, positions: float) -> dict[str, float]:
        """One micro-batch's sums: ``positions`` is its number of token positions (padding excluded)."""
        zero = r.mask.new_zeros((), dtype=torch.int64)
        counts = torch.stack([r.measure.sum(), r.mask.sum(), *(r.diff.get(i, zero) for i in self.layers)]).tolist()  # one sync
        return {"moe_measured": float(counts[0]), "moe_replayed": float(counts[1]), "moe_positions": positions,
                **{f"moe_diff/layer{i}": float(c) for i, c in zip(self.layers, counts[2:])}}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """`moe/route_diff_share` (mean over MoE layers), its per-layer values and `moe/replayed_share`."""
        out = {"moe/replayed_share": sums["moe_replayed"] / max(sums["moe_positions"], 1.0)}
        if sums["moe_measured"] > 0:
            per_layer = {i: sums[f"moe_diff/layer{i}"] / sums["moe_measured"] for i in self.layers}
            out["moe/route_diff_share"] = sum(per_layer.values()) / len(per_layer)
            out |= {f"moe/route_diff_share/layer{i}": v for i, v in per_layer.items()}
        return out
