"""The input checks that read only file headers, made before TensorFlow loads.

A config whose files lack a column it names fails in a second or two, naming the key to set,
instead of after TensorFlow's start-up and the read of the whole log (the job makes the same
checks again as it reads, so nothing here is needed for correctness).
"""

from __future__ import annotations

import glob
from pathlib import Path

import pyarrow.parquet as pq

from retrieval.config import Config, TableConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT, DataError, resolve_format
from retrieval.data.schema import SHARD_FORMATS
from retrieval.data.shards import ClickShards, TextLayout, require_columns
from retrieval.features.tables import missing_feature_column

_SEPARATOR = {"csv": ",", "tsv": "\t"}


def check_inputs(config: Config) -> None:
    """Raise the ``DataError`` the job would raise for a missing file, click column, feature-table id
    column or tower feature column, reading only headers (``data.source: files``; other sources hold
    known columns)."""
    data = config.data
    if data.source != "files":
        return
    available = {USER, ITEM, TIME, WEIGHT}
    known = True  # every table's columns are in ``available``
    for table in (data.clicks, data.test_clicks):
        if table is None:
            continue
        if not _by_arrow(table):
            known = False  # a format read another way: the job checks it as it reads
            continue
        shards = ClickShards.open(table, data.columns)  # every shard's header holds the data.columns
        available |= set(_header(TableConfig(**{**table.model_dump(), "path": shards.files[0]}))[0])
    for table, id_column, key in (
        (data.item_features, data.item_id_column, "data.item_id_column"),
        (data.user_features, data.user_id_column, "data.user_id_column"),
    ):
        if table is None:
            continue
        if not _by_arrow(table):
            known = False
            continue
        names, layout = _header(table)
        require_columns([id_column], names, table.path, text=layout, keys={id_column: key})
        available |= set(names)
    if not known:
        return
    for side, tower in (("query", config.towers.query), ("doc", config.towers.doc)):
        for feature in tower.features:
            if feature.column not in available:
                raise DataError(missing_feature_column(feature.name, feature.column, side, sorted(available)))


def _by_arrow(table: TableConfig) -> bool:
    if table.format == "auto" and (Path(table.path).is_dir() or glob.has_magic(table.path)):
        return True  # shards: ClickShards tells each one's format by its extension
    fmt = resolve_format(table)
    return fmt in SHARD_FORMATS and (fmt == "parquet" or len(table.separator or _SEPARATOR[fmt]) == 1)


def _header(table: TableConfig) -> tuple[list[str], TextLayout | None]:
    fmt = resolve_format(table)
    if fmt == "parquet":
        try:
            return list(pq.read_schema(table.path).names), None
        except FileNotFoundError:
            raise DataError("file not found", file=table.path) from None
        except Exception as error:  # pyarrow raises several unrelated types for bad files
            raise DataError(f"not a readable parquet file: {error}", file=table.path) from None
    layout = TextLayout(table.separator or _SEPARATOR[fmt], table.header, table.encoding)
    try:
        return layout.start(table.path)[1], layout
    except FileNotFoundError:
        raise DataError("file not found", file=table.path) from None
