"""The encoder graph's token embedding table, as the graph file declares it: its dtype and shape.

Read from the protobuf wire format directly (only the fields needed: ModelProto.graph,
GraphProto.node and .initializer, NodeProto.op_type and .input, TensorProto.dims, .data_type
and .name): the onnx package is not a serving dependency and its import costs a serving process
~9.5 MiB. The table's values are never read here: a bundle's table is in encoder.onnx.data
(format 2), or is a raw_data field skipped by its length (format 1), in a file mapped, not read.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

# onnx.TensorProto.DataType's values, by the numpy name of the dtype.
TENSOR_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
                 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}
_MODEL_GRAPH, _GRAPH_NODE, _GRAPH_INITIALIZER = 7, 1, 5
_NODE_INPUT, _NODE_OP_TYPE = 1, 4
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME = 1, 2, 8
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class EmbeddingTable(NamedTuple):
    name: str
    dtype: str  # a numpy dtype name, or "type N" for a TensorProto type it has none for
    shape: tuple[int, ...]


def embedding_table(path: str | Path) -> EmbeddingTable:
    """The initializer the graph's Gather reads token rows from; ValueError when the file is not
    a graph, or no Gather reads an initializer."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        error = ""
        try:
            table = _gathered_table(memoryview(mapped))
        except ValueError as exc:  # said outside: its traceback holds views of the map
            error = str(exc)
    if error:
        raise ValueError(error)
    return table


def _gathered_table(model: memoryview) -> EmbeddingTable:
    graphs = [v for field, v in _fields(model) if field == _MODEL_GRAPH]
    if not graphs:
        raise ValueError("no graph in the model")
    gathered, tables = set(), {}
    for field, value in _fields(graphs[-1]):
        if field == _GRAPH_NODE:
            op, inputs = _node(value)
            if op == "Gather" and inputs:
                gathered.add(inputs[0])
        elif field == _GRAPH_INITIALIZER:
            table = _tensor(value)
            tables[table.name] = table
    found = [tables[name] for name in sorted(gathered) if name in tables]
    if not found:
        raise ValueError("no Gather of an initializer (the token embedding table) in the graph")
    return found[0]


def _node(message: memoryview) -> tuple[str, list[str]]:
    op, inputs = "", []
    for field, value in _fields(message):
        if field == _NODE_OP_TYPE:
            op = bytes(value).decode()
        elif field == _NODE_INPUT:
            inputs.append(bytes(value).decode())
    return op, inputs


def _tensor(message: memoryview) -> EmbeddingTable:
    name, data_type, dims = "", 0, []
    for field, value in _fields(message):
        if field == _TENSOR_NAME:
            name = bytes(value).decode()
        elif field == _TENSOR_DATA_TYPE:
            data_type = int(value)
        elif field == _TENSOR_DIMS:
            dims.extend(_packed(value) if isinstance(value, memoryview) else [int(value)])
    return EmbeddingTable(name, TENSOR_DTYPES.get(data_type, f"type {data_type}"), tuple(dims))


def _fields(message: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each field of one message: varints as int, the rest as views."""
    pos, end = 0, len(message)
    while pos < end:
        key, pos = _varint(message, pos)
        wire = key & 7
        if wire == _VARINT:
            value, pos = _varint(message, pos)
        else:
            if wire == _LENGTH:
                size, pos = _varint(message, pos)
            elif wire in (_FIXED64, _FIXED32):
                size = 8 if wire == _FIXED64 else 4
            else:
                raise ValueError(f"protobuf wire type {wire} at byte {pos}")
            if pos + size > end:
                raise ValueError("truncated protobuf field")
            value, pos = message[pos : pos + size], pos + size
        yield key >> 3, value


def _packed(data: memoryview) -> list[int]:
    out, pos = [], 0
    while pos < len(data):
        value, pos = _varint(data, pos)
        out.append(value)
    return out


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or overlong protobuf varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
