"""The run's exceptions that cross modules: bad input (one line naming the key or the file) and
run failures. Imports nothing, so any module may raise them and the entry points (train.py,
eval.py, simulate.py) catch them before vLLM or torch.distributed are loaded.
"""


class ConfigError(ValueError):
    """A config that cannot work. The message names the key(s)."""


class DataError(ValueError):
    """Unreadable data: the message names the file or dataset."""


class RolloutError(RuntimeError):
    """The rollout thread died; the message carries its traceback."""


class EngineFailed(RuntimeError):
    """A rollout engine failed and the run does not go on without it (`rollout.on_engine_failure`)."""


class StoppedWithRank0(RuntimeError):
    """Trainer ranks ≥ 1 of a run whose rank 0 stopped (its rollout failed, the final validation could
    not run): they write the checkpoint with it and stop. ``why``: rank 0's cause, in one line."""

    def __init__(self, why: str):
        super().__init__(f"stopped with trainer rank 0 ({why}); checkpointed: resume= goes on")
        self.why = why


class UserError(Exception):
    """Bad input that is not one config key's value (no GPU for a GPU preset, a model that cannot be
    found): printed as one line, exit status 2."""


class UpdateFailed(RuntimeError):
    """A weight update that did not reach the engines, on every trainer rank: the run stops with a
    checkpoint (`resume=` publishes θ again). ``why``: rank 0's cause, in one line."""

    def __init__(self, version: int, why: str):
        super().__init__(f"the weight update to θ_{version} failed: {why}; checkpointed: resume= goes on")
        self.version, self.why = version, f"weight update failed: {why}"
