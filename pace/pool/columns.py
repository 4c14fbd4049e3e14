"""The pooled groups as columns, so a policy scores and ranks the whole pool with array operations.

A pool policy runs under the pool lock every training step, over every pooled group: at 100,000
groups a Python loop over `Group` objects costs hundreds of milliseconds that the trainer waits
on. `PoolColumns` keeps what policies read per group in NumPy arrays maintained incrementally:

    k_gen      Generation Staleness (fixed at completion)
    k_kv       KV staleness K_kv ≥ K_gen (fixed at completion; PACE ranks by it under `pace.kv_aware`)
    c_mean     token-weighted mean completion version c̄, so K_wait(j) = j − c̄ (docs/design.md §2)
    completed  completion version c(group) (tie-break: older first)
    pfs        Prefix Forgetting Score, NaN until rescored
    pfs_version  weights version of that score, −1 until rescored

Groups occupy slots in arrival (completion) order. Removing a group only clears its `alive`
flag, so removal is O(1); the arrays are compacted when dead slots outnumber live ones, which
keeps memory proportional to the pool and costs O(n) once per n removals.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from pace.records import Group

_FLOAT_COLUMNS = ("k_gen", "k_kv", "c_mean", "pfs")
_INT_COLUMNS = ("completed", "pfs_version")


class PoolColumns:
    def __init__(self, capacity: int = 1024):
        self._groups: list[Group | None] = []
        self._slot: dict[int, int] = {}  # group id → slot
        self._end = 0  # slots used so far (alive or dead)
        self._alive_count = 0
        self._alive_slots: np.ndarray | None = None  # cache of the live slots, in order
        self._alloc(max(1, capacity))

    @classmethod
    def of(cls, groups: Iterable[Group]) -> PoolColumns:
        """Columns over ``groups`` in the given (completion) order: for tests and benchmarks."""
        cols = cls()
        for g in groups:
            cols.append(g)
        return cols

    # --- mutation (the pool calls these under its lock) -----------------------------------------
    def append(self, group: Group) -> None:
        if group.id in self._slot:
            raise ValueError(f"group {group.id} is already pooled")
        if self._end == len(self.alive):
            self._grow()
        i = self._end
        self._end += 1
        self._groups.append(group)
        self._slot[group.id] = i
        self.alive[i] = True
        self.k_gen[i] = group.k_gen()
        self.k_kv[i] = group.k_kv()
        self.c_mean[i] = group.completed_at - group.k_wait(group.completed_at)
        self.completed[i] = group.completed_at
        self.pfs[i] = np.nan if group.pfs is None else group.pfs
        self.pfs_version[i] = -1 if group.pfs_version is None else group.pfs_version
        self._alive_count += 1
        self._alive_slots = None

    def remove(self, group: Group) -> None:
        i = self._slot.pop(group.id)
        self.alive[i] = False
        self._groups[i] = None
        self._alive_count -= 1
        self._alive_slots = None
        if self._end - self._alive_count > max(1024, self._alive_count):
            self._compact()

    def set_pfs(self, group: Group, pfs: float, version: int) -> None:
        i = self._slot.get(group.id)
        if i is not None:  # the group may have left the pool while it was being rescored
            self.pfs[i], self.pfs_version[i] = pfs, version

    def clear(self) -> None:
        self.__init__()

    # --- reads ------------------------------------------------------------------------------------
    def slots(self) -> np.ndarray:
        """Slots of the pooled groups in completion order (index the columns with these)."""
        if self._alive_slots is None:
            self._alive_slots = np.flatnonzero(self.alive[: self._end])
        return self._alive_slots

    def groups(self, slots: Iterable[int]) -> list[Group]:
        return [self._groups[i] for i in slots]  # type: ignore[misc]

    def first(self, n: int) -> list[Group]:
        """The ``n`` oldest pooled groups (FIFO draw)."""
        return self.groups(self.slots()[:n])

    def __len__(self) -> int:
        return self._alive_count

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups(self.slots()))

    def __contains__(self, group: Group) -> bool:
        return group.id in self._slot

    # --- storage ----------------------------------------------------------------------------------
    def _alloc(self, capacity: int) -> None:
        self.alive = np.zeros(capacity, dtype=bool)
        for name in _FLOAT_COLUMNS:
            setattr(self, name, np.zeros(capacity, dtype=np.float64))
        for name in _INT_COLUMNS:
            setattr(self, name, np.zeros(capacity, dtype=np.int64))

    def _grow(self) -> None:
        old = {name: getattr(self, name) for name in ("alive", *_FLOAT_COLUMNS, *_INT_COLUMNS)}
        self._alloc(2 * len(self.alive))
        for name, arr in old.items():
            getattr(self, name)[: len(arr)] = arr

    def _compact(self) -> None:
        keep = self.slots()
        n = len(keep)
        for name in ("alive", *_FLOAT_COLUMNS, *_INT_COLUMNS):
            arr = getattr(self, name)
            arr[:n] = arr[keep]
        self.alive[n:] = False
        self._groups = [self._groups[i] for i in keep]
        self._slot = {g.id: i for i, g in enumerate(self._groups)}  # type: ignore[union-attr]
        self._end = n
        self._alive_slots = None
