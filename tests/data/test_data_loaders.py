"""Click-log and feature-table readers, and load_dataset for the files source."""

import pickle
import re

import numpy as np
import pandas as pd
import pytest

from retrieval.config import ColumnsConfig, DataConfig, SplitConfig, TableConfig
from retrieval.data import (
    ITEM,
    TIME,
    USER,
    WEIGHT,
    DataError,
    apply_duplicates,
    load_dataset,
    read_clicks,
    read_feature_table,
)

JAN_1 = 1767225600  # 2026-01-01T00:00:00Z
COLUMNS = ColumnsConfig()  # user_id, item_id, timestamp, no weight
WEIGHTED = ColumnsConfig(weight="weight")


def write(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


def table(path, **options):
    return TableConfig(path=path, **options)


# --- canonical frame ------------------------------------------------------------------


def test_csv_gives_the_canonical_frame_in_file_order(tmp_path):
    content = "user_id,item_id,timestamp,weight\n196,242,30,2.5\n 7 , x ,10,1\n196,9,20,0\n"
    path = write(tmp_path, "c.csv", content)
    clicks = read_clicks(table(path), WEIGHTED)
    assert list(clicks.columns) == [USER, ITEM, TIME, WEIGHT]
    assert clicks[USER].tolist() == ["196", "7", "196"]  # strings, stripped
    assert clicks[ITEM].tolist() == ["242", "x", "9"]
    assert clicks[TIME].tolist() == [30, 10, 20]
    assert clicks[WEIGHT].tolist() == [2.5, 1.0, 0.0]
    assert clicks[TIME].dtype == np.int64 and clicks[WEIGHT].dtype == np.float32
    assert pd.api.types.is_string_dtype(clicks[USER]) and pd.api.types.is_string_dtype(clicks[ITEM])
    assert clicks.index.tolist() == [0, 1, 2]


def test_without_weight_or_time_columns(tmp_path):
    path = write(tmp_path, "c.csv", "u,i\n1,a\n2,b\n")
    clicks = read_clicks(table(path), ColumnsConfig(user="u", item="i", timestamp=None))
    assert list(clicks.columns) == [USER, ITEM, WEIGHT]
    assert clicks[WEIGHT].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("name,separator", [("c.csv", ","), ("c.tsv", "\t"), ("c.txt", "\t")])
def test_auto_format_from_extension(tmp_path, name, separator):
    lines = [["user_id", "item_id", "timestamp"], ["1", "a", "5"]]
    path = write(tmp_path, name, "".join(separator.join(line) + "\n" for line in lines))
    clicks = read_clicks(table(path), COLUMNS)
    assert clicks[[USER, ITEM, TIME]].values.tolist() == [["1", "a", 5]]


def test_separator_override_and_positional_columns_without_header(tmp_path):
    path = write(tmp_path, "c.csv", "1;a;5;4\n2;b;6;3\n")
    columns = ColumnsConfig(user="0", item="1", timestamp="2", weight="3")
    clicks = read_clicks(table(path, separator=";", header=False), columns)
    assert clicks.values.tolist() == [["1", "a", 5, 4.0], ["2", "b", 6, 3.0]]


def test_parquet_with_typed_columns(tmp_path):
    path = str(tmp_path / "c.parquet")
    pd.DataFrame(
        {
            "user_id": [196, 7],
            "item_id": [1.0, 2.0],  # an int id column stored as float reads "1", not "1.0"
            "timestamp": pd.to_datetime(["2026-01-01T00:00:00", "2026-01-01T00:00:09"]),
            "weight": [1, 3],
        }
    ).to_parquet(path)
    clicks = read_clicks(table(path), WEIGHTED)
    assert clicks.values.tolist() == [["196", "1", JAN_1, 1.0], ["7", "2", JAN_1 + 9, 3.0]]
    assert clicks[TIME].dtype == np.int64 and clicks[WEIGHT].dtype == np.float32


def test_movielens_100k_format_names_its_own_columns(tmp_path):
    path = write(tmp_path, "u.data", "196\t242\t3\t881250949\n186\t302\t5\t891717742\n")
    # ColumnsConfig is ignored: the format fixes the columns and the rating is the weight.
    clicks = read_clicks(table(path, format="movielens-100k"), ColumnsConfig(user="nope", weight=None))
    assert clicks.values.tolist() == [["196", "242", 881250949, 3.0], ["186", "302", 891717742, 5.0]]


def test_movielens_1m_dat_is_recognised_by_extension(tmp_path):
    path = write(tmp_path, "ratings.dat", "1::1193::5::978300760\n1::661::3::978302109\n")
    clicks = read_clicks(table(path), COLUMNS)
    assert clicks.values.tolist() == [["1", "1193", 978300760, 5.0], ["1", "661", 978302109, 3.0]]


def test_movielens_with_wrong_field_count(tmp_path):
    path = write(tmp_path, "ratings.dat", "1\t1193\t5\t978300760\n")  # a u.data file named .dat
    with pytest.raises(DataError, match=r"ratings\.dat: format 'movielens-1m' expects 4 fields.*found 1"):
        read_clicks(table(path), COLUMNS)


# --- timestamps -----------------------------------------------------------------------


def test_iso_and_integer_timestamps_become_utc_seconds(tmp_path):
    values = [
        "1767225600",
        "2026-01-01T00:00:00Z",
        "2026-01-01T02:00:00+02:00",
        "2026-01-01 00:00:07",  # no offset: UTC
        "2026-01-02",
        "1767225600.9",  # decimal seconds are floored
    ]
    path = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n" + "".join(f"u,i,{v}\n" for v in values))
    clicks = read_clicks(table(path), COLUMNS)
    assert clicks[TIME].tolist() == [JAN_1, JAN_1, JAN_1, JAN_1 + 7, JAN_1 + 86400, JAN_1]


# --- errors ---------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path):
    path = str(tmp_path / "nowhere.csv")
    with pytest.raises(DataError, match=re.escape(path) + ".*file not found"):
        read_clicks(table(path), COLUMNS)


def test_unknown_extension(tmp_path):
    path = write(tmp_path, "c.json", "{}")
    with pytest.raises(DataError, match=r"c\.json: cannot tell the format from the extension '\.json'"):
        read_clicks(table(path), COLUMNS)


def test_missing_column_names_file_column_and_columns_found(tmp_path):
    path = write(tmp_path, "c.csv", "user,item_id,timestamp\n1,a,5\n")
    with pytest.raises(
        DataError,
        match=r"c\.csv: missing column 'user_id'; columns found: \['user', 'item_id', 'timestamp'\]",
    ):
        read_clicks(table(path), COLUMNS)


def test_missing_column_without_header_explains_positional_names(tmp_path):
    path = write(tmp_path, "c.csv", "1,a,5\n")
    with pytest.raises(DataError, match=r"columns found: \['0', '1', '2'\].*named by position"):
        read_clicks(table(path, header=False), COLUMNS)


@pytest.mark.parametrize("separator", [";", "\t", "|"])
def test_a_header_split_on_another_separator_names_the_separator_key(tmp_path, separator):
    path = write(tmp_path, "c.csv", separator.join(["user_id", "item_id", "timestamp"]) + "\n1" + separator + "a\n")
    fix = re.escape(f"(the header looks separated by {separator!r}, not ',': set the table's separator: {separator!r})")
    from retrieval.data.streaming import ClickShards

    for read in (lambda: read_clicks(table(path), COLUMNS), lambda: ClickShards.open(table(path), COLUMNS)):
        with pytest.raises(DataError, match=r"c\.csv: missing columns 'user_id', 'item_id', 'timestamp'.*" + fix):
            read()
    with pytest.raises(DataError, match=fix):
        read_feature_table(table(path), "user_id")


def test_a_parquet_file_with_a_text_name_is_called_parquet(tmp_path):
    path = str(tmp_path / "clicks.csv")
    pd.DataFrame({"user_id": ["1", "2"], "item_id": ["a", "b"], "timestamp": [5, 6]}).to_parquet(path)
    from retrieval.data.streaming import ClickShards

    message = (
        r"clicks\.csv: the file looks like Parquet \(it starts with PAR1\), "
        r"not text: set the table's format: parquet"
    )
    for read in (lambda: read_clicks(table(path), COLUMNS), lambda: ClickShards.open(table(path), COLUMNS)):
        with pytest.raises(DataError, match=message):
            read()


@pytest.mark.parametrize("content", ["", "user_id,item_id,timestamp\n", "user_id,item_id,timestamp\n\n\n"])
def test_empty_log(tmp_path, content):
    path = write(tmp_path, "c.csv", content)
    with pytest.raises(DataError, match=r"c\.csv: .*no data rows"):
        read_clicks(table(path), COLUMNS)


def test_blank_id_names_file_line_and_column(tmp_path):
    # Line 1 header, 2 data, 3 blank (skipped but counted), 4 data, 5 the blank item id.
    path = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n1,a,5\n\n2,b,6\n3,  ,7\n")
    with pytest.raises(DataError, match=r"c\.csv, line 5, column 'item_id': empty item id$"):
        read_clicks(table(path), COLUMNS)


def test_line_numbers_count_leading_blank_lines_and_missing_header(tmp_path):
    path = write(tmp_path, "c.tsv", "\n\n1\ta\t5\n\tb\t6\n")
    with pytest.raises(DataError, match=r"c\.tsv, line 4, column '0': empty user id"):
        read_clicks(table(path, header=False), ColumnsConfig(user="0", item="1", timestamp="2"))


def test_bad_value_is_reported_on_its_line_among_many_rows(tmp_path):
    rows = [f"u{i},i{i},{JAN_1 + i}" for i in range(500)]
    rows[341] = "u341,i341,yesterday"  # data row 341 (0-based) is line 343 with the header
    path = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n" + "\n".join(rows) + "\n")
    message = r"c\.csv, line 343, column 'timestamp': cannot read timestamp 'yesterday'"
    with pytest.raises(DataError, match=message):
        read_clicks(table(path), COLUMNS)


def test_unparsable_timestamp_counts_all_bad_rows(tmp_path):
    path = write(tmp_path, "c.csv", "user_id,item_id,when\n1,a,2026-13-45\n2,b,\n3,c,5\n")
    with pytest.raises(
        DataError,
        match=r"line 2, column 'when': cannot read timestamp '2026-13-45'.*ISO-8601.* "
        r"\(2 bad rows among data rows 1-3\)",
    ):
        read_clicks(table(path), ColumnsConfig(timestamp="when"))


@pytest.mark.parametrize(
    "value,message",
    [
        ("abc", "weight 'abc' is not a finite number"),
        ("nan", "weight 'nan' is not a finite number"),
        ("", "weight '' is not a finite number"),
        ("inf", "weight 'inf' is not a finite number"),
        ("-1", r"negative weight '-1'; weights must be >= 0"),
    ],
)
def test_bad_weight(tmp_path, value, message):
    path = write(tmp_path, "c.csv", f"user_id,item_id,timestamp,weight\n1,a,5,1\n2,b,6,{value}\n")
    with pytest.raises(DataError, match=rf"c\.csv, line 3, column 'weight': {message}"):
        read_clicks(table(path), WEIGHTED)


def test_wrong_encoding_names_line_byte_and_the_encoding_key(tmp_path):
    path = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n1,a,5\n2,Caf\xe9,6\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"c\.csv, line 3: byte 0xe9 is not valid utf-8.*encoding: latin-1"):
        read_clicks(table(path), COLUMNS)
    clicks = read_clicks(table(path, encoding="latin-1"), COLUMNS)
    assert clicks[ITEM].tolist() == ["a", "Café"]


