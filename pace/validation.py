"""In-training validation on the trainer side: metric names, and the best-average checkpoint.

The rollout thread validates θ_v on the rollout engine (`RolloutWorker`, `eval.every`) and hands
over a `Validation`; the train loop logs `val_metrics` (DESIGN §6: `val/<bench>/mean@k`,
`val/avg`) and offers it to `BestCheckpoint`, which keeps the weights with the highest average
among versions ≤ `eval.best_within` (Table 1: the best six-benchmark average within N updates).
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from pace.checkpoint import step_dir
from pace.evaluation import summarize

# files of a model directory that are not weights: copied next to the saved weights
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def val_metrics(result, k: int) -> dict[str, float]:
    """The step metrics of one validation: mean@k per set, the average, and where it came from."""
    scores = summarize(result.results)
    metrics = {f"val/{name}/mean@{k}": v for name, v in scores.items() if name != "avg"}
    metrics["val/avg"] = scores["avg"]
    metrics["val/version"] = result.version  # the weights validated (x axis of validation curves)
    metrics["val/response_len"] = result.response_len
    metrics["time/validate"] = result.seconds  # weight updates were held this long
    return metrics


def save_weights(path: Path, weights: list, model_path: str) -> None:
    """A loadable model directory: ``model_path``'s config and tokenizer files plus ``weights``
    as one safetensors file. Written beside ``path`` and renamed, so ``path`` is never half-written."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, tmp / f.name)
    save_file({name: t.contiguous() for name, t in weights}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


class BestCheckpoint:
    """Keeps the validated weights with the highest `val/avg` among versions ≤ ``within``.

    Version 0 is the model on disk: it is named, not copied. Ties keep the earlier version.
    """

    def __init__(self, run_dir: Path, model_path: str, within: int | None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "best"
        self.model_path = model_path
        self.within = within
        self.best: dict | None = None  # {"version", "val/avg", "path"}
        self.history: list[dict] = []  # every validation: version and average

    def offer(self, result, avg: float) -> bool:
        """Record a validation; save its weights if it is the new best. True if it is."""
        self.history.append({"version": result.version, "val/avg": avg})
        if self.within is not None and result.version > self.within:
            return False
        if self.best is not None and avg <= self.best["val/avg"]:
            return False
        if result.weights is None and result.version != 0:
            # the engines received θ by NCCL/IPC/gloo: no host copy to save. θ_v's checkpoint, if
            # one was written (before θ_v was published, so before its validation), holds it
            path = self._checkpointed(result.version)
        elif result.weights is None:
            path = self.model_path
        else:
            save_weights(self.path, result.weights, self.model_path)
            path = str(self.path)
        self.best = {"version": result.version, "val/avg": avg, "path": path}
        self._write()
        return True

    def _model_dir(self, version: int) -> Path:
        return step_dir(self.run_dir, version) / "model"

    def _checkpointed(self, version: int) -> str | None:
        model = self._model_dir(version)
        return str(model) if model.is_dir() else None

    def _write(self) -> None:
        (self.run_dir / "best.json").write_text(json.dumps(self.best, indent=1))

    def saved(self, version: int) -> None:
        """A checkpoint of θ_version was written (`Checkpointer.on_saved`): name its model directory
        if θ_version is the best and no copy of it exists (the final version's checkpoint comes
        after its validation)."""
        if self.best is not None and self.best["version"] == version and self.best["path"] is None:
            self.best["path"] = self._checkpointed(version)
            self._write()

    def protected(self) -> int | None:
        """The version whose checkpoint must outlive `trainer.keep_checkpoints` (`Checkpointer.protect`):
        the best's, when its checkpoint is the only copy of its weights."""
        if self.best is not None and self.best["path"] == str(self._model_dir(self.best["version"])):
            return self.best["version"]
        return None

    def summary(self) -> dict:
        return {"best": self.best, "best_within": self.within, "validations": self.history}

    def state_dict(self) -> dict:
        return {"best": self.best, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.history = state["best"], list(state["history"])


class Validations:
    """Finished in-training validations on the trainer side: each is offered to the best
    checkpoint on arrival and logged in the next step's row (one per row, so a wandb step never
    holds two)."""

    def __init__(self, rollout, best: BestCheckpoint, k: int, final_version: int):
        self.rollout, self.best, self.k = rollout, best, k
        self.final_version = final_version
        self._rows: list[dict] = []

    def poll(self) -> None:
        from tqdm import tqdm

        for result in self.rollout.drain_validations():
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
