"""Canonical column names of a click log and the error raised for bad input data.

Every loader, generator and split returns clicks in one shape, so later stages
never see the names used in the user's files:

=============  =======  =====================================================
column         dtype    meaning
=============  =======  =====================================================
``user_id``    str      user id; ids are always strings (``"196"``)
``item_id``    str      item id
``timestamp``  int64    seconds since the Unix epoch, UTC; only present when
                        the log has a time column
``weight``     float32  per-click weight (a rating, dwell time); 1.0 when the
                        log has no weight column
=============  =======  =====================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, get_args

import pyarrow as pa

from retrieval.common.errors import UserError
from retrieval.config import TableFormat

USER = "user_id"
ITEM = "item_id"
TIME = "timestamp"
WEIGHT = "weight"

# The one list of formats: every reader, refusal and message reads it.
TABLE_FORMATS: tuple[str, ...] = tuple(fmt for fmt in get_args(TableFormat) if fmt != "auto")
FORMAT_BY_EXTENSION = {  # what format: auto reads a file as
    ".csv": "csv",
    ".tsv": "tsv",
    ".txt": "tsv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".dat": "movielens-1m",
    ".data": "movielens-100k",
}
SHARD_FORMATS = ("parquet", "csv", "tsv")  # read by ``shards.ClickShards``, whole or streamed; feature tables too
assert set(FORMAT_BY_EXTENSION.values()) | set(SHARD_FORMATS) <= set(TABLE_FORMATS)

# Compressed text files are read as their decompressed text. The compression is told by the file's
# first bytes (a gzip log named clicks.csv reads too); its extension only hides the format's
# extension from format: auto (clicks.csv.gz is csv).
COMPRESSION_EXTENSIONS = {".gz": "gzip", ".gzip": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}
_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh", "bz2"),  # followed by the block size digit and the block magic (checked below)
)


def format_suffix(path: str) -> str:
    """The lower-case extension naming a file's format, a compression extension skipped
    (``clicks.csv.gz`` -> ``.csv``)."""
    name = Path(path)
    suffix = name.suffix.lower()
    if suffix in COMPRESSION_EXTENSIONS:
        suffix = Path(name.stem).suffix.lower()
    return suffix


def compression_of_bytes(head: bytes) -> str | None:
    """``"gzip"``, ``"zstd"`` or ``"bz2"`` when ``head`` (a file's first bytes) starts a compressed stream."""
    for magic, codec in _MAGIC:
        if head.startswith(magic):
            if codec == "bz2" and not (head[3:4].isdigit() and head[4:10] == b"\x31\x41\x59\x26\x53\x59"):
                continue  # a text file that happens to start with "BZh"
            return codec
    return None


def compression_of(file: str) -> str | None:
    """The compression of ``file`` by its magic bytes, or None for a plain file."""
    try:
        with open(file, "rb") as handle:
            return compression_of_bytes(handle.read(10))
    except OSError:
        return None


def open_data(file: str) -> IO[bytes]:
    """``file``'s bytes, decompressed when it is gzip, zstd or bz2 (by its magic bytes)."""
    codec = compression_of(file)
    if codec is None:
        return open(file, "rb")
    return pa.input_stream(file, compression=codec)  # a file-like NativeFile


def read_data(file: str) -> bytes:
    """All of ``file``'s bytes, decompressed (``open_data``); a corrupt compressed file is a DataError."""
    try:
        with open_data(file) as handle:
            return handle.read()
    except (OSError, pa.ArrowException) as error:
        if compression_of(file) is None:
            raise
        raise DataError(f"cannot decompress the {compression_of(file)}-compressed file: {error}", file=file) from None


class DataError(UserError, ValueError):
    """Input data cannot be used; the message says where the problem is.

    The message starts with the location when it is known, e.g.
    ``clicks.csv, line 7, column 'weight': not a number: 'abc'``. Lines are
    1-based and count every line as a text editor does (the header included);
    parquet files have no lines, so their location is a 1-based ``row``.

    Attributes:
        file: Path of the offending file, or None.
        line: 1-based line number in a text file, or None.
        row: 1-based data row in a parquet file, or None.
        column: Column name as spelled in the file, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        row: int | None = None,
        column: str | None = None,
    ) -> None:
        self.file, self.line, self.row, self.column = file, line, row, column
        place = [str(file)] if file is not None else []
        if line is not None:
            place.append(f"line {line}")
        if row is not None:
            place.append(f"row {row}")
        if column is not None:
            place.append(f"column {column!r}")
        # Only the formatted text goes to ValueError, so the exception pickles
        # and re-raises with the same message.
        super().__init__(f"{', '.join(place)}: {message}" if place else message)