def test_utf8_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    path = write(tmp_path, "c.csv", "\ufeffuser_id,item_id,timestamp\n1,a,5\n".encode("utf-8"))
    assert read_clicks(table(path), COLUMNS)[USER].tolist() == ["1"]


def test_parquet_errors_name_the_row(tmp_path):
    path = str(tmp_path / "c.parquet")
    log = pd.DataFrame({"user_id": ["1", "2", "3"], "item_id": ["a", "b", "c"], "weight": [1.0, np.nan, 2.0]})
    log.to_parquet(path)
    columns = ColumnsConfig(timestamp=None, weight="weight")
    message = r"c\.parquet, row 2, column 'weight': weight nan is not a finite number"
    with pytest.raises(DataError, match=message):
        read_clicks(table(path), columns)
    missing = r"c\.parquet: missing column 'timestamp'; columns found: \['user_id', 'item_id', 'weight'\]"
    with pytest.raises(DataError, match=missing):
        read_clicks(table(path), ColumnsConfig(weight="weight"))
    pd.DataFrame({"user_id": ["1", None], "item_id": ["a", "b"]}).to_parquet(path)
    with pytest.raises(DataError, match=r"c\.parquet, row 2, column 'user_id': empty user id"):
        read_clicks(table(path), ColumnsConfig(timestamp=None))


