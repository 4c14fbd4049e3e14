"""A paper preset rehearsed on a CPU (`+rehearsal=cpu`): the config's swaps (overlay.py) and the faults a
rehearsal injects into the run's own servers (faults.py)."""
