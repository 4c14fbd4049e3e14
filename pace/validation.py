"""In-training validation on the trainer side: metric names, the logged rows (`ValRows`), and the
best-average checkpoint.

The rollout thread validates θ_v on the rollout engine (`RolloutWorker`, `eval.every`: the engines'
side, pace/rollout/val_requests.py) and hands over a `ValResult`; the train loop logs `val_metrics` (docs/design.md §6: `val/<bench>/mean@k`,
`val/avg`) and offers it to `BestCheckpoint`, which keeps the weights with the highest average
among versions ≤ `eval.best_within` in `<run>/best` (Table 1's selection: the best six-benchmark
average within 300 updates; pace/selection.py), whatever the weight-transfer backend (`publish`).
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from pace.checkpoint import install, save_weights, saved_version
from pace.evaluation import summarize


def val_metrics(result, k: int) -> dict[str, float]:
    """The step metrics of one validation: mean@k per set, the average, and where it came from."""
    scores = summarize(result.results)
    metrics = {f"val/{name}/mean@{k}": v for name, v in scores.items() if name != "avg"}
    metrics["val/avg"] = scores["avg"]
    metrics["val/version"] = result.version  # the weights validated (x axis of validation curves)
    metrics["val/response_len"] = result.response_len
    metrics["time/validate"] = result.seconds  # weight updates were held this long
    return metrics


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class BestCheckpoint:
    """One copy of the best validated weights: `<run>/best/`, the validated version with the highest
    `val/avg` among versions ≤ ``best_within`` (`eval.best_within`; None: the whole run), replaced when a
    better one comes. Ties keep the earlier version. Version 0 is the model on disk: named, not copied.

    Where the weights come from, for every weight-transfer backend:
    - shm: the validation carries θ_v (the rollout read the slot it loaded): written on a new best.
    - nccl, gloo, ipc: the engines got θ_v by a broadcast, with no host copy. The trainer still holds
      θ_v right after publishing it: if the engines started validating it (`RolloutWorker.val_started`,
      the engines' own schedule, so nothing is mirrored), `publish` gathers θ_v (every rank) and
      rank 0 writes it with `keep_candidate` to `best-candidates/v<N>/`. When θ_v's validation
      arrives, the candidate becomes `best/` (a rename) if it is the new best, else it is deleted.
      Cost: one model-directory write per validated version in the window, while the engines
      validate (the next weight update waits for that validation anyway) but between collectives:
      the next training step waits for the write on every rank (an 8B model: 16 GB, ~16 s at 1 GB/s;
      `best_copies` in the summary). Candidates left at the end of a run are deleted (`close`).

    best.json names the selected version, its average, and `path` (`<run>/best`, or the model on
    disk for θ_0); `best/version.json`, written with the weights, the version `best/` holds (a kill
    between the two writes cannot pass one version's weights off as another's). Resume: the checkpoint's best must still be on disk. A best replaced after the
    newest checkpoint (the run then stopped) would be lost to a resume from that checkpoint, so the
    best a checkpoint recorded is moved to `best.checkpointed/` when replaced, and deleted once a
    newer checkpoint records its successor (`saved`).
    """

    def __init__(self, run_dir: Path, model_path: str, best_within: int | None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "best"
        self.kept = self.run_dir / "best.checkpointed"  # the best the newest checkpoint recorded, once replaced
        self.candidates = self.run_dir / "best-candidates"
        self.model_path = model_path
        self.best_within = best_within
        self.best: dict | None = None  # {"version", "val/avg", "path"}
        self.history: list[dict] = []  # every validation: version and average
        self.checkpointed: int | None = None  # the best's version as the newest checkpoint recorded it
        self.copies = {"count": 0, "seconds": 0.0}  # candidates written and the time writing them (summary)
        self.missed: list[int] = []  # new bests whose weights could not be kept (warned)
        # candidates of a run that stopped: their validations are redone (the rollout's schedule)
        shutil.rmtree(self.candidates, ignore_errors=True)

    def in_window(self, version: int) -> bool:
        return in_window(version, self.best_within)

    def wants(self, version: int) -> bool:
        """Whether θ_version, about to be validated, needs a candidate copy (train.py asks after
        publishing it on a backend with no host copy of the weights)."""
        return version != 0 and self.in_window(version)

    def candidate(self, version: int) -> Path:
        return self.candidates / f"v{version:06d}"

    def keep_candidate(self, version: int, weights: list) -> None:
        """Rank 0, between collectives: a failed write (disk full) is a warning and no candidate
        (its validation then keeps the previous best), never a rank 0 that alone stops."""
        t0 = time.perf_counter()
        try:
            save_weights(self.candidate(version), weights, self.model_path, version)
        except OSError as exc:
            shutil.rmtree(self.candidate(version).with_name(self.candidate(version).name + ".tmp"), ignore_errors=True)
            warn(f"θ_{version}: its copy for {self.path} could not be written ({exc}): it cannot become the best")
            return
        self.copies["count"] += 1
        self.copies["seconds"] += time.perf_counter() - t0

    def offer(self, result, avg: float) -> bool:
        """Record a validation; keep its weights if it is the new best. True if it is. A new best
        whose weights cannot be kept (no copy, or a failed write) is a warning, recorded in the
        summary's `best_missed`; the previous best stays."""
        self.history.append({"version": result.version, "val/avg": avg})
        v = result.version
        try:
            if not self.in_window(v) or (self.best is not None and avg <= self.best["val/avg"]):
                return False
            if v == 0:
                path = self.model_path
            elif self._replace(v, result.weights):
                path = str(self.path)
            else:
                self.missed.append(v)
                return False
            self.best = {"version": v, "val/avg": avg, "path": path}
            self._write()
            return True
        finally:
            self._drop_candidates(upto=v)

    def _replace(self, v: int, weights: list | None) -> bool:
        """`best/` := θ_v (``weights``, else its candidate), with the version inside the directory."""
        kept = "the previous best stays" if self.best is None else f"θ_{self.best['version']} stays the best"
        if weights is None and not self.candidate(v).is_dir():  # train.py copies every validated version in the window
            warn(f"validation of θ_{v}: no copy of its weights (neither carried by the validation nor in "
                 f"{self.candidate(v)}): not kept, {kept}")
            return False
        set_aside = self._set_aside()
        try:
            if weights is not None:
                save_weights(self.path, weights, self.model_path, v)
            else:
                install(self.candidate(v), self.path)
        except OSError as exc:
            warn(f"validation of θ_{v}: its weights could not be written to {self.path} ({exc}): not kept, {kept}")
            if set_aside and not self.path.exists():
                self.kept.rename(self.path)
            return False
        return True

    def _set_aside(self) -> bool:
        """Before `best/` is replaced: the newest checkpoint's best is moved aside (a resume from that
        checkpoint needs it); any other is deleted. True if moved."""
        if self.best is not None and self.best["version"] == self.checkpointed and self.path.is_dir():
            shutil.rmtree(self.kept, ignore_errors=True)
            self.path.rename(self.kept)
            return True
        return False

    def _drop_candidates(self, upto: int) -> None:
        if self.candidates.is_dir():
            for d in self.candidates.iterdir():
                v = d.name[1:].split(".")[0]
                if d.name.startswith("v") and v.isdigit() and int(v) <= upto:
                    shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        """End of the run, however it ends: candidates left are dropped (a resume redoes their
        validations and copies), with their folder."""
        shutil.rmtree(self.candidates, ignore_errors=True)

    def _write(self) -> None:
        (self.run_dir / "best.json").write_text(json.dumps(self.best, indent=1))

    def saved(self, version: int) -> None:
        """A checkpoint was written (`Checkpointer.on_saved`): it recorded the current best, so the
        one set aside for the previous checkpoint is no longer needed."""
        self.checkpointed = None if self.best is None else self.best["version"]
        shutil.rmtree(self.kept, ignore_errors=True)

    def summary(self) -> dict:
        return {"best": self.best, "best_within": self.best_within, "validations": self.history, "best_copies": self.copies,
                "best_missed": self.missed}

    def state_dict(self) -> dict:
        return {"best": self.best, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the checkpoint's best, with its weights wherever a run that stopped left them
        (`best/`; set aside in `best.checkpointed/` when a later validation replaced it; `best.old/`
        when killed while replacing it), found by the version each directory holds."""
        self.best, self.history = state["best"], list(state["history"])
        self.checkpointed = None if self.best is None else self.best["version"]
        old = self.path.with_name(self.path.name + ".old")
        places = [self.path, self.kept, old]
        held = {p: self._held(p) for p in places if p.is_dir()}
        if self.best is not None and self.best["version"] != 0:
            v = self.best["version"]
            found = next((p for p, hv in held.items() if hv == v), None)
            if found is None:  # resumed from a checkpoint older than the newest
                from pace.errors import ConfigError

                raise ConfigError(f"resume: the checkpoint's best θ_{v} is neither in {self.path} (holds θ_{held.get(self.path)}) "
                                  f"nor in {self.kept.name}/ or {old.name}/: resume from the run's newest checkpoint")
            if found != self.path:
                shutil.rmtree(self.path, ignore_errors=True)
                found.rename(self.path)
        else:
            shutil.rmtree(self.path, ignore_errors=True)  # a best of the run that stopped, after the checkpoint
        for p in (self.kept, old, self.path.with_name(self.path.name + ".tmp")):
            shutil.rmtree(p, ignore_errors=True)
        if self.best is not None:
            self._write()
        else:
            (self.run_dir / "best.json").unlink(missing_ok=True)

    def _held(self, path: Path) -> int | None:
        """The version a best directory holds: its `version.json`; for `best/` of a run written
        before directories named their version, best.json's."""
        v = saved_version(path)
        if v is None and path == self.path:
            try:
                return json.loads((self.run_dir / "best.json").read_text())["version"]
            except (OSError, ValueError, KeyError):
                return None
        return v


def in_window(version: int, best_within: int | None) -> bool:
    """Whether θ_version can be selected (`eval.best_within`; None: the whole run)."""
    return best_within is None or version <= best_within


def publish(sync, version: int, best: BestCheckpoint | None, rollout, decide=lambda flag: flag, keep: bool = True,
            best_within: int | None = None) -> None:
    """Every rank: the engines load θ_version (`WeightSync.publish`). With a blocking transfer (nccl,
    gloo, ipc: no host copy of θ reaches the validation), if the engines started validating θ_version
    and `best` wants it, every rank gathers θ_version (a collective) and rank 0 keeps it as a candidate.
    ``best``, ``rollout``: rank 0's (None elsewhere); ``decide``: rank 0's flag on every rank
    (pace/control.py, a broadcast); ``keep``: validation is on (`eval.every` > 0) and ``best_within``:
    `eval.best_within`, on every rank, so versions that cannot be selected skip that broadcast."""
    from pace.weights import transfer

    sync.publish(version)
    if not keep or sync.backend == transfer.BACKEND:  # shm: the validation carries θ (see BestCheckpoint)
        return
    if version == 0 or not in_window(version, best_within):  # no rank would gather it
        return
    wanted = best is not None and rollout.val_started == version and best.wants(version)
    if decide(wanted):
        weights = sync.weights(version)
        if best is not None:
            best.keep_candidate(version, weights)


class ValRows:
    """Finished in-training validations (`ValResult`s) on the trainer side, as logged rows: each is
    offered to the best checkpoint on arrival and logged in the next step's row (one per row, so a
    wandb step never holds two)."""

    def __init__(self, rollout, best: BestCheckpoint, k: int, final_version: int):
        self.rollout, self.best, self.k = rollout, best, k
        self.final_version = final_version
        self._rows: list[dict] = []

    def poll(self) -> None:
        from tqdm import tqdm

        for result in self.rollout.drain_val_results():
            metrics = val_metrics(result, self.k)
            metrics["val/best"] = float(self.best.offer(result, metrics["val/avg"]))
            self._rows.append(metrics)
            tqdm.write(f"validation of θ_{result.version}: avg mean@{self.k} = {metrics['val/avg']:.3f}"
                       f" in {result.seconds:.1f} s{' (best so far)' if metrics['val/best'] else ''}", file=sys.stderr)

    def next_row(self) -> dict:
        self.poll()
        return self._rows.pop(0) if self._rows else {}

    def finish(self, logger, step: int, stop=lambda: False) -> None:
        """Wait for θ_final's validation (the rollout starts no groups once training is done) and
        log what is left, one row per validation from step ``step`` on. ``stop()`` ends the wait."""
        while self.rollout.validated_version != self.final_version and not stop():
            self.rollout.check()
            time.sleep(0.05)
        self.poll()
        for i, row in enumerate(self._rows):
            logger.log(step + i, row)
        self._rows.clear()

    def state_dict(self) -> dict:
        return {"rows": list(self._rows), "best": self.best.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._rows = list(state["rows"])
        self.best.load_state_dict(state["best"])