def test_data_error_survives_pickling():
    error = DataError("bad", file="f.csv", line=3, column="c")
    assert str(pickle.loads(pickle.dumps(error))) == "f.csv, line 3, column 'c': bad"


# --- duplicates -----------------------------------------------------------------------

LOG_WITH_REPEATS = "user_id,item_id,timestamp\n1,a,50\n1,b,20\n1,a,10\n2,a,30\n1,a,10\n"


def test_duplicates_keep_keeps_every_click(tmp_path):
    path = write(tmp_path, "c.csv", LOG_WITH_REPEATS)
    assert len(read_clicks(table(path), COLUMNS, duplicates="keep")) == 5


def test_duplicates_first_keeps_the_earliest_click_in_file_order(tmp_path):
    path = write(tmp_path, "c.csv", LOG_WITH_REPEATS)
    clicks = read_clicks(table(path), COLUMNS, duplicates="first")
    # (1, a) is earliest on line 4 (t=10); line 6 ties with it but comes later in the file.
    assert clicks[[USER, ITEM, TIME]].values.tolist() == [["1", "b", 20], ["1", "a", 10], ["2", "a", 30]]


def test_duplicates_first_without_time_uses_file_order():
    clicks = pd.DataFrame(
        {USER: ["1", "1", "2", "1"], ITEM: ["b", "a", "a", "b"], WEIGHT: [1.0, 2.0, 3.0, 4.0]}
    )
    assert apply_duplicates(clicks, "first")[WEIGHT].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="duplicates must be 'keep' or 'first', got 'last'"):
        apply_duplicates(clicks, "last")


