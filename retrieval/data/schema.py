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

from typing import get_args

from retrieval.config import TableFormat
from retrieval.errors import UserError

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
