"""DAPO trainer on Accelerate (single process on CPU; FSDP2 with `accelerate launch` on GPUs).

One training step = one batch of B groups = `trainer.mini_batches` optimizer updates; the policy
version increments once per step. The batch is formed on rank 0, which also plans every rank's
micro-batches (pace/algo/microbatch.py: by count, or by a token budget) and scatters them: every
rank gets its share. The loss is normalised by the token count of the whole mini-batch across
ranks (token-level loss, docs/design.md §4), so the result does not depend on the number of ranks or
micro-batches.

Memory per micro-batch is set by `trainer.logprob_chunk`: the log-probs of the response tokens
are taken from the final hidden states, a chunk of positions at a time, recomputed in backward
(pace/algo/logprobs.py); no full-vocabulary logits of a whole micro-batch exist. Gradients are
reduced after every micro-batch under FSDP (reduce-scatter into sharded gradients, in
`trainer.reduce_dtype`), and only after the last one under DDP (`trainer.grad_sync`).

An update whose gradient norm or loss is not finite is skipped (no optimizer or LR-schedule step)
and counted (`train/nonfinite_skipped`); the version still advances, with unchanged weights.

With `algo.routing_replay` (MoE) every forward, and each update's backward, routes tokens to the
experts the engine recorded (pace/algo/routing_replay.py); the step logs `moe/route_diff_share`
(what would differ without replay) and `moe/replayed_share`.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from pace.algo import correction, m2po, microbatch, model_load
from pace.algo.logprobs import response_logprobs
from pace.algo.loss import build_loss
from pace.algo.microbatch import collate
from pace.algo.routing_replay import RoutingReplay
from pace.records import Batch, Trajectory

Pair = tuple[list[int], Trajectory]  # (prompt ids, response)


class DAPOTrainer:
    def __init__(self, model_path: str, cfg, accelerator):
        self.cfg = cfg
        self.acc = accelerator
        t = cfg.trainer
        compute = getattr(torch, cfg.model.dtype)
        # With Accelerate's mixed precision (GPU presets: bf16) the parameters, gradients and AdamW
        # state are kept in `trainer.master_dtype` (under FSDP2 always float32: Accelerate upcasts
        # them in `prepare`) and the forward runs in `model.dtype` (FSDP2's
        # MixedPrecisionPolicy, or autocast under DDP): bf16 weights would round away updates of
        # lr 1e-6. Without it the model is trained in `model.dtype` (the CPU runs: float32).
        mixed = accelerator.mixed_precision in ("bf16", "fp16")
        dtype = getattr(torch, t.master_dtype) if mixed else compute
        if accelerator.is_fsdp2 and mixed:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
                param_dtype=compute, reduce_dtype=getattr(torch, t.reduce_dtype))
        kwargs = {} if cfg.model.attn_implementation is None else {"attn_implementation": cfg.model.attn_implementation}
        # In the checkpoint's own dtype, then brought to `dtype`: under FSDP2 with mixed precision by
        # Accelerate's upcast in `prepare`, one tensor at a time (an fp32 load would hold both). Where
        # `prepare` broadcasts rank 0's weights (FSDP2, cpu_ram_efficient_loading), ranks >= 1 build
        # the model on the meta device: no weights, no parameter memory (pace/algo/model_load.py).
        model = model_load.load(model_path, accelerator, **kwargs)
        if not (accelerator.is_fsdp2 and mixed):
            for p in model.parameters():  # parameters only, as Accelerate's upcast: buffers (rotary) stay as loaded
                if p.dtype != dtype:
                    p.data = p.data.to(dtype)
        if getattr(model.config, "final_logit_softcapping", None):
            raise ValueError(f"{model_path}: final_logit_softcapping is not applied by the trainer's log-prob path")
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        warmup = max(1, t.warmup_steps * t.mini_batches)
        # Not given to `prepare`: Accelerate's wrapper steps a schedule once per process per update
        # (`AcceleratedScheduler.step`), so the warm-up would end N times sooner on N processes.
        # Stepped here once per optimizer update and saved with the state (register_for_checkpointing).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup))
        accelerator.register_for_checkpointing(self.scheduler)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        unwrapped = accelerator.unwrap_model(self.model)
        self._decoder, self._head = unwrapped.get_decoder(), unwrapped.get_output_embeddings()
        # MoE routing replay: hooks on every router, routing as the engine did inside `_routes` (refused
        # for a model without a supported MoE router)
        self.replay = RoutingReplay(unwrapped, model_path) if cfg.algo.routing_replay else None
        self.loss_fn = build_loss(cfg.algo)  # chosen once, from config
        self.proximal = cfg.algo.ratio_ref == "proximal"
        # `trainer.grad_sync` resolved. FSDP: reduce-scatter after every micro-batch (sharded gradients;
        # `no_sync` would keep an unsharded one per GPU). DDP: all-reduce once, after the last (its
        # gradients are full anyway).
        self.grad_sync_every = t.grad_sync == "every" or (t.grad_sync == "auto" and accelerator.is_fsdp2)
        self.version = 0
        self.nonfinite_skipped = 0  # updates skipped for a non-finite loss or gradient, over the run
        # True from the first optimizer update of a step until the step completes: a failure then
        # leaves the weights between two versions, and no checkpoint can be taken of them.
        self.mid_step = False

    # --- one training step ----------------------------------------------------------------
    def step(self, batch: Batch | None) -> dict[str, float]:
        """Train on ``batch`` (given on rank 0, None elsewhere). Returns rank-0 metrics."""
        # per mini-batch, this rank's micro-batches of (prompt, trajectory) pairs; the engines to
        # measure the mismatch of (0 .. n_engines − 1: the batch's highest engine index + 1)
        plans, n_engines = self._scatter(batch)
        t0 = time.perf_counter()
        n_mini = self.cfg.trainer.mini_batches
        prox = self._proximal_logprobs(plans) if self.proximal else None
        self.model.train()
        totals: dict[str, float] = {}
        m2po_stats: list[dict] = []
        for m, micro_batches in enumerate(plans):
            # train–inference mismatch on the weights of this version: every token of the proximal
            # pass, or the first mini-batch's forwards (later ones run on updated weights)
            stats = self._update(micro_batches, prox, measure=self.proximal or m == 0, n_engines=n_engines)
            if "m2po" in stats:
                m2po_stats.append(stats.pop("m2po"))
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        self.version += 1
        self.mid_step = False
        tokens = max(totals["tokens"], 1.0)
        out = {
            "train/loss": totals["loss"] / n_mini,
            "train/clipfrac": totals["clipped"] / tokens,
            "train/entropy": totals["entropy"] / tokens,
            "train/ratio_mean": totals["ratio"] / tokens,
            "train/grad_norm": totals["grad_norm"] / n_mini,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/nonfinite_skipped": int(totals["skipped"]),
            "train/pad_frac": totals["pad_tokens"] / max(totals["slots"], 1.0),
            "train/micro_batches": totals["micro_batches"] / n_mini,
            "mismatch/tokens": int(totals["mm_tokens"]),
            "time/train": time.perf_counter() - t0,
        }
        if totals["mm_tokens"]:
            out["mismatch/abs_logp_diff"] = totals["mm_abs_logp_diff"] / totals["mm_tokens"]
            out["mismatch/k3_kl"] = totals["mm_k3_kl"] / totals["mm_tokens"]
            out |= correction.engine_metrics({k[3:]: v for k, v in totals.items() if k.startswith("mm_")})
        if self.cfg.algo.name != "m2po" and self.cfg.algo.is_correction != "none":
            out["mismatch/masked_frac"] = totals["masked"] / tokens
            out["mismatch/truncated_frac"] = totals["truncated"] / tokens
        if m2po_stats:
            out["m2po/masked_frac"] = totals["masked"] / tokens
            for key in ("m2", "m2_after", "eps_low"):
                if key in m2po_stats[0]:
                    out[f"m2po/{key}"] = sum(s[key] for s in m2po_stats) / len(m2po_stats)
            if "binds" in m2po_stats[0]:  # adaptive_clip: ε_high is ∞ where the budget does not bind
                binding = [s for s in m2po_stats if s["binds"]]
                out["m2po/binds_frac"] = len(binding) / len(m2po_stats)
                if binding:  # the mean over the mini-batches it bound in
                    out["m2po/eps_high"] = sum(s["eps_high"] for s in binding) / len(binding)
            out["m2po/trust_region_frac"] = sum(s["trust_region"] for s in m2po_stats) / tokens
        if self.replay is not None:
            out |= self.replay.metrics(totals)
        return out

    def _scatter(self, batch: Batch | None) -> tuple[list[list[list[Pair]]], int]:
        """Rank 0 splits each mini-batch over the ranks and into micro-batches (microbatch.plan)
        and sends every rank only its own (`scatter_object_list`), with the number of engine
        indices the batch's responses name (every rank sums the mismatch of as many engines)."""
        t = self.cfg.trainer
        n_mini, n_rank = t.mini_batches, self.acc.num_processes
        per_rank = None
        if self.acc.is_main_process:
            n_engines = 1 + max((tr.engine for g in batch.groups for tr in g.trajectories), default=-1)
            groups = [(g.prompt_ids, g.trajectories) for g in batch.groups]
            per_mini = math.ceil(len(groups) / n_mini)
            per_rank = [[] for _ in range(n_rank)]
            for m in range(n_mini):
                pairs = [(p, tr) for p, trajs in groups[m * per_mini : (m + 1) * per_mini] for tr in trajs]
                plan = microbatch.plan([len(p) + len(tr) for p, tr in pairs], n_rank, max_seqs=t.micro_batch_size,
                                       max_tokens=t.max_tokens_per_micro_batch, packed=t.packing)
                for r in range(n_rank):
                    per_rank[r].append([[pairs[i] for i in mb] for mb in plan[r]])
            per_rank = [(plans, n_engines) for plans in per_rank]
        if n_rank == 1:
            return per_rank[0]
        box = [None]
        torch.distributed.scatter_object_list(box, per_rank, src=0)
        return box[0]

    def _logprobs(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """log π_θ and entropy of every response token of a collated micro-batch (flat, [T])."""
        return response_logprobs(self.model, b, self.cfg.rollout.temperature, self.cfg.trainer.logprob_chunk,
                                 decoder=self._decoder, head=self._head)

    def _collate(self, pairs: list[Pair]) -> dict[str, torch.Tensor]:
        b = collate([t for _, t in pairs], [p for p, _ in pairs], packed=self.cfg.trainer.packing,
                    route_shape=None if self.replay is None else self.replay.shape)
        return {k: v.to(self.acc.device) for k, v in b.items()}

    def _routes(self, b: dict[str, torch.Tensor]):
        """Around a micro-batch's forward and backward: route as the engine did (routing replay);
        yields the replay whose sums `RoutingReplay.stats` reads, or None without replay."""
        if self.replay is None:
            return contextlib.nullcontext()
        return self.replay.replay(b["routes"], b["route_mask"], b["route_measure"])

    def _proximal_logprobs(self, plans: list[list[list[Pair]]]) -> dict[int, torch.Tensor]:
        """log π_prox of every response token: the policy at the start of this step (decoupled PPO).
        Over the same micro-batches as the updates, so every rank runs as many forwards (FSDP)."""
        out = {}
        for micro_batches in plans:
            for pairs, _, logp in self._score(micro_batches):
                for (_, traj), lp in zip(pairs, torch.split(logp, [len(t) for _, t in pairs])):
                    out[id(traj)] = lp
        return out

    def _score(self, micro_batches: list[list[Pair]]):
        """(pairs, collated batch, log π) of each micro-batch at the current weights, without grad
        (the proximal pass, M2PO's decision); an empty micro-batch runs on the stand-in, so that
        every rank joins FSDP's collectives."""
        self.model.eval()
        try:
            for mb in micro_batches:
                pairs = mb or [self._stand_in(micro_batches)]
                b = self._collate(pairs)
                with torch.no_grad(), self._routes(b):
                    logp, _ = self._logprobs(b)
                yield pairs, b, logp
        finally:
            self.model.train()

    @staticmethod
    def _stand_in(micro_batches: list[list[Pair]]) -> Pair:
        """What an empty micro-batch runs (at weight 0): the rank's shortest sequence."""
        return min((pair for mb in micro_batches for pair in mb), key=lambda pair: len(pair[0]) + len(pair[1]))

    def _update(self, micro_batches: list[list[Pair]], prox: dict[int, torch.Tensor] | None,
                measure: bool = False, n_engines: int = 0) -> dict[str, float]:
        """One optimizer update on this rank's micro-batches of a mini-batch; with ``measure``, the
        mismatch of its on-policy tokens, in all and for each engine below ``n_engines``."""
        local_tokens = torch.tensor(float(sum(t.num_actions for mb in micro_batches for _, t in mb)), device=self.acc.device)
        total_tokens = self.acc.reduce(local_tokens, reduction="sum").item()
        # DDP/FSDP average gradients over ranks; scale so the result is Σ_tokens / total_tokens.
        norm = total_tokens / self.acc.num_processes
        decision, m2po_stats = self._m2po_decide(micro_batches) if self.cfg.algo.name == "m2po" else (None, None)
        keys = ("loss", "clipped", "tokens", "entropy", "ratio", "masked", "truncated", "pad_tokens", "slots",
                "mm_tokens", "mm_abs_logp_diff", "mm_k3_kl")
        # the same keys on every rank (they are summed as one vector): each engine's, even where
        # this rank's share has none of its responses
        keys += tuple(f"mm_{k}/engine{i}" for i in range(n_engines) for k in ("tokens", "abs_logp_diff"))
        keys += () if self.replay is None else self.replay.stat_keys()
        stats = dict.fromkeys(keys, 0.0)
        for i, mb in enumerate(micro_batches):
            # Every rank runs as many micro-batches (microbatch.equalize); an empty one is a pass at
            # weight 0 on a stand-in, so that each rank joins every collective of the forward/backward.
            pairs = mb or [self._stand_in(micro_batches)]
            b = self._collate(pairs)
            if prox is not None:
                b["logp_prox"] = torch.cat([prox[id(t)] for _, t in pairs])
            if decision is not None:
                b["m2po_keep" if self.cfg.algo.m2po_variant == "paper" else "m2po_eps"] = decision[i]
            grad_sync = self.grad_sync_every or i == len(micro_batches) - 1
            # the replay stays set over the backward: gradient checkpointing runs the routers again there
            with contextlib.nullcontext() if grad_sync else self.acc.no_sync(self.model), self._routes(b) as routed:
                logp, entropy = self._logprobs(b)
                out = self.loss_fn(logp, b, norm)
                self.acc.backward(out.loss if mb else out.loss * 0.0)
            if not mb:
                continue
            mask = b["loss_mask"]
            stats["loss"] += out.loss.item() / self.acc.num_processes  # this rank's share of Σ/total
            stats["clipped"] += out.clipped.item()
            stats["tokens"] += mask.sum().item()
            stats["entropy"] += (entropy * mask).sum().item()
            stats["ratio"] += out.ratio_sum.item()
            stats["masked"] += 0.0 if out.masked is None else out.masked.item()
            stats["truncated"] += 0.0 if out.truncated is None else out.truncated.item()
            stats["pad_tokens"] += b["pad_tokens"].item()
            stats["slots"] += b["slots"].item()
            if measure:
                on_policy = correction.on_policy_tokens(b["versions"], b["first_versions"], self.version, mask)
                mm = correction.mismatch(b["logp_prox"] if prox is not None else logp, b["logp_behavior"], on_policy,
                                         b["engines"], n_engines)
                for k, v in mm.items():
                    stats[f"mm_{k}"] += v
            if routed is not None:
                for k, v in self.replay.stats(routed, b["slots"].item() - b["pad_tokens"].item()).items():
                    stats[k] += v
        grad_norm = float(self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip))
        bad = torch.tensor(float(not (math.isfinite(grad_norm) and math.isfinite(stats["loss"]))), device=self.acc.device)
        if self.acc.num_processes > 1:  # every rank must take the same decision
            bad = self.acc.reduce(bad, reduction="sum")
        if bad.item() == 0:
            self.mid_step = True
            self.optimizer.step()
            self.scheduler.step()
        else:
            self.nonfinite_skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        stats = self._reduce(stats)
        stats["grad_norm"] = grad_norm
        stats["skipped"] = float(bad.item() > 0)
        stats["micro_batches"] = float(len(micro_batches))
        if m2po_stats is not None:
            stats["m2po"] = m2po_stats
        return stats

    @torch.no_grad()
    def _m2po_decide(self, micro_batches: list[list[Pair]]) -> tuple[list, dict]:
        """M2PO's decision over the whole mini-batch (pace/algo/m2po.py): a forward pass over this
        rank's micro-batches at the update's weights (empty ones on the stand-in, for FSDP's
        collectives) gives d = log π_θ − log μ; every rank gathers every rank's (d, A, mask) in rank
        order and decides on all of them, so the decision does not depend on the split. Returns per
        micro-batch the keep mask (paper) or the (ε_low, ε_high) pair (adaptive_clip), and the stats."""
        algo = self.cfg.algo
        parts, widths = [], []  # this rank's non-empty micro-batches' rows; every micro-batch's token count
        for mb, (_, b, logp) in zip(micro_batches, self._score(micro_batches)):
            rows = torch.stack([logp - b["logp_behavior"], b["advantages"], b["loss_mask"]]).to("cpu", torch.float64)
            widths.append(rows.shape[1])
            parts.append(rows if mb else rows[:, :0])
        local = torch.cat(parts, 1)
        offset, everything = 0, local
        if self.acc.num_processes > 1:
            gathered = [None] * self.acc.num_processes
            torch.distributed.all_gather_object(gathered, local)
            offset = sum(g.shape[1] for g in gathered[: self.acc.process_index])
            everything = torch.cat(gathered, 1)
        d, adv, mask = everything
        if algo.m2po_variant == "adaptive_clip":
            eps_low, eps_high, stats = m2po.adaptive_clip(d, adv, mask, algo.m2_threshold, algo.m2po_eps_low_min,
                                                          algo.m2po_eps_high_min)
            return [(eps_low, eps_high)] * len(micro_batches), stats | {"eps_low": eps_low, "eps_high": eps_high}
        keep, stats = m2po.keep_mask(d, adv, mask, algo.m2_threshold)
        pieces = iter(torch.split(keep[offset : offset + local.shape[1]], [p.shape[1] for p in parts]))
        # an empty micro-batch (a stand-in at weight 0) keeps nothing
        out = [next(pieces) if mb else torch.zeros(w, dtype=torch.float64) for mb, w in zip(micro_batches, widths)]
        return [piece.to(self.acc.device, torch.float32) for piece in out], stats

    def _reduce(self, stats: dict[str, float]) -> dict[str, float]:
        if self.acc.num_processes == 1:
            return stats
        keys = list(stats)
        t = self.acc.reduce(torch.tensor([stats[k] for k in keys], device=self.acc.device), reduction="sum")
        return dict(zip(keys, t.tolist()))

    # --- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": self.version, "nonfinite_skipped": self.nonfinite_skipped}

    def save(self, path) -> None:
        """Weights, optimizer, LR schedule and RNG states (Accelerate; every rank calls it)."""
        self.acc.save_state(str(path))

    def load(self, path) -> None:
        """Every rank: restore what `save` wrote, and the version and counters from meta.json."""
        import json
        from pathlib import Path

        self.acc.load_state(str(path))
        state = json.loads((Path(path) / "meta.json").read_text())["trainer"]
        self.version, self.nonfinite_skipped = state["version"], state["nonfinite_skipped"]

    # --- weight sync ----------------------------------------------------------------------
    def full_state_dict(self) -> list[tuple[str, torch.Tensor]] | None:
        """Full (unsharded) weights as (name, tensor) on rank 0, None elsewhere. Collective under
        FSDP. (Tests and tools; the weight sync streams parameters through pace/weights/sync.py.)"""
        state = self.acc.get_state_dict(self.model, unwrap=True)
        if not self.acc.is_main_process:
            return None
        return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in state.items()]