# --- feature tables -------------------------------------------------------------------


def test_feature_table_types_columns(tmp_path):
    content = "sku,price,stock,colour,zip,empty\nA1,9.5,3,red,01002,\nB2,,4,,94043,\n"
    path = write(tmp_path, "items.csv", content)
    items = read_feature_table(table(path), "sku")
    assert items.columns.tolist() == ["sku", "price", "stock", "colour", "zip", "empty"]
    assert items["sku"].tolist() == ["A1", "B2"]
    assert items["price"].dtype == np.float64 and np.isnan(items["price"][1]) and items["price"][0] == 9.5
    assert items["stock"].dtype == np.int64 and items["stock"].tolist() == [3, 4]
    assert items["colour"][0] == "red" and pd.isna(items["colour"][1])
    assert items["zip"].tolist() == ["01002", "94043"]  # the leading zero survives
    assert items["empty"].isna().all()


def test_feature_table_repeated_id(tmp_path):
    path = write(tmp_path, "items.csv", "item_id,price\na,1\nb,2\na,3\n")
    message = r"items\.csv, line 4, column 'item_id': repeated id 'a' \(first on line 2\)"
    with pytest.raises(DataError, match=message):
        read_feature_table(table(path), "item_id")


def test_feature_table_missing_id_column(tmp_path):
    path = write(tmp_path, "items.csv", "sku,price\na,1\n")
    message = r"items\.csv: missing column 'item_id'; columns found: \['sku', 'price'\]"
    with pytest.raises(DataError, match=message):
        read_feature_table(table(path), "item_id")


# --- load_dataset, files source -------------------------------------------------------


def test_load_dataset_from_files_builds_full_catalogues(tmp_path):
    clicks = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n1,a,1\n1,a,2\n2,b,3\n1,c,4\n3,d,5\n")
    test = write(tmp_path, "t.csv", "user_id,item_id,timestamp\n1,e,9\n4,a,9\n")
    items = write(tmp_path, "items.csv", "sku,price\nz,5\nb,2\na,1\n")
    users = write(tmp_path, "users.csv", "user_id,age\n2,30\n")
    data = DataConfig(
        source="files",
        clicks=table(clicks),
        test_clicks=table(test),
        item_features=table(items),
        item_id_column="sku",
        user_features=table(users),
        duplicates="first",
    )
    dataset = load_dataset(data, SplitConfig(kind="none"))
    assert dataset.train[ITEM].tolist() == ["a", "b", "c", "d"]  # the repeated (1, a) dropped
    assert dataset.test[ITEM].tolist() == ["e", "a"]
    # Feature rows first (z has no clicks at all), then log-only items, first seen first.
    assert dataset.items[ITEM].tolist() == ["z", "b", "a", "c", "d", "e"]
    assert dataset.items["price"].tolist()[:3] == [5.0, 2.0, 1.0] and dataset.items["price"][3:].isna().all()
    assert dataset.users[USER].tolist() == ["2", "1", "3", "4"]
    assert dataset.users["age"][0] == 30 and dataset.users["age"][1:].isna().all()
    summary = dataset.summary()
    assert summary["train_clicks"] == 4 and summary["test_clicks"] == 2
    assert summary["test_users_unseen_in_train"] == 1  # user 4
    assert summary["test_items_unseen_in_train"] == 1  # item e
    assert summary["catalogue_items"] == 6 and summary["catalogue_items_without_train_clicks"] == 2
    assert dataset.source == f"files:{clicks}"


