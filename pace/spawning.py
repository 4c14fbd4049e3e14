"""Spawned helper processes that do not run the parent's main script again.

A process started by multiprocessing's ``spawn`` first runs its parent's main script once more, as
``__mp_main__``, so that what the script defines can be unpickled in it
(``multiprocessing.spawn.get_preparation_data`` names the script, from ``__main__``'s ``__spec__`` or
``__file__``, as the process starts). For `train.py` and `eval.py` that is torch, transformers, accelerate
and vLLM: 15-20 s of CPU and a few hundred MB for each grading worker and stream reader, which run pace
modules only. Started inside `without_main()`, a process is told of no main script and imports only what
its target needs.
"""
from __future__ import annotations

import contextlib
import sys
import threading

_lock = threading.Lock()
_MISSING = object()


@contextlib.contextmanager
def without_main():
    """While it holds, processes spawned (by this thread; others wait on starting theirs here) are not
    given the main script. Its targets must be importable (defined in a module, not in the script)."""
    with _lock:
        main = sys.modules["__main__"]
        spec, path = main.__dict__.get("__spec__"), main.__dict__.get("__file__", _MISSING)
        main.__spec__ = None
        main.__dict__.pop("__file__", None)
        try:
            yield
        finally:
            main.__spec__ = spec
            if path is not _MISSING:
                main.__file__ = path
