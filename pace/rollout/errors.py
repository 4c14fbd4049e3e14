"""The rollout's failure, importable without the engine (train.py catches it before vLLM is loaded)."""


class RolloutError(RuntimeError):
    """The rollout thread died; the message carries its traceback."""


class EngineFailed(RuntimeError):
    """A rollout engine failed and the run does not go on without it (`rollout.on_engine_failure`)."""
