"""The rollout's failure, importable without the engine (train.py catches it before vLLM is loaded)."""


class RolloutError(RuntimeError):
    """The rollout thread died; the message carries its traceback."""
