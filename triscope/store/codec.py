"""Values into and out of the formats chDB and the query endpoint speak, shared by the embedded store and
the store served by a daemon (:mod:`triscope.store.served`), so both decode an answer the same way."""

from __future__ import annotations

from typing import Any

from triscope.store.base import Result


def rows_of_json_compact(raw: bytes) -> Result:
    """A ``JSONCompact`` answer as a :class:`Result` (no answer: no columns, no rows)."""
    import orjson

    if not raw:
        return Result([], [])
    doc = orjson.loads(raw)
    return Result([m["name"] for m in doc["meta"]], [tuple(r) for r in doc["data"]])


def column_to_numpy(column: Any) -> Any:
    """An Arrow column as a numpy array; strings become an object array.

    Primitive columns are copied straight out of the Arrow buffer. LowCardinality text arrives
    dictionary-encoded (the connection sets ``output_format_arrow_low_cardinality_as_dictionary``)
    and is decoded as an index array into its few distinct values. Neither path imports pandas
    (pyarrow's ``to_numpy`` does, half a second) nor ``pyarrow.compute`` (~0.1 s of a short run).
    """
    import numpy as np
    import pyarrow as pa

    if column.num_chunks == 0:
        return np.array([], dtype=_NUMPY_KIND.get(str(column.type), object))
    if pa.types.is_dictionary(column.type):
        return np.concatenate([_decode_dictionary(chunk) for chunk in column.chunks])
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        if len(array) <= _PYLIST_MAX_ROWS:
            return np.array(array.to_pylist(), dtype=object)
        return _decode_dictionary(array.dictionary_encode())  # imports pyarrow.compute; fast on big columns
    out = _primitive(array)
    return out if out is not None else array.to_numpy(zero_copy_only=False)


_PYLIST_MAX_ROWS = 200_000


def _decode_dictionary(array: Any) -> Any:
    """A dictionary-encoded Arrow array as an object array of its values."""
    import numpy as np

    values = np.array(array.dictionary.to_pylist() + [None], dtype=object)
    indices = _primitive(array.indices)
    if indices is None:  # nulls: point them at the trailing None
        indices = np.asarray(array.indices.fill_null(len(values) - 1).to_numpy(zero_copy_only=False))
    return values[indices]


def _primitive(array: Any) -> Any:
    """A copy of a null-free fixed-width numeric Arrow array as numpy, or None for other arrays."""
    import numpy as np

    dtype = _NUMPY_KIND.get(str(array.type))
    if dtype is None or array.null_count:
        return None
    width = np.dtype(dtype).itemsize
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * width).copy()


_NUMPY_KIND = {"int8": "i1", "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint8": "u1", "uint16": "<u2",
               "uint32": "<u4", "uint64": "<u8", "float": "<f4", "double": "<f8", "float32": "<f4", "float64": "<f8"}


def literal(value: Any) -> str:
    """A value inside a composite parameter, in ClickHouse's text format."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(literal(v) for v in value) + "]"
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def param_text(value: Any) -> Any:
    """chDB takes top-level scalars as is; arrays and tuples need ClickHouse's text format."""
    if isinstance(value, (list, tuple)):
        return literal(list(value))
    if isinstance(value, bool):
        return int(value)
    return value


__all__ = ["column_to_numpy", "literal", "param_text", "rows_of_json_compact"]
