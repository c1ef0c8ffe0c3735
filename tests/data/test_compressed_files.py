"""Compressed text logs and feature tables (gzip, zstd, bz2) read as their plain text, by every reader."""

import bz2
import gzip

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from retrieval.config import ColumnsConfig, TableConfig
from retrieval.data import DataError, read_clicks, read_feature_table
from retrieval.data.schema import compression_of_bytes, format_suffix
from retrieval.data.shards import ClickShards, decode_text

CLICKS = "user_id,item_id,timestamp\n" + "".join(f"u{i % 7},i{i % 11},{1000 + i}\n" for i in range(60))
ITEMS = "item_id,genre,price\n" + "".join(f"i{i},g{i % 3},{i * 1.5}\n" for i in range(11))


def _zstd(data: bytes) -> bytes:
    return pa.compress(data, codec="zstd", asbytes=True)  # a raw zstd frame, as the zstd tool writes


COMPRESS = {"gzip": gzip.compress, "bz2": bz2.compress, "zstd": _zstd}
EXTENSION = {"gzip": ".gz", "bz2": ".bz2", "zstd": ".zst"}


def _write(path, text: str, codec: str | None) -> str:
    data = text.encode("utf-8")
    path.write_bytes(data if codec is None else COMPRESS[codec](data))
    return str(path)


@pytest.mark.parametrize("codec", sorted(COMPRESS))
def test_compressed_click_logs_read_as_the_plain_file(tmp_path, codec):
    plain = read_clicks(TableConfig(path=_write(tmp_path / "clicks.csv", CLICKS, None)), ColumnsConfig())
    by_extension = _write(tmp_path / f"c.csv{EXTENSION[codec]}", CLICKS, codec)
    by_magic_only = _write(tmp_path / "named_plainly.csv", CLICKS, codec)  # the bytes say compressed
    for path in (by_extension, by_magic_only):
        pd.testing.assert_frame_equal(read_clicks(TableConfig(path=path), ColumnsConfig()), plain)
    # TSV, and a two-character separator (read by pandas rather than Arrow), the same
    tsv = _write(tmp_path / f"c.tsv{EXTENSION[codec]}", CLICKS.replace(",", "\t"), codec)
    pd.testing.assert_frame_equal(read_clicks(TableConfig(path=tsv), ColumnsConfig()), plain)
    double = _write(tmp_path / "c2.csv", CLICKS.replace(",", "::"), codec)
    pd.testing.assert_frame_equal(read_clicks(TableConfig(path=double, separator="::"), ColumnsConfig()), plain)


@pytest.mark.parametrize("codec", sorted(COMPRESS))
def test_compressed_feature_tables_read_as_the_plain_file(tmp_path, codec):
    plain = read_feature_table(TableConfig(path=_write(tmp_path / "items.csv", ITEMS, None)), "item_id")
    packed = read_feature_table(TableConfig(path=_write(tmp_path / f"items.csv{EXTENSION[codec]}", ITEMS, codec)),
                                "item_id")
    pd.testing.assert_frame_equal(packed, plain)
    assert packed["price"].tolist() == [i * 1.5 for i in range(11)]


def test_streamed_compressed_shards_yield_the_plain_rows_in_small_batches(tmp_path):
    folder = tmp_path / "logs"
    folder.mkdir()
    lines = CLICKS.splitlines(keepends=True)
    header, rows = lines[0], lines[1:]
    _write(folder / "part-0.csv.gz", header + "".join(rows[:25]), "gzip")
    _write(folder / "part-1.csv.zst", header + "".join(rows[25:]), "zstd")
    shards = ClickShards.open(TableConfig(path=str(folder)), ColumnsConfig(), read_batch_size=8)
    assert [p.rsplit("/", 1)[1] for p in shards.files] == ["part-0.csv.gz", "part-1.csv.zst"]
    batches = list(shards.scan())
    assert max(len(b) for b in batches) <= 8
    streamed = pd.concat([b.frame() for b in batches], ignore_index=True)
    plain = read_clicks(TableConfig(path=_write(tmp_path / "clicks.csv", CLICKS, None)), ColumnsConfig())
    pd.testing.assert_frame_equal(streamed, plain)
    keys = np.concatenate([b.keys for b in batches])
    assert (np.diff(keys) > 0).all()  # row keys still increase in log order


def test_a_bad_value_in_a_compressed_file_names_its_line(tmp_path):
    bad = CLICKS.replace("u3,i3,1003", "u3,i3,yesterday")
    path = _write(tmp_path / "clicks.csv.gz", bad, "gzip")
    line = bad.splitlines().index("u3,i3,yesterday") + 1
    with pytest.raises(DataError, match=rf"clicks\.csv\.gz, line {line}, column 'timestamp'"):
        read_clicks(TableConfig(path=path), ColumnsConfig())


def test_compressed_bytes_are_named_compressed_never_given_encoding_advice(tmp_path):
    data = gzip.compress(CLICKS.encode())
    with pytest.raises(DataError, match="gzip-compressed") as caught:
        decode_text(data, "utf-8", "clicks.csv")
    assert "latin-1" not in str(caught.value)
    parquet = tmp_path / "clicks.parquet"
    parquet.write_bytes(gzip.compress(b"PAR1 not really"))
    for read in (lambda: read_clicks(TableConfig(path=str(parquet)), ColumnsConfig()),
                 lambda: ClickShards.open(TableConfig(path=str(parquet)), ColumnsConfig())):
        with pytest.raises(DataError, match="gzip-compressed; a Parquet file is compressed inside"):
            read()
    corrupt = tmp_path / "broken.csv.gz"
    corrupt.write_bytes(gzip.compress(CLICKS.encode())[:40])
    with pytest.raises(DataError, match=r"broken\.csv\.gz: .*cannot decompress the gzip-compressed file"):
        read_clicks(TableConfig(path=str(corrupt)), ColumnsConfig())


def test_compression_is_told_by_magic_bytes_and_skipped_in_the_format_extension():
    assert compression_of_bytes(gzip.compress(b"x")[:10]) == "gzip"
    assert compression_of_bytes(bz2.compress(b"x")[:10]) == "bz2"
    assert compression_of_bytes(_zstd(b"x")[:10]) == "zstd"
    assert compression_of_bytes(b"BZh,item\n") is None  # a text header that starts like bz2
    assert compression_of_bytes(b"user_id,i") is None
    assert [format_suffix(p) for p in ("a/c.csv.gz", "c.TSV.zst", "c.csv", "c.bz2", "r.dat.gz")] == [
        ".csv", ".tsv", ".csv", "", ".dat"
    ]
