"""The distinct rows of an arrow table on some of its columns, found on the columns: each value
column is dictionary-encoded (arrow's hashing) to integer codes, and the codes of the columns are
combined with numpy. No row becomes a Python object, so a file that repeats its rows 100 times
(BytedTsinghua-SIA/DAPO-Math-17k) costs a few hashing passes, not 1.79 M dicts.

A struct column counts by all its fields; a list column by its first element only (what the math
loader reads of a chat list), with a null list and an empty one as values of their own. Columns of
other nested types raise arrow's ArrowNotImplementedError from the encoding.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NULL, EMPTY = -1, -2  # the codes of a null value and of an empty list


def distinct_rows(table: pa.Table, columns: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """The first row of each distinct combination of values of `columns` (those the table has), in
    table order, and how many rows each stands for."""
    if table.num_rows == 0:
        return [], []
    code = np.zeros(table.num_rows, dtype=np.int64)  # equal codes ⇔ equal on the columns so far
    for name in columns:
        if name not in table.column_names:
            continue
        for codes in _codes(table.column(name)):
            code = code * (int(codes.max()) + 3) + (codes - EMPTY)  # < rows × (values + 3): no overflow
            code = np.unique(code, return_inverse=True)[1].reshape(-1)  # dense again before the next one
    _, first, counts = np.unique(code, return_index=True, return_counts=True)
    order = np.argsort(first)
    return first[order].tolist(), counts[order].tolist()


def take_rows(table: pa.Table, indices: list[int]) -> pa.Table:
    """`table.take(indices)` for ascending indices, batch by batch: arrow's take on a table of many
    chunks (a datasets arrow file has one per 1,000 rows) first concatenates them all."""
    batches = table.to_batches()
    starts = np.cumsum([0] + [b.num_rows for b in batches])
    idx = np.asarray(indices, dtype=np.int64)
    bounds = np.searchsorted(idx, starts)  # idx[bounds[k]:bounds[k + 1]] lie in batch k
    taken = [batch.take(pa.array(idx[lo:hi] - start)) for batch, start, lo, hi
             in zip(batches, starts, bounds[:-1], bounds[1:]) if hi > lo]
    return pa.Table.from_batches(taken, schema=table.schema)


def _codes(col: pa.ChunkedArray) -> list[np.ndarray]:
    """Integer codes per row, one array per leaf value: equal values, equal codes."""
    if pa.types.is_struct(col.type):
        return [c for i in range(col.type.num_fields) for c in _codes(pc.struct_field(col, [i]))]
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        return _first_element_codes(col)
    encoded = pc.dictionary_encode(col)
    if encoded.num_chunks > 1 and not _one_dictionary(encoded):
        encoded = encoded.unify_dictionaries()  # so that codes agree across chunks
    return [np.concatenate([c.indices.fill_null(NULL).to_numpy(zero_copy_only=False).astype(np.int64)
                            for c in encoded.chunks])]


def _one_dictionary(encoded: pa.ChunkedArray) -> bool:
    """Whether every chunk holds the same dictionary (arrow encodes a ChunkedArray with one memo
    table and gives each chunk the whole dictionary): unifying a file's ~1,800 chunks would hash the
    dictionary once per chunk."""
    def where(d: pa.Array) -> tuple:  # the same memory, offset and length: the same dictionary
        return (d.offset, len(d), *(b.address if b is not None else 0 for b in d.buffers()))

    first = where(encoded.chunk(0).dictionary)
    return all(where(c.dictionary) == first for c in encoded.chunks)


def _first_element_codes(col: pa.ChunkedArray) -> list[np.ndarray]:
    """The codes of each list's first element, read at the list offsets (no element is copied)."""
    values = pa.chunked_array([chunk.values for chunk in col.chunks], type=col.type.value_type)
    first, null, empty, base = [], [], [], 0
    for chunk, chunk_values in zip(col.chunks, values.chunks):
        offsets = chunk.offsets.to_numpy().astype(np.int64)
        first.append(base + offsets[:-1])
        null.append(chunk.is_null().to_numpy(zero_copy_only=False))
        empty.append(np.diff(offsets) == 0)
        base += len(chunk_values)
    first, null, empty = np.concatenate(first), np.concatenate(null), np.concatenate(empty)
    out = []
    for element_codes in _codes(values) if base else [np.zeros(1, dtype=np.int64)]:
        codes = element_codes[np.minimum(first, len(element_codes) - 1)]
        codes[empty] = EMPTY
        codes[null] = NULL
        out.append(codes)
    return out
