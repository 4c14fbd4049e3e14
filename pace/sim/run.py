"""The simulation: engines and a trainer as models, the project's own `Pool` and policy deciding.

One event queue orders everything by simulated time:

    engine event            responses finish → a group's last response → graded → `Pool.add`
    trainer waits           `Pool.form_batch(step)` after every arrival, as train.py's loop
    training step ends      θ_{step+1} exists (trainer version), then the trainer's sync time
    weights published       every engine loads them at the end of the step in progress
                            (requests in flight continue: their later tokens get the new version)
and after every change the rollout starts groups while `Pool.admits` (the policy's admission and
the pool's capacity), each on the engine with the least work, as the real rollout thread does.
PACE's rescoring uses `Pool.to_rescore`/`Pool.set_pfs` with a modelled PFS and costs prefill, as
groups arrive, batches leave and weights load (the real rollout's `_start_rescoring` points).

A response's token versions come from its engine's version log (engine.py); its completion
version c(τ) is the trainer's version when its last token was produced; so Lemma 1 and the fate
accounting hold by the same code as in a real run, and are checked at the end.
"""
from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Callable

import numpy as np

from pace.algo.advantages import is_informative
from pace.pool import Pool, build_policy
from pace.pool.plugins import reads_pfs
from pace.records import Fate
from pace.sim.engine import Finished, SimEngine
from pace.sim.records import SimGroup
from pace.sim.responses import PfsModel, ResponseModel
from pace.sim.sync import Sync, SyncModel

_ENGINE, _TRAIN_DONE, _SYNCED, _PUBLISH, _ARRIVE = range(5)