def test_load_dataset_rejects_a_test_log_with_another_split(tmp_path):
    clicks = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n1,a,1\n2,b,3\n")
    data = DataConfig(source="files", clicks=table(clicks), test_clicks=table(clicks))
    with pytest.raises(DataError, match="split.kind is 'temporal': set split.kind: none"):
        load_dataset(data, SplitConfig(kind="temporal"))


def test_a_trailing_separator_is_refused_at_its_line_with_the_fix(tmp_path):
    """A field more than the header, even an empty one, never shifts the columns: the line is named."""
    path = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n1,a,5\n2,b,6,\n")
    with pytest.raises(DataError, match=r"c\.csv, line 3: expected 3 fields separated by ',', found 4 "
                       r"\(a trailing ',': remove it, or name the extra column in the header\)$"):
        read_clicks(table(path), COLUMNS)
    header_too = write(tmp_path, "d.csv", "user_id,item_id,timestamp,\n1,a,5,\n")
    clicks = read_clicks(table(header_too), COLUMNS)  # the header names the empty column: nothing to refuse
    assert clicks[[USER, ITEM, TIME]].values.tolist() == [["1", "a", 5]]


@pytest.mark.parametrize(
    "rows,line",
    [
        ("1,a,5\n2,b,6,x\n", 3),  # pandas dropped the 'x' with a warning and the row loaded
        ("1,a,5,x\n2,b,6\n", 2),
    ],
)
def test_a_row_with_a_field_more_names_its_line_in_both_readers(tmp_path, rows, line):
    path = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n" + rows)
    for read in _both_readers(path, COLUMNS):
        with pytest.raises(DataError, match=rf"c\.csv, line {line}: expected 3 fields separated by ',', found 4"):
            read()


@pytest.mark.parametrize("rows,line", [("1,a,5\n2,b\n3,c,7\n", 3), ("1,a,5\n\n2\n", 4)])
def test_a_row_with_a_field_less_names_its_line_in_both_readers(tmp_path, rows, line):
    # In memory the missing field reads as empty and the column that needs it names itself.
    path = write(tmp_path, "c.csv", "user_id,item_id,timestamp\n" + rows)
    for read in _both_readers(path, COLUMNS):
        with pytest.raises(DataError, match=rf"c\.csv, line {line}"):
            read()


def test_malformed_row_names_file_and_line(tmp_path):
    path = write(tmp_path, "c.csv", "\r\nuser_id,item_id,timestamp\r\n1,a,5\r\n\r\n2,b,6,7,8\r\n")
    with pytest.raises(DataError, match=r"c\.csv, line 5: expected 3 fields separated by ',', found 5$"):
        read_clicks(table(path), COLUMNS)


# --- values that used to load wrong: both readers refuse them, naming file, line (row) and column ---


def _both_readers(path: str, columns: ColumnsConfig) -> list:
    """The in-memory reader, then the out-of-core one as the job drives it (open, then pass 1)."""
    from retrieval.data.streaming import ClickShards, plan_split

    return [
        lambda: read_clicks(table(path), columns),
        lambda: plan_split(ClickShards.open(table(path), columns), SplitConfig(kind="random")),
    ]


@pytest.mark.parametrize(
    "content,message",
    [
        # was INT64_MIN with a numpy warning
        ("1,a,99999999999999999999,1", r"line 2, column 'timestamp': timestamp '99999999999999999999' is out of range"),
        ("1,a,-9223372036854775809,1", r"line 2, column 'timestamp': .* out of range: .* fit in int64"),
        # was float32 inf, and "embeddings contain NaN or inf" after training
        ("1,a,5,1e39", r"line 2, column 'weight': weight '1e39' overflows float32"),
    ],
)
def test_numbers_beyond_the_canonical_dtypes_are_refused(tmp_path, content, message):
    path = write(tmp_path, "c.csv", f"user_id,item_id,timestamp,weight\n{content}\n")
    for read in _both_readers(path, WEIGHTED):
        with pytest.raises(DataError, match=rf"c\.csv, {message}"):
            read()


