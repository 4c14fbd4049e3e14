"""DAPO trainer on Accelerate (single process on CPU; FSDP with `accelerate launch` on GPUs).

One training step = one batch of B groups = `trainer.mini_batches` optimizer updates; the policy
version increments once per step. The batch is formed on rank 0 and scattered: every rank gets a
contiguous share of trajectories, and the loss is normalised by the token count of the whole
mini-batch across ranks (token-level loss, DESIGN §4), so the result does not depend on the
number of ranks or micro-batches.

An update whose gradient norm or loss is not finite is skipped (no optimizer or LR-schedule step)
and counted (`train/nonfinite_skipped`); the version still advances, with unchanged weights.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pace.algo.loss import LossOut, dapo_loss, decoupled_loss, m2po_loss
from pace.records import Batch, Trajectory


def _pad(seqs: list[list], value, dtype) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs], dtype=dtype)


def _pad_like(template: torch.Tensor, rows: list[tuple[int, list[float]]]) -> torch.Tensor:
    """A tensor shaped like ``template`` with each row's values written from its start offset."""
    out = torch.zeros_like(template)
    for i, (start, values) in enumerate(rows):
        out[i, start : start + len(values)] = torch.tensor(values, dtype=template.dtype)
    return out


def build_loss(algo) -> Callable[[torch.Tensor, dict, float], LossOut]:
    """The configured loss as fn(logp, batch tensors, num_tokens): one pure function per variant."""
    clip = dict(eps_low=algo.eps_low, eps_high=algo.eps_high, clip_ratio_c=algo.clip_ratio_c)
    if algo.name == "m2po":
        return lambda logp, b, n: m2po_loss(logp, b["logp_behavior"], b["advantages"], b["loss_mask"], n,
                                            m2_threshold=algo.m2_threshold, **clip)
    if algo.ratio_ref == "proximal":
        return lambda logp, b, n: decoupled_loss(logp, b["logp_prox"], b["logp_behavior"], b["advantages"],
                                                 b["loss_mask"], n, is_cap=algo.is_cap, **clip)
    return lambda logp, b, n: dapo_loss(logp, b["logp_behavior"], b["advantages"], b["loss_mask"], n, **clip)


