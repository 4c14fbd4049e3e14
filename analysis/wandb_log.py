"""Read an offline wandb run from its transaction log (``run-<id>.wandb``), without wandb's service.

wandb ≥ 0.19 reads these files only inside its Go core (``wandb sync``), so this module parses
them directly. The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic ``0xBEE1``, version
0), then 32 KiB blocks of chunks, each ``crc32c (4) | length (2, LE) | type (1) | data``, where
type 1 is a whole record and 2 / 3 / 4 are the first / middle / last piece of one that spans
blocks; a block's tail shorter than a chunk header is zero padding. Each record is a
``wandb.proto.wandb_internal_pb2.Record``; history, summary and config items carry JSON values.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbLogError(ValueError):
    """Not a wandb transaction log, or a damaged one (the message says where)."""


def records(path: str | Path):
    """The serialized records of a ``.wandb`` file, in order. A torn final record (the writer was
    killed mid-write) ends the scan; damage anywhere else raises `WandbLogError`."""
    data = Path(path).read_bytes()
    if not data.startswith(HEADER):
        raise WandbLogError(f"{path}: not a wandb transaction log (bad header)")
    pos, pending = len(HEADER), None
    while pos + CHUNK_HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK_HEADER:  # zero padding to the next block
            pos += room
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:  # zero fill (pre-allocated tail)
            pos += room
            continue
        start, end = pos + CHUNK_HEADER, pos + CHUNK_HEADER + length
        if end > len(data):
            return  # torn write at the end of the file
        if length > room - CHUNK_HEADER or kind not in (FULL, FIRST, MIDDLE, LAST):
            raise WandbLogError(f"{path}: damaged chunk at byte {pos} (type {kind}, length {length})")
        piece = data[start:end]
        pos = end
        if kind == FULL:
            yield piece
        elif kind == FIRST:
            pending = bytearray(piece)
        elif pending is None:
            raise WandbLogError(f"{path}: continuation chunk without a first piece at byte {start}")
        else:
            pending += piece
            if kind == LAST:
                yield bytes(pending)
                pending = None


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    id: str
    history: list[dict] = field(default_factory=list)  # one dict per logged step, `_step` included
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    group: str | None = None
    name: str | None = None


def read_run(path: str | Path) -> OfflineRun:
    """History rows, summary and config of one offline run (its ``.wandb`` file or its directory)."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    if path.is_dir():
        logs = sorted(path.glob("run-*.wandb"))
        if not logs:
            raise WandbLogError(f"{path}: no run-*.wandb file")
        path = logs[0]
    run = OfflineRun(id=path.stem.removeprefix("run-"))
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for i in rec.summary.update:
                run.summary[_key(i)] = json.loads(i.value_json)
            for i in rec.summary.remove:
                run.summary.pop(_key(i), None)
        elif kind == "config":
            for i in rec.config.update:
                run.config[_key(i)] = json.loads(i.value_json)
        elif kind == "run":
            run.group = rec.run.run_group or run.group
            run.name = rec.run.display_name or run.name
            for i in rec.run.config.update:
                run.config[_key(i)] = json.loads(i.value_json)
    return run
