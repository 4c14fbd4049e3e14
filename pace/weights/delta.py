"""Delta weight sync, the trainer's side: which elements of θ_v the engines do not hold yet.

    tracker = DeltaTracker(model, dtype, full_every, max_frac)   # every trainer rank
    plan = tracker.plan(version)     # every rank (a collective under FSDP): full, or rank 0's patches
    ... the plan is sent (pace/weights/gloo.py, nccl_delta.py) ...
    tracker.sent(plan)               # every rank: the engines hold θ_version from here on

After a full sync the engines hold the trainer's cast θ_v exactly (pace/weights/reload.py). The next
version differs from it in few elements at RL learning rates (a step of AdamW at lr 1e-6 moves each
fp32 master, but most bf16 casts keep their bits), so a sync can send only the elements whose
*engine-dtype* value changed, as sparse patches in checkpoint coordinates (name, flat indices,
values, full shape: vLLM 0.32's `SparseWeightPatch`). The comparison is of the casts' bits, not of
the fp32 masters (every master moves; a cast that keeps its bits need not be sent) and not of their
values (−0.0 == +0.0, NaN != NaN): the engine must end bit-equal to the trainer's cast.

Each rank diffs its own shard (an FSDP2 `DTensor` sharded on dim 0, or a whole tensor): it keeps
the cast of its shard as of the last version sent in host memory (one engine-dtype copy of its
shard, pinned on a GPU machine; nothing on the device between syncs), finds the changed elements
one tensor at a time on the parameter's device, and only those (flat indices in the whole tensor,
values) are gathered to rank 0 — no parameter is all-gathered. The fingerprint of each whole tensor
(pace/weights/fingerprint.py) is a position-weighted sum of its bits, so its change is the sum
over the changed elements of (new bits − old bits) · weight: every rank adds its own, rank 0 gets
the total, and the exact weight check compares the engines against θ_v without a full pass.

A plan is a full sync when the engines hold nothing the tracker knows of (the first sync, a
resume, an engine that joined: `reset()`), every `full_every` versions, or when more than
`max_frac` of the elements changed (None: where the bytes break even — a patch element costs an
int32 index and its value, a dense one its value: 1/3 in bf16, 1/2 in fp32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pace.weights import fingerprint, source

INDEX_BYTES = 4  # int32 flat indices (vLLM's sparse patches): whole tensors under 2^31 elements


@dataclass
class Patch:
    """The changed elements of one whole tensor, in its checkpoint coordinates."""

    name: str
    indices: torch.Tensor  # int32, flat positions in the whole tensor, ascending
    values: torch.Tensor  # 1-D, the engine dtype
    full_shape: tuple[int, ...]


@dataclass
class Plan:
    """One sync: full (send every tensor) or the patches (rank 0's; empty elsewhere)."""

    version: int
    full: bool
    reason: str  # why full ("first", "every", "changed", "reset"), or "delta"
    changed: int | None = 0  # elements whose cast changed since the engines' version (every rank's total;
    # None: unknown, the engines' version is)
    total: int = 0  # elements of θ
    patches: list[Patch] = field(default_factory=list)
    prints: dict[str, int] | None = None  # rank 0: θ_version's fingerprints (a delta's, from the change)
    # rank 0, a delta with fingerprints: per patch, θ_base's fingerprint terms at its positions — what an
    # engine worker patching in place needs to advance its own fingerprints of θ_base (pace/weights/inplace.py)
    base_sums: list[int] | None = None
    value_bytes: int = 4

    @property
    def changed_frac(self) -> float | None:
        return None if self.changed is None else self.changed / self.total if self.total else 0.0

    @property
    def bytes(self) -> int:
        """Bytes on the wire to each engine worker: every tensor (full), or indices and values."""
        if self.full:
            return self.total * self.value_bytes
        return self.changed * (INDEX_BYTES + self.value_bytes)


@dataclass
class _Entry:
    """One tensor in a plan, on this rank: what it reports (nothing where another rank does)."""

    name: str
    shape: tuple[int, ...]
    offset: int  # flat position of this rank's shard in the whole tensor
    positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # in the shard
    values: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    print_change: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))


