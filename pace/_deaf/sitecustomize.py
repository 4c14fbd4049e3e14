"""Run at the start of every Python child of a run (pace/signals.py puts this folder first on their
PYTHONPATH): under the run's flag, the child ignores SIGTERM and SIGINT. Then the sitecustomize
this one shadows, if any. Standard library only: the child's sys.path is not the run's yet."""
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("PACE_DEAF_CHILD") == "1":
    _spec = importlib.util.spec_from_file_location("_pace_signals", os.path.join(os.path.dirname(_here), "signals.py"))
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.deafen_this_process()

_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