class Simulation:
    def __init__(self, cfg, on_step: Callable[[int, dict, list], None] | None = None):
        """``on_step(step, metrics, decided groups)`` is called after every training step."""
        from omegaconf import OmegaConf

        # plain dataclasses: the loop reads the config millions of times (DictConfig access costs µs)
        cfg = OmegaConf.to_object(cfg) if OmegaConf.is_config(cfg) else cfg
        self.cfg, self.on_step = cfg, on_step
        s = cfg.sim
        self.g, self.b, self.steps = cfg.data.group_size, cfg.data.batch_prompts, cfg.trainer.steps
        rng = np.random.default_rng(cfg.seed)
        self.responses = ResponseModel(s.responses, self.g, cfg.rollout.max_tokens, cfg.rollout.overlong_buffer, rng)
        self.pfs = PfsModel(s.pfs, rng)
        self.syncs = SyncModel(cfg)  # each sync's seconds and the engines' pause (full or delta: pace/sim/sync.py)
        metric = (lambda g: g.correct.astype(float).tolist()) if cfg.algo.filter_on == "acc" else (lambda g: g.reward.tolist())
        self.pool = Pool(build_policy(cfg), informative=lambda g: is_informative(metric(g)), capacity=cfg.pool.capacity)
        reprefill = cfg.rollout.kv_on_update == "recompute"  # in-flight sequences prefilled again at each load
        self.engines = [SimEngine(i, s.engine, cfg.rollout.max_num_seqs, reprefill=reprefill)
                        for i in range(cfg.rollout.engines)]
        self._reprefill_last = 0
        self.rescore = reads_pfs(self.pool.policy) and not (cfg.pool.name == "pace" and cfg.pace.score != "effective")
        self.prefix_tokens = cfg.pace.prefix_tokens
        self._events: list = []
        self._touched: set[SimEngine] = set()  # engines whose state changed in this event
        self._dirty = True  # the pool or a version changed since admission was last asked
        self._seq = 0  # tie-break of events at the same time: first scheduled, first done
        self.now = 0.0
        self.trainer_version = 0
        self._version_times = [0.0]  # when θ_v came to exist (the trainer finished update v − 1)
        self.fleet_version = 0  # the version every engine has loaded
        self._val_until = 0.0  # a validation holds the next weight load until then
        self._next_id = 0
        self._training = False
        self._wait_since = 0.0
        self._arrived: list[SimGroup] = []  # since the last step (pooled or filtered)
        self.rows: list[dict] = []  # one per training step
        self.stats = {"events": 0, "rescored": 0, "rescore_tokens": 0, "syncs": 0}
        self._last = (0.0, 0, 0.0, 0.0)  # (time, tokens, busy s, rescore s) at the last step, for rates and phases

    # --- the loop ------------------------------------------------------------------------------
    def run(self, progress: bool = False) -> dict:
        from tqdm import tqdm

        wall = time.perf_counter()
        bar = tqdm(total=self.steps, desc=f"simulate {self.cfg.exp_name}", disable=not progress, dynamic_ncols=True)
        self._after_change()
        while self.trainer_version < self.steps:
            if not self._events:
                raise RuntimeError(f"simulation stalled at step {self.trainer_version} (t = {self.now:.1f} s): nothing "
                                   f"in flight and no batch can form ({self.pool.counts()}); is the policy's admission "
                                   "ever open?")
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = t
            self.stats["events"] += 1
            before = self.trainer_version
            if kind == _ENGINE:
                engine, event_id = payload
                if engine.event_id != event_id:
                    continue  # the engine changed since: a newer event is scheduled
                self._run_engine(engine, t)
            elif kind == _ARRIVE:
                self._arrive(payload)
            elif kind == _TRAIN_DONE:
                self._train_done(*payload)
            elif kind == _SYNCED:
                self._synced(*payload)
            elif kind == _PUBLISH:
                self._publish(*payload)
            self._after_change()
            if self.trainer_version != before:
                bar.update(self.trainer_version - before)
        bar.close()
        self.pool.check_accounting()
        self.stats["wall_s"] = time.perf_counter() - wall
        self.stats["sim_s"] = self.now
        for key in ("tokens", "decode_steps", "preempted", "prefill_tokens", "reprefill_tokens", "rescore_s"):
            self.stats[key] = sum(e.stats[key] for e in self.engines)
        self.stats["engine_busy"] = sum(e.stats["busy_s"] for e in self.engines) / max(self.now * len(self.engines), 1e-9)
        return self.stats

    def _reprefilled(self) -> int:
        """Tokens prefilled again at weight loads since the last step (recompute)."""
        total = sum(e.stats["reprefill_tokens"] for e in self.engines)
        new, self._reprefill_last = total - self._reprefill_last, total
        return new

    def _run_engine(self, engine: SimEngine, t: float) -> None:
        """Run ``engine``'s event at ``t``, then its next ones while they come before every other event
        and change nothing but the engine (a response finishes, its group does not): the same order
        of events as one at a time through the queue, without the queue."""
        events = self._events
        while True:
            self._finished(engine.run_event())
            if abs(engine.clock - t) > 1e-6 * max(1.0, t):  # an event out of step with its engine: a stale one ran
                raise RuntimeError(f"engine {engine.idx} at {engine.clock:.6f} s ran an event of {t:.6f} s")
            if self._dirty or self._touched:
                break
            t = engine.next_event()
            if t is None or (events and t >= events[0][0]):
                break
            self.now = t
            self.stats["events"] += 1
        self._touched.add(engine)

    def _inflight_work(self) -> dict:
        """What a preemption now would throw away without in-flight resume: the tokens generated so
        far for the groups in flight, and the engine-GPU seconds that made them (each engine's busy
        seconds per token so far, times its tensor-parallel GPUs)."""
        made = [sum(o.values()) for o in (e.open_tokens() for e in self.engines)]  # running, per engine
        for g in self.pool.remaining():
            if g.fate is Fate.INFLIGHT:
                made[g.engine] += sum(sum(s[1::2]) for s in g.spans)
        tp = self.cfg.rollout.tensor_parallel_size
        gpu_s = sum(m * tp * e.busy_s / max(e.tokens, 1) for m, e in zip(made, self.engines))
        return {"sim/inflight_tokens": sum(made), "sim/inflight_gpu_s": gpu_s}

    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _after_change(self) -> None:
        while self._dirty:  # the pool or a version changed: admission, the next batch and PACE's PFS may too
            self._dirty = False
            self._admit()
            self._try_batch()
            if self.rescore:
                self._rescore()
        for engine in self._touched:  # their next event moved: schedule it (older entries are stale)
            t = engine.next_event()
            if t is not None:
                self._push(t, _ENGINE, (engine, engine.event_id))
        self._touched.clear()

    # --- rollout side ----------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.trainer_version >= self.steps:
            return
        while self.pool.admits(self.fleet_version, self.trainer_version):
            lengths, correct, rewards, level = self.responses.draw()
            g = SimGroup(id=self._next_id, prompt_id=f"L{level}-{self._next_id}", prompt_ids=[], answer="",
                         submitted_at=self.trainer_version, prompt_tokens=self.cfg.sim.responses.prompt_tokens,
                         target=lengths, lengths=lengths.tolist(), correct=correct, reward=rewards,
                         done_at=np.full(self.g, -1, dtype=np.int64),
                         spans=[[] for _ in range(self.g)], remaining=self.g)
            self._next_id += 1
            self.pool.on_submitted(g)
            engine = min(self.engines, key=lambda e: e.load)
            self._finished(engine.submit(g, self.now))
            self._touched.add(engine)

    def _finished(self, done: list[Finished]) -> None:
        for f in done:
            g = f.group
            g.done_at[f.index] = bisect.bisect_right(self._version_times, f.time) - 1  # c(τ)
            g.remaining -= 1
            if g.remaining == 0:
                g.finished_s = f.time
                g.complete()
                grade = self.cfg.sim.responses.grade_s
                if grade > 0:
                    self._push(max(f.time, self.now) + grade, _ARRIVE, g)
                else:
                    self._arrive(g)

    def _arrive(self, g: SimGroup) -> None:
        self._arrived.append(g)
        self._dirty = True
        self.pool.add(g, self.trainer_version)

    def _rescore(self) -> None:
        """PACE: score the groups whose PFS could change the next rejections, under the loaded weights."""
        v = self.fleet_version
        for g in self.pool.to_rescore(v):
            lags = g.prefix_lag(v, self.prefix_tokens)
            tokens = int(sum(g.prompt_tokens + min(self.prefix_tokens, int(n)) for n, lag in zip(g.target, lags) if lag > 0))
            engine = self.engines[g.engine]
            self._finished(engine.add_prefill(tokens, self.now))
            self._touched.add(engine)
            self.stats["rescored"] += 1
            self.stats["rescore_tokens"] += tokens
            self.pool.set_pfs(g, self.pfs.score(lags), v)

    def _publish(self, version: int, pause_s: float) -> None:
        if self.now < self._val_until:  # a validation of the loaded weights is still running
            self._push(self._val_until, _PUBLISH, (version, pause_s))
            return
        self.fleet_version = version
        self._dirty = True
        for e in self.engines:
            self._finished(e.load_weights(version, self.now, pause_s))
            self._touched.add(e)
        self.stats["syncs"] += 1
        every = self.cfg.eval.every
        if every and version % every == 0 and self.cfg.sim.trainer.val_s > 0:
            self._val_until = self.now + self.cfg.sim.trainer.val_s

    # --- trainer side ----------------------------------------------------------------------------
    def _try_batch(self) -> None:
        if self._training or self.trainer_version >= self.steps:
            return
        step = self.trainer_version
        batch = self.pool.form_batch(step, timeout=0)
        if batch is None:
            return
        self._training = True
        self._dirty = True  # the batch left the pool: room for more
        self._slowdown(self.cfg.sim.engine.train_slowdown)
        t = self.cfg.sim.trainer
        tokens = sum(g.prompt_tokens * self.g + g.num_tokens for g in batch.groups)
        train_s = t.step_s + t.per_update_s * self.cfg.trainer.mini_batches + t.per_token_s * tokens
        if any(e.n for e in self.engines):  # generating alongside: shared processors slow the step
            train_s *= t.colocated_slowdown * self._client_slowdown()
        self._push(self.now + train_s, _TRAIN_DONE, (batch, self.now, train_s))

    def _client_slowdown(self) -> float:
        """The factor rank 0's rollout client puts on a step starting now (sim.client), from the
        engines' token rate at this moment."""
        c = self.cfg.sim.client
        if not c.us_per_token:
            return 1.0
        busy = sum(e.token_rate() for e in self.engines) * c.us_per_token * 1e-6
        return 1.0 + float(np.interp(busy, [p[0] for p in c.curve], [p[1] for p in c.curve]))

    def _train_done(self, batch, started: float, train_s: float) -> None:
        """θ_{step+1} exists; the trainer's side of the sync follows (if due), then the engines load it."""
        self.trainer_version = batch.step + 1
        self._version_times.append(self.now)
        self._dirty = True
        self._slowdown(1.0)
        due = self.trainer_version % self.cfg.rollout.sync_every == 0 or self.trainer_version == self.steps
        sync = self.syncs.sync(self.trainer_version) if due else None
        decided = self.pool.drain_decided()
        metrics = self._metrics(batch, decided, wait=started - self._wait_since, train_s=train_s, sync=sync)
        self.rows.append(metrics)
        if self.on_step is not None:
            self.on_step(batch.step, metrics, decided)
        self._push(self.now + (sync.seconds if sync else 0.0), _SYNCED, (self.trainer_version, sync))

    def _synced(self, version: int, sync: Sync | None) -> None:
        """The trainer is free for the next batch (train.py: prepare, log, publish, loop)."""
        if sync is not None:
            self._publish(version, sync.pause_s)
        self._training = False
        self._wait_since = self.now
        self._dirty = True

    def _slowdown(self, factor: float) -> None:
        if self.cfg.sim.engine.train_slowdown != 1.0:
            for e in self.engines:
                self._finished(e.set_slowdown(factor, self.now))
                self._touched.add(e)

    # --- what a step logs: the names of pace/loop.py's step_metrics (docs/design.md §6) ------------------
    def _metrics(self, batch, decided: list, wait: float, train_s: float, sync: Sync | None) -> dict:
        step, groups = batch.step, batch.groups
        ks = np.array([g.staleness(step) for g in groups])
        arrived, self._arrived = self._arrived, []
        lens = np.concatenate([g.target for g in groups])
        m = {"rollout/groups_completed": len(arrived)}
        if all("s_eff" in g.scores for g in groups):  # PACE scored them
            m["staleness/effective_mean"] = float(np.mean([g.scores["s_eff"] for g in groups]))
        if arrived:
            m["rollout/acc_mean"] = float(np.concatenate([g.correct for g in arrived]).mean())
            m["rollout/reward_mean"] = float(np.concatenate([g.reward for g in arrived]).mean())
        tokens = sum(e.tokens for e in self.engines)
        busy, rescore = sum(e.busy_s for e in self.engines), sum(e.rescore_s for e in self.engines)
        dt = self.now - self._last[0]
        sync_s = sync.seconds if sync else 0.0
        if sync is not None:  # the names of the real sync's metrics (pace/weights/sync.py)
            m.update({"sync/pause_s": sync.pause_s, "sync/full": int(sync.full)})
            if sync.bytes is not None:
                m.update({"sync/bytes": sync.bytes, "sync/changed_frac": sync.changed_frac})
        m.update({
            "train/reward_mean": float(np.concatenate([g.reward for g in groups]).mean()),
            "train/acc_mean": float(np.concatenate([g.correct for g in groups]).mean()),
            "train/response_len": float(lens.mean()),
            "train/action_len": float(lens.mean()),
            "staleness/k_mean": float(ks[:, 0].mean()),
            "staleness/k_gen_mean": float(ks[:, 1].mean()),
            "staleness/k_kv_mean": float(np.mean([g.k_kv() for g in groups])),  # KV staleness (≥ K_gen)
            "staleness/k_wait_mean": float(ks[:, 2].mean()),
            "staleness/k_max": float(ks[:, 0].max()),
            "pool/occupancy": self.pool.occupancy,
            "pool/rejected": sum(g.fate == Fate.REJECTED for g in decided),
            "pool/filtered": sum(g.fate == Fate.FILTERED for g in decided),
            "pool/dropped_stale": sum(g.fate == Fate.DROPPED_STALE for g in decided),
            **{f"pool/{k}": v for k, v in self.pool.last_metrics.items()},
            "rollout/inflight": self.pool.inflight,
            "rollout/engine_version": self.fleet_version,
            "rollout/tokens_per_s": (tokens - self._last[1]) / dt if dt > 0 else 0.0,
            "version": step,
            "time/wait_data": wait,
            "time/train": train_s,
            "time/sync": sync_s,
            "time/step": wait + train_s + sync_s,
            # overlapped work since the last step, per engine (the real rollout's engine time and rescoring)
            "time/generate": (busy - self._last[2]) / len(self.engines),
            "time/rescore": (rescore - self._last[3]) / len(self.engines),
            "sim/time_s": self.now + sync_s,  # simulated clock when the step (and its sync) is done
            "sim/preempted": sum(e.stats["preempted"] for e in self.engines),
            "rollout/reprefill_tokens": self._reprefilled(),  # rollout.kv_on_update=recompute
            **self._inflight_work(),
        })
        self._last = (self.now, tokens, busy, rescore)
        return m