def break_even(dtype: torch.dtype) -> float:
    """The changed fraction above which a full sync sends fewer bytes than patches."""
    size = torch.empty((), dtype=dtype).element_size()
    return size / (size + INDEX_BYTES)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (compared bit for bit)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, ascending) where ``new``'s bits differ from ``old``'s."""
    return torch.nonzero(bits(old.reshape(-1)) != bits(new.reshape(-1))).reshape(-1)


def local_shard(p: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """``p``'s local part, the flat position in the whole tensor where it starts, and whether this
    rank is the one that reports it: a `DTensor` sharded on dim 0 (FSDP2; HSDP replicates the shards
    over a mesh dimension, reported by its replica 0), or a plain tensor (whole on every rank without
    FSDP: reported by rank 0), so that each element is gathered once."""
    if not hasattr(p, "to_local"):
        import torch.distributed as dist

        return p, 0, not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(p.placements)
    if not all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in placements):
        raise NotImplementedError(f"delta weight sync: a parameter sharded as {placements} (only dim 0, FSDP2's)")
    mesh = p.device_mesh
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    primary = all(c == 0 for c, pl in zip(coords, placements) if isinstance(pl, Replicate))
    _, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    return p.to_local(), (offset[0] if offset else 0) * math.prod(p.shape[1:]), primary


class DeltaTracker:
    """The cast θ of the last version sent, as this rank's shards in host memory, and the plan of
    each next sync. One engine-dtype copy of the shard on the host (`held_bytes`), nothing on the
    device between syncs: a plan moves one tensor of it at a time to the parameter's device."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, full_every: int = 0,
                 max_frac: float | None = None, fingerprints: bool = True, group=None):
        self.model, self.dtype = model, dtype
        self.fingerprints = fingerprints  # the same on every rank: each adds its change to rank 0's
        self.full_every = full_every
        self.max_frac = break_even(dtype) if max_frac is None else max_frac
        self.group = group  # the trainer ranks' process group (None: the default one, if initialised)
        self._held: dict[str, torch.Tensor] = {}  # name → the cast of its shard at `_held_version`, on the host
        self._held_version: int | None = None  # the last version sent (the trainer's; None: none yet)
        self._version: int | None = None  # the version the engines hold (None: unknown → whole)
        self._last_full: int | None = None
        # a plan's changes until it is sent: (version, name → (shard positions, values) or the whole cast)
        self._pending: tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor] | torch.Tensor]] | None = None
        self.prints: dict[str, int] | None = None  # rank 0: the engines' version's fingerprints

    @property
    def held_bytes(self) -> int:
        """This rank's host memory for the last version's cast (one engine-dtype copy of its shards)."""
        return sum(t.numel() * t.element_size() for t in self._held.values())

    @property
    def version(self) -> int | None:
        """The version the engines hold (None: unknown, the next sync is whole)."""
        return self._version

    def reset(self) -> None:
        """The engines' weights are unknown (an engine joined, an update failed): the next sync is
        whole. A plan made already stays θ of its version (`whole`)."""
        self._version, self.prints = None, None

    def whole(self, plan: Plan) -> Plan:
        """``plan`` sent as every tensor (the engines' version became unknown after it was made)."""
        return Plan(plan.version, True, "reset", changed=plan.changed, total=plan.total, value_bytes=plan.value_bytes)

    def plan(self, version: int) -> Plan:
        """Every rank: what the sync of θ_version sends. A delta gathers the changed elements to
        rank 0 (a collective a tensor), where the plan holds them as patches with θ_version's
        fingerprints. The device holds one tensor's cast and diff at a time; what changed waits in
        host memory until the sync is sent (positions and values, or the whole cast where that is
        smaller)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        known = self._held_version is not None
        total, pending, entries, nans = 0, {}, [], torch.zeros((), dtype=torch.int64)
        with torch.no_grad():
            for name, p in source.named_parameters(self.model):
                if p.numel() >= 2**31:
                    raise NotImplementedError(f"delta weight sync: {name} has {p.numel()} elements, beyond int32 "
                                              "flat indices (vLLM's sparse patches)")
                total += p.numel()
                shard, offset, primary = local_shard(p.detach())
                entry = _Entry(name, tuple(p.shape), offset)
                entries.append(entry)
                if not primary:  # another rank reports this tensor's elements
                    continue
                cast = shard.to(self.dtype).reshape(-1)
                if not known:  # the first sync: the whole cast is the baseline
                    pending[name] = _host_copy(cast)
                    continue
                old = self._held[name].to(cast.device, non_blocking=True)
                pos = changed_positions(old, cast)
                new = cast[pos]
                nans += torch.isnan(new).sum().cpu()
                if self.fingerprints:
                    entry.print_change = fingerprint.change_at(pos + offset, old[pos], new).cpu()
                entry.positions, entry.values = pos.to(torch.int32).cpu(), new.cpu()
                small = len(pos) * (INDEX_BYTES + size) < cast.numel() * size
                pending[name] = (entry.positions, entry.values) if small else _host_copy(cast)
        self._pending = (version, pending)
        if not known:
            return Plan(version, True, "first", changed=None, total=total, value_bytes=size)
        counts = torch.tensor([len(e.positions) for e in entries] + [int(nans)], dtype=torch.int64)
        summed = _all_sum(counts, self.group)
        changed, nan = int(summed[:-1].sum()), int(summed[-1])
        reason = ("reset" if self._version is None  # the engines' weights are unknown (a group formed again)
                  else "every" if self.full_every and self._last_full is not None
                  and version - self._last_full >= self.full_every
                  else "changed" if changed > self.max_frac * total
                  else "nan" if nan  # NaN marks "unchanged" in vLLM's patches: sent whole
                  else None)
        if reason is not None:
            return Plan(version, True, reason, changed=changed, total=total, value_bytes=size)
        plan = Plan(version, False, "delta", changed=changed, total=total, value_bytes=size)
        change = _all_sum(torch.stack([e.print_change for e in entries]), self.group) if entries else None
        for entry, (pos, vals) in zip(entries, _gather(entries, self.dtype, self.group)):
            if pos is not None and len(pos):
                order = torch.argsort(pos)
                plan.patches.append(Patch(entry.name, pos[order].to(torch.int32), vals[order], entry.shape))
        if self.fingerprints and self.prints is not None and _rank(self.group) == 0:
            plan.prints = {e.name: self.prints[e.name] + int(c) for e, c in zip(entries, change.tolist())}
            # θ_v − θ_base = (new terms) − (old terms) at the changed positions: the old, from the other two
            new = torch.stack([fingerprint.terms_at(p.indices, p.values) for p in plan.patches]).tolist() \
                if plan.patches else []
            plan.base_sums = [self.prints[p.name] + t - plan.prints[p.name] for p, t in zip(plan.patches, new)]
        return plan

    def sent(self, plan: Plan, prints: dict[str, int] | None = None) -> None:
        """Every rank, once the engines hold θ_plan.version: its casts become the baseline.
        ``prints``: rank 0's fingerprints of a full sync's tensors (the delta's are in the plan)."""
        if self._pending is None or self._pending[0] != plan.version:
            raise RuntimeError(f"delta weight sync: sent({plan.version}) without its plan")
        for name, change in self._pending[1].items():
            if isinstance(change, tuple):
                pos, vals = change
                self._held[name].index_copy_(0, pos.long(), vals)
            else:
                self._held[name] = change
        self._held_version = self._version = plan.version
        self._pending = None
        if plan.full:
            self._last_full = plan.version
        self.prints = prints if plan.full else plan.prints

    def failed(self) -> None:
        """The sync of the last plan failed: the engines' weights are unknown, the plan dropped."""
        self._pending = None
        self.reset()


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to host memory (pinned when it comes from a GPU: the next plan reads it back)."""
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def _distributed(group) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _all_sum(t: torch.Tensor, group) -> torch.Tensor:
    if not _distributed(group):
        return t
    import torch.distributed as dist

    device = _collective_device(group)
    out = t.to(device)
    dist.all_reduce(out, group=group)
    return out.cpu()


def _collective_device(group) -> torch.device:
    import torch.distributed as dist

    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")


def _rank(group) -> int:
    return torch.distributed.get_rank(group) if _distributed(group) else 0


def _gather(entries: list, dtype: torch.dtype, group) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Each tensor's changed elements from every rank — (positions in the whole tensor, int64;
    values) — on rank 0 ((None, None) elsewhere): one gather a tensor that changed anywhere, padded
    to the rank with most, through the collective's device one tensor at a time."""
    if not _distributed(group):
        return [(e.positions.long() + e.offset, e.values) for e in entries]
    import torch.distributed as dist

    device = _collective_device(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    counts = torch.tensor([len(e.positions) for e in entries], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts, group=group)
    per_rank = torch.stack(all_counts).cpu()  # [world, tensors]
    out = []
    for i, e in enumerate(entries):
        width = int(per_rank[:, i].max())
        if width == 0:
            out.append((torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=dtype)) if rank == 0 else (None, None))
            continue
        n = len(e.positions)
        pos = torch.zeros(width, dtype=torch.int64, device=device)
        vals = torch.zeros(width, dtype=dtype, device=device)
        pos[:n] = e.positions.to(device).long() + e.offset
        vals[:n] = e.values.to(device)
        pos_list = [torch.empty_like(pos) for _ in range(world)] if rank == 0 else None
        val_list = [torch.empty_like(vals) for _ in range(world)] if rank == 0 else None
        dist.gather(pos, pos_list, dst=0, group=group)
        dist.gather(vals, val_list, dst=0, group=group)
        if rank != 0:
            out.append((None, None))
            continue
        sizes = per_rank[:, i].tolist()
        out.append((torch.cat([t[:k] for t, k in zip(pos_list, sizes)]), torch.cat([t[:k] for t, k in zip(val_list, sizes)])))
    return out
