"""Rollout: the in-process vLLM engine (``engine``) and the thread that drives it (``worker``)."""