def test_the_extremes_of_int64_are_kept_exactly(tmp_path):
    lowest, highest = -(2**63), 2**63 - 1
    path = write(tmp_path, "c.csv", f"user_id,item_id,timestamp\n1,a,{highest}\n2,b,{lowest}\n3,c,9007199254740993\n")
    assert read_clicks(table(path), COLUMNS)[TIME].tolist() == [highest, lowest, 9007199254740993]


@pytest.mark.parametrize(
    "ids,shown",
    [
        ([[1, 2], [3]], r"user id \[1, 2\] is a list or struct"),  # was the string "[1 2]"
        ([{"id": 1}, {"id": 2}], r"user id \{'id': 1\} is a list or struct"),
        ([True, False], r"user ids are booleans"),
    ],
)
def test_parquet_id_columns_that_hold_no_single_value_are_refused(tmp_path, ids, shown):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"user_id": pa.array(ids), "item_id": ["a", "b"], "timestamp": [1, 2]}), path)
    for read in _both_readers(path, COLUMNS):
        with pytest.raises(DataError, match=rf"c\.parquet, row 1, column 'user_id': {shown}"):
            read()


def test_parquet_binary_ids_read_as_utf8_text_in_both_readers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from retrieval.data.streaming import ClickShards

    path = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"user_id": [b"caf\xc3\xa9", b"u2"], "item_id": ["a", "b"], "timestamp": [1, 2]}), path)
    shards = ClickShards.open(table(path), COLUMNS)
    streamed = pd.concat([batch.frame() for batch in shards.scan()], ignore_index=True)
    assert read_clicks(table(path), COLUMNS)[USER].tolist() == streamed[USER].tolist() == ["café", "u2"]
    pq.write_table(pa.table({"user_id": [b"u1", b"\xff"], "item_id": ["a", "b"], "timestamp": [1, 2]}), path)
    for read in _both_readers(path, COLUMNS):
        with pytest.raises(DataError, match=r"c\.parquet, row 2, column 'user_id': user id b'\\xff' is bytes"):
            read()


def test_float_ids_read_the_same_in_memory_and_streamed(tmp_path):
    """Cell by cell, in any batch: whole floats read as integers, others keep their digits."""
    from retrieval.data.streaming import ClickShards

    path = str(tmp_path / "c.parquet")
    pd.DataFrame({"user_id": [196.0, 7.0, 3.5], "item_id": ["a", "b", "c"]}).to_parquet(path)
    columns = ColumnsConfig(timestamp=None)
    whole = read_clicks(table(path), columns)[USER].tolist()
    streamed = ClickShards.open(table(path), columns, read_batch_size=2)
    batches = [user for batch in streamed.scan() for user in batch.frame()[USER]]
    assert whole == batches == ["196", "7", "3.5"]


def test_feature_tables_and_click_logs_share_one_text_reader(tmp_path):
    """The same file faults are named the same way in a feature table as in a click log."""
    rows = "\n\nid,genre,year\ni1,drama,1999\ni2,comedy,2001,x\n"  # two leading blank lines, a field more
    path = write(tmp_path, "items.csv", rows)
    with pytest.raises(DataError, match=r"items\.csv, line 5: expected 3 fields separated by ',', found 4$"):
        read_feature_table(table(path), "id")
    latin = write(tmp_path, "latin.csv", "id,title\ni1,Caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.csv, line 2: byte 0xe9 is not valid utf-8.*encoding: latin-1"):
        read_feature_table(table(latin), "id")
    assert read_feature_table(table(latin, encoding="latin-1"), "id")["title"].tolist() == ["Café"]


def test_a_longer_separator_reads_whole_and_is_refused_streamed(tmp_path):
    from retrieval.data.streaming import ClickShards

    path = write(tmp_path, "c.csv", "user_id||item_id||timestamp\n1||a||5\n2||b||6\n")
    clicks = read_clicks(table(path, separator="||"), COLUMNS)
    assert clicks[[USER, ITEM, TIME]].values.tolist() == [["1", "a", 5], ["2", "b", 6]]
    with pytest.raises(DataError, match=r"separator '\|\|' is not one character: .*data\.out_of_core: false"):
        ClickShards.open(table(path, separator="||"), COLUMNS)