def collate(trajs: list[Trajectory], prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response ids; per-position targets aligned to the next-token logits.

    Position p of the logits predicts token p+1, so response token t (at absolute position
    len(prompt)+t) is scored by logits at len(prompt)+t−1. All per-token tensors are [N, L−1].
    """
    ids, mask, lp_b, adv = [], [], [], []
    for traj, prompt in zip(trajs, prompts):
        full = prompt + traj.response_ids
        n_p, n_r = len(prompt), len(traj.response_ids)
        ids.append(full)
        actions = [1] * n_r if traj.action_mask is None else [int(a) for a in traj.action_mask]
        mask.append([0] * (n_p - 1) + actions)  # tool-output tokens are context, not actions
        lp_b.append([0.0] * (n_p - 1) + list(traj.logprobs))
        adv.append([traj.advantage] * (n_p - 1 + n_r))
    input_ids = _pad(ids, 0, torch.long)
    attention = _pad([[1] * len(s) for s in ids], 0, torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "targets": input_ids[:, 1:],
        "loss_mask": _pad(mask, 0, torch.float32),
        "logp_behavior": _pad(lp_b, 0.0, torch.float32),
        "advantages": _pad(adv, 0.0, torch.float32),
    }


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the entropy of each position's distribution (float32)."""
    logits = logits.float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class DAPOTrainer:
    def __init__(self, model_path: str, cfg, accelerator):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.acc = accelerator
        dtype = getattr(torch, cfg.model.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        t = cfg.trainer
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        warmup = max(1, t.warmup_steps * t.mini_batches)
        # Not given to `prepare`: Accelerate's wrapper steps a schedule once per process per update
        # (`AcceleratedScheduler.step`), so the warm-up would end N times sooner on N processes.
        # Stepped here once per optimizer update and saved with the state (register_for_checkpointing).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup))
        accelerator.register_for_checkpointing(self.scheduler)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.loss_fn = build_loss(cfg.algo)  # chosen once, from config
        self.proximal = cfg.algo.ratio_ref == "proximal"
        self.version = 0
        self.nonfinite_skipped = 0  # updates skipped for a non-finite loss or gradient, over the run
        # True from the first optimizer update of a step until the step completes: a failure then
        # leaves the weights between two versions, and no checkpoint can be taken of them.
        self.mid_step = False

    # --- one training step ----------------------------------------------------------------
    def step(self, batch: Batch | None) -> dict[str, float]:
        """Train on ``batch`` (given on rank 0, None elsewhere). Returns rank-0 metrics."""
        shares = self._scatter(batch)  # this rank's (prompt, trajectory) pairs of each mini-batch
        t0 = time.perf_counter()
        n_mini = self.cfg.trainer.mini_batches
        prox = self._proximal_logprobs([pair for share in shares for pair in share]) if self.proximal else None
        self.model.train()
        totals = dict.fromkeys(("loss", "clipped", "tokens", "entropy", "ratio", "grad_norm", "skipped"), 0.0)
        for mine in shares:
            stats = self._update(mine, prox)
            for k in totals:
                totals[k] += stats[k]
        self.version += 1
        self.mid_step = False
        tokens = max(totals["tokens"], 1.0)
        return {
            "train/loss": totals["loss"] / n_mini,
            "train/clipfrac": totals["clipped"] / tokens,
            "train/entropy": totals["entropy"] / tokens,
            "train/ratio_mean": totals["ratio"] / tokens,
            "train/grad_norm": totals["grad_norm"] / n_mini,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/nonfinite_skipped": int(totals["skipped"]),
            "time/train": time.perf_counter() - t0,
        }

    def _scatter(self, batch: Batch | None) -> list[list[tuple[list[int], Trajectory]]]:
        """Rank 0 splits each mini-batch over the ranks (rank r: trajectories r, r + N, …) and
        sends every rank only its share (`scatter_object_list`)."""
        n_mini, n_rank = self.cfg.trainer.mini_batches, self.acc.num_processes
        per_rank = None
        if self.acc.is_main_process:
            groups = [(g.prompt_ids, g.trajectories) for g in batch.groups]
            per_mini = math.ceil(len(groups) / n_mini)
            minis = [[(p, t) for p, trajs in groups[m * per_mini : (m + 1) * per_mini] for t in trajs] for m in range(n_mini)]
            per_rank = [[pairs[r::n_rank] for pairs in minis] for r in range(n_rank)]
        if n_rank == 1:
            return per_rank[0]
        box = [None]
        torch.distributed.scatter_object_list(box, per_rank, src=0)
        return box[0]

    @torch.no_grad()
    def _proximal_logprobs(self, pairs: list[tuple[list[int], Trajectory]]) -> dict[int, list[float]]:
        """log π_prox of every response token: the policy at the start of this step (decoupled PPO)."""
        self.model.eval()
        out = {}
        mb = self.cfg.trainer.micro_batch_size
        for i in range(0, len(pairs), mb):
            chunk = pairs[i : i + mb]
            b = collate([t for _, t in chunk], [p for p, _ in chunk])
            logits = self.model(input_ids=b["input_ids"].to(self.acc.device),
                                attention_mask=b["attention_mask"].to(self.acc.device)).logits[:, :-1]
            logp, _ = token_logprobs(logits, b["targets"].to(self.acc.device), self.cfg.rollout.temperature)
            for row, (prompt, traj) in enumerate(chunk):
                start = len(prompt) - 1
                out[id(traj)] = logp[row, start : start + len(traj)].tolist()
        return out

    def _update(self, pairs: list[tuple[list[int], Trajectory]], prox: dict[int, list[float]] | None) -> dict[str, float]:
        """One optimizer update on this rank's share of a mini-batch (micro-batched)."""
        local_tokens = torch.tensor(float(sum(t.num_actions for _, t in pairs)), device=self.acc.device)
        total_tokens = self.acc.reduce(local_tokens, reduction="sum").item()
        # DDP/FSDP average gradients over ranks; scale so the result is Σ_tokens / total_tokens.
        norm = total_tokens / self.acc.num_processes
        stats = {"loss": 0.0, "clipped": 0.0, "tokens": 0.0, "entropy": 0.0, "ratio": 0.0}
        mb = self.cfg.trainer.micro_batch_size
        # Every rank has >= 1 trajectory (train.check_shares), so each joins the gradient all-reduce.
        chunks = [pairs[i : i + mb] for i in range(0, len(pairs), mb)]
        for i, chunk in enumerate(chunks):
            b = collate([t for _, t in chunk], [p for p, _ in chunk])
            if prox is not None:
                b["logp_prox"] = _pad_like(b["logp_behavior"], [(len(p) - 1, prox[id(t)]) for p, t in chunk])
            b = {k: v.to(self.acc.device) for k, v in b.items()}
            sync = i == len(chunks) - 1
            with contextlib.nullcontext() if sync else self.acc.no_sync(self.model):
                logits = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
                logp, entropy = token_logprobs(logits, b["targets"], self.cfg.rollout.temperature)
                out = self.loss_fn(logp, b, norm)
                self.acc.backward(out.loss)
            mask = b["loss_mask"]
            stats["loss"] += out.loss.item() / self.acc.num_processes  # this rank's share of Σ/total
            stats["clipped"] += out.clipped.item()
            stats["tokens"] += mask.sum().item()
            stats["entropy"] += (entropy * mask).sum().item()
            stats["ratio"] += out.ratio_sum.item()
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
        stats["grad_norm"] = grad_norm
        stats = self._reduce(stats)
        stats["skipped"] = float(bad.item() > 0)
        return stats

    def _reduce(self, stats: dict[str, float]) -> dict[str, float]:
        if self.acc.num_processes == 1:
            return stats
        keys = ["loss", "clipped", "tokens", "entropy", "ratio"]
        t = self.acc.reduce(torch.tensor([stats[k] for k in keys], device=self.acc.device), reduction="sum")
        out = dict(zip(keys, t.tolist()))
        out["grad_norm"] = stats["grad_norm"]
        return out

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
        FSDP. (Tests and tools; the weight sync streams parameters through pace/sync.py.)"""
        state = self.acc.get_state_dict(self.model, unwrap=True)
        if not self.acc.is_main_process:
            return None
        return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in state.items()]
