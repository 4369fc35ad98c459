"""Opening a Parquet file from outside this process (a Parquet corpus, shards from `data.shards`,
an unfinished run's quarantine parts) without running code from it: the footer's schema is checked
before any row is read. Ray's pickled-object extension type (registered by importing ray.data) is
unpickled when a row becomes Python, so no extension type is read at all, and each column vitp
reads must have a type it expects. Reads no row; docs/security.md lists every reader."""
from __future__ import annotations

import os
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError

# Ray's opt-in for files its 2.49-2.54 releases wrote: with it set, Ray's tensor types unpickle
# their metadata while the schema itself is read, before any check could look at it.
RAY_PICKLED_METADATA_ENV = "RAY_DATA_AUTOLOAD_CLOUDPICKLE_TENSOR_METADATA"
_EXTENSION_KEY = b"ARROW:extension:name"  # how a file marks an extension type this process does not know


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_bytes(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


def _is_image(t: pa.DataType) -> bool:
    """Encoded image bytes, or a Hugging Face image struct {bytes, path}."""
    if pa.types.is_struct(t):
        i = t.get_field_index("bytes")
        return i >= 0 and _is_bytes(t.field(i).type) and all(
            _is_bytes(f.type) or _is_text(f.type) for f in (t.field(j) for j in range(t.num_fields)))
    return _is_bytes(t)


# What a column vitp reads may hold: a name in the `columns` argument -> (test, words for a message)
KINDS: dict[str, tuple[Any, str]] = {
    "image": (_is_image, "binary (encoded image bytes) or a struct {bytes, path}"),
    "bytes": (_is_bytes, "binary"),
    "text": (_is_text, "string"),
    "int": (pa.types.is_integer, "integer"),
    "label": (lambda t: _is_text(t) or pa.types.is_integer(t), "string or integer"),
}


def _extension_in(field: pa.Field) -> str:
    """The name of the extension type `field` is or holds anywhere inside, or ""."""
    t = field.type
    if isinstance(t, pa.BaseExtensionType):
        return t.extension_name
    if field.metadata and _EXTENSION_KEY in field.metadata:
        return field.metadata[_EXTENSION_KEY].decode("utf-8", "replace")
    if pa.types.is_dictionary(t):  # its values' type is no field: look at it as one
        return _extension_in(pa.field("values", t.value_type))
    for i in range(t.num_fields):  # lists, structs, maps
        found = _extension_in(t.field(i))
        if found:
            return found
    return ""


def check_schema(schema: pa.Schema, path: str, columns: Mapping[str, str]) -> None:
    """InputError naming `path` and the column if any column is or holds an extension type, or a
    column named in `columns` (name -> a KINDS key) that the file has is of another type."""
    for field in schema:
        ext = _extension_in(field)
        if ext:
            raise InputError(
                f"{path}: column {field.name!r} has the Arrow extension type {ext[:80]!r}, whose values "
                "a reader may turn into objects by running code (Ray's pickled objects do); refusing the "
                "file: write it with plain types (binary images, string or integer labels)")
    for name, kind in columns.items():
        i = schema.get_field_index(name)
        test, words = KINDS[kind]
        if i >= 0 and not test(schema.field(i).type):
            raise InputError(f"{path}: column {name!r} is {schema.field(i).type}, expected {words}; "
                             "write the file with the types vitp reads")


def open_parquet(f: Any, path: str, columns: Mapping[str, str]) -> pq.ParquetFile:
    """A ParquetFile over the open file `f` whose schema passed check_schema (`path` names it in
    errors); the caller may then read the columns it checked."""
    if os.environ.get(RAY_PICKLED_METADATA_ENV, "").strip().lower() not in ("", "0", "false"):
        raise InputError(f"{path}: not opened while {RAY_PICKLED_METADATA_ENV} is set: with it, Ray unpickles "
                         "what a Parquet file's schema holds as it is read; unset it")
    pf = pq.ParquetFile(f)
    check_schema(pf.schema_arrow, path, columns)
    return pf
