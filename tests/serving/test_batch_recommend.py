"""Recommendations and similar items for many users/items into one Parquet file, with progress.

- the file of ``--users all`` / a users file equals ``Bundle.recommend_batch`` user by user (ids,
  scores; seen items excluded by default, kept with ``--include-seen``), one row group per block;
- ``--similar all`` / an items file equals ``Bundle.similar_items_batch``;
- a bad users or items file, an existing ``--out``, misused flags: one-line errors, no file written;
  a run that fails half way leaves no file under the final name;
- ``Progress`` without a terminal writes count, rate and ETA lines (a fake clock, no sleeps).

The bundles are test_seen_items' fixed-tower bundles (no training).
"""

from __future__ import annotations

import io
import os
import stat

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_seen_items import NUM_USERS, world  # noqa: F401  (the module fixture: fixed-tower bundles)

from retrieval import cli, serving
from retrieval.common.errors import UserError
from retrieval.common.progress import Progress, format_duration
from retrieval.serving import Bundle
from retrieval.serving.batch import (
    DEFAULT_BLOCK_SIZE,
    RECOMMENDATION_SCHEMA,
    SIMILAR_SCHEMA,
    IdFile,
    IdList,
    all_items,
    all_users,
    recommend_to_file,
    similar_to_file,
)


@pytest.fixture(scope="module")
def seen(world):  # noqa: F811
    return Bundle.load(world["seen"])


def answers(path, query_column: str, item_column: str) -> list[tuple[str, list[str], list[float | None]]]:
    """(query, items by rank, scores) per answer as the file holds them, in order: an answer starts at rank 1."""
    table = pq.read_table(path).to_pydict()
    result: list[tuple[str, list[str], list[float | None]]] = []
    for query, rank, item, score in zip(*(table[c] for c in (query_column, "rank", item_column, "score"))):
        if rank == 1:
            result.append((query, [], []))
        assert result[-1][0] == query and rank == len(result[-1][1]) + 1, (query, rank)
        result[-1][1].append(item)
        result[-1][2].append(score)
    return result


def assert_equal_answers(path, queries, expected, query_column="user_id", item_column="item_id"):
    """The file holds, query by query and in order, exactly the expected Recommendations (an empty
    answer has no rows)."""
    answered = [(query, result) for query, result in zip(queries, expected) if result.item_ids]
    got = answers(path, query_column, item_column)
    assert [query for query, _, _ in got] == [query for query, _ in answered]
    for (query, items, scores), (_, result) in zip(got, answered):
        assert items == result.item_ids, query
        if result.fallback == "popular":
            assert scores == [None] * len(items)
        else:  # float32 in the file, as FAISS scored them
            np.testing.assert_array_equal(np.float32(scores), np.float32(result.scores))


def test_all_users_equal_recommend_batch_user_by_user_one_row_group_a_block(seen, tmp_path):
    users = [u.decode() for u in np.asarray(seen.seen_items.user_ids)]
    assert len(users) == NUM_USERS - 1  # user39 has no training clicks
    out = tmp_path / "recs.parquet"
    summary = recommend_to_file(seen, all_users(seen), 12, out, block_size=7)
    file = pq.ParquetFile(out)
    assert file.schema_arrow == RECOMMENDATION_SCHEMA
    # The id columns are named as every other surface names them (requests, manifests, logs).
    assert file.schema_arrow.names == ["user_id", "rank", "item_id", "score"]
    assert SIMILAR_SCHEMA.names == ["item_id", "rank", "similar_item_id", "score"]
    assert file.num_row_groups == summary.row_groups == -(-len(users) // 7)
    assert file.metadata.row_group(0).num_rows == 6 * 12 + 5  # user00 has 5 items left
    assert file.metadata.row_group(1).num_rows == 7 * 12
    expected = seen.recommend_batch([{"user_id": u} for u in users], 12)
    assert_equal_answers(out, users, expected)
    assert summary.queries == len(users) and summary.rows == file.metadata.num_rows

    # --include-seen: the answers without exclusion, which hold training items the default leaves out.
    kept = tmp_path / "with-seen.parquet"
    recommend_to_file(seen, all_users(seen), 12, kept, exclude_seen=False, block_size=64)
    unexcluded = seen.recommend_batch([{"user_id": u} for u in users], 12, exclude_seen=False)
    assert_equal_answers(kept, users, unexcluded)
    assert pq.ParquetFile(kept).num_row_groups == 1
    had = {user: set(seen.index.item_ids[np.asarray(seen.seen_items.rows_of(user))]) for user in users}
    assert not any(set(r.item_ids) & had[u] for u, r in zip(users, expected))
    assert any(set(r.item_ids) & had[u] for u, r in zip(users, unexcluded))


def test_a_users_file_through_the_command_line(world, seen, tmp_path, capsys):  # noqa: F811
    users = ["user03", "stranger", "user39", "user00", "user03"]  # unknown, no training items, nearly all seen
    listed = tmp_path / "users.txt"
    listed.write_text("\n".join(users) + "\n")
    out = tmp_path / "out" / "recs.parquet"
    argv = ["--bundle", str(world["seen"]), "--users", str(listed), "--k", "10", "--out", str(out),
            "--exclude", "item001", "--block-size", "2"]
    assert serving.main(argv) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith(f"wrote {out}: ")
    assert "for 5 users" in line and "1 user ids unknown to the model (1 got the popular items (score null))" in line
    expected = seen.recommend_batch([{"user_id": u} for u in users], 10, [["item001"]] * len(users))
    assert expected[1].fallback == "popular" and len(expected[3].item_ids) == 5  # what is left for user00
    frame = pq.read_table(out).to_pandas()
    assert frame["user_id"].tolist()[:10] == ["user03"] * 10 and len(frame) == 10 + 10 + 10 + 5 + 10
    assert_equal_answers(out, users, expected)
    assert pq.ParquetFile(out).num_row_groups == 3
    shown = next(a.help for a in serving.recommend_parser()._actions if a.dest == "block_size")
    assert shown.endswith(f"(default: {DEFAULT_BLOCK_SIZE})")

    # The console command is the same parser; --include-seen keeps the training items.
    again = tmp_path / "with-seen.parquet"
    assert cli.main(["recommend", "--bundle", str(world["seen"]), "--users", str(listed), "-k", "10",
                     "--out", str(again), "--include-seen"]) == 0
    assert_equal_answers(again, users, seen.recommend_batch([{"user_id": u} for u in users], 10,
                                                            exclude_seen=False))


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "users.txt: no such file of user ids"),
        ("", "users.txt: the file is empty; give one user id a line"),
        ("user01\n\nuser02\n", "users.txt line 2: a blank line; give one user id a line"),
        ("user01\nuser02\n\n", "users.txt line 3: a blank line"),
        ("user01\n  \t\n", "users.txt line 2: a blank line"),
        ("user01\r\nuser02 \r\n", "users.txt line 2: user id 'user02 ' has spaces around it"),
        (b"user01\n\xff\xfe\n", "users.txt line 2: not UTF-8 text"),
        ("user01\n" + "u" * 4097 + "\nuser02\n", "users.txt line 2: longer than 4,096 bytes; give one user id a line"),
        ("user01\nuser02\n" + "u" * 4097, "users.txt line 3: longer than 4,096 bytes"),
    ],
)
def test_a_bad_users_file_is_a_one_line_error_naming_the_line(world, tmp_path, capsys, content, message):  # noqa: F811
    listed = tmp_path / "users.txt"
    if isinstance(content, bytes):
        listed.write_bytes(content)
    elif content is not None:
        listed.write_text(content, newline="")
    out = tmp_path / "recs.parquet"
    assert serving.main(["--bundle", str(world["seen"]), "--users", str(listed), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {tmp_path}/{message}") and error.count("\n") == 1
    assert list(tmp_path.iterdir()) == ([listed] if content is not None else [])


# Ids: any text without a line break, not blank, no spaces around it (reading splits at b"\n" only).
ids = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"), min_size=1, max_size=8).filter(
    lambda text: text.strip() == text and bool(text)
)


@settings(max_examples=60, deadline=None)
@given(listed=st.lists(ids, min_size=1, max_size=30), size=st.integers(1, 7), crlf=st.booleans(),
       final_newline=st.booleans(), blank=st.none() | st.integers(0, 30))
def test_an_id_file_gives_back_its_lines_in_blocks_or_names_its_blank_line(tmp_path_factory, listed, size, crlf,
                                                                          final_newline, blank):
    path = tmp_path_factory.mktemp("ids") / "ids.txt"
    end = "\r\n" if crlf else "\n"
    lines = list(listed)
    if blank is not None:
        blank = min(blank, len(lines))
        lines.insert(blank, "")
    path.write_bytes((end.join(lines) + (end if final_newline else "")).encode("utf-8"))
    if blank is None:
        source = IdFile(path, "user")
        blocks = list(source.blocks(size))
        assert source.total == len(listed) and [i for block in blocks for i in block] == listed
        assert all(len(block) == size for block in blocks[:-1]) and 1 <= len(blocks[-1]) <= size
    elif blank == len(listed) and not final_newline:
        # The blank last line without a newline after it is just a final newline.
        assert IdFile(path, "user").ids() == listed
    else:
        with pytest.raises(UserError, match=f"^{path} line {blank + 1}: a blank line; give one user id a line$"):
            IdFile(path, "user")


def test_an_existing_out_is_refused_without_overwrite(world, seen, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "recs.parquet"
    out.write_text("yesterday's file")
    argv = ["--bundle", str(world["seen"]), "--users", "all", "-k", "3", "--out", str(out)]
    assert serving.main(argv) == 2
    assert capsys.readouterr().err == f"error: {out} exists; pass --overwrite (overwrite=True) to replace it\n"
    assert out.read_text() == "yesterday's file"
    assert serving.main([*argv, "--overwrite"]) == 0
    assert pq.read_table(out).num_rows == 3 * len(seen.seen_items)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recs.parquet"]


def test_a_run_that_fails_half_way_leaves_no_file(seen, tmp_path, monkeypatch):
    calls = []
    answer = seen.recommend_batch

    def fails_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return answer(*args, **kwargs)

    monkeypatch.setattr(seen, "recommend_batch", fails_second_time)
    out = tmp_path / "recs.parquet"
    with pytest.raises(KeyboardInterrupt):
        recommend_to_file(seen, IdList(["user01", "user02", "user03"]), 5, out, block_size=2)
    assert list(tmp_path.iterdir()) == []  # neither the final name nor the partial file


def test_similar_items_of_the_catalogue_and_of_a_file_equal_similar_items_batch(world, seen, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "similar.parquet"
    summary = similar_to_file(seen, all_items(seen), 6, out, exclude_item_ids=["item002"], block_size=128)
    ids = seen.index.item_ids.tolist()
    assert pq.ParquetFile(out).schema_arrow == SIMILAR_SCHEMA and summary.row_groups == 3
    assert_equal_answers(out, ids, seen.similar_items_batch(ids, 6, [["item002"]] * len(ids)), "item_id",
                         "similar_item_id")

    listed = tmp_path / "items.txt"
    listed.write_text("item010\nitem299\nitem010\n")
    from_file = tmp_path / "some.parquet"
    argv = ["--bundle", str(world["seen"]), "--similar", str(listed), "-k", "4", "--out", str(from_file)]
    assert serving.main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    asked = ["item010", "item299", "item010"]
    assert_equal_answers(from_file, asked, seen.similar_items_batch(asked, 4), "item_id", "similar_item_id")

    listed.write_text("item010\nnope\nitem011\nalso-not\n")
    assert serving.main([*argv, "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        f"error: {listed} line 2: item id 'nope' is not in the catalogue of bundle 'seen' (2 of the file's 4 ids "
        "are not); similar items are found only for catalogue items\n"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--users", "all"], "error: --users writes a file: give --out FILE.parquet\n"),
        (["--user-id", "user01", "--out", "x.parquet"], "error: --out writes the answers of --users FILE|all"),
        (["--similar", "all", "--similar", "item001", "--out", "x.parquet"],
         "error: with --out, --similar takes one source, 'all' or a file of item ids, got ['all', 'item001']\n"),
        (["--users", "all", "--out", "x.parquet", "--block-size", "0"],
         "error: --block-size must be a positive number of queries, got 0\n"),
        (["--user-id", "user01", "--overwrite"], "error: --overwrite applies to --out"),
        (["--similar", "item001", "--block-size", "8"], "error: --block-size applies to --out"),
    ],
)
def test_misused_flags_are_one_line_errors(world, tmp_path, monkeypatch, capsys, flags, message):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    assert serving.main(["--bundle", str(world["seen"]), *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith(message) and error.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_all_users_of_a_bundle_without_seen_items_is_refused(world, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "recs.parquet"
    assert serving.main(["--bundle", str(world["old"]), "--users", "all", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "error: bundle 'old' was exported without seen_items/, so it holds no list of its users for 'all': "
        "give a file of user ids, one a line\n"
    )


# --- Progress ------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_off_a_terminal_writes_count_rate_and_eta_every_interval():
    clock, stream = FakeClock(), io.StringIO()
    progress = Progress(1000, "recommend", "users", stream=stream, interval=5, clock=clock)
    clock.now += 2
    progress.update(100)  # 2 s in: under the interval, no line yet
    assert stream.getvalue() == ""
    clock.now += 3
    progress.update(150)  # 5 s, 250 done: 50 users/s, 750 left
    clock.now += 1
    progress.update(50)
    clock.now += 9
    progress.update(450)  # 15 s, 750 done
    clock.now += 10
    progress.close()
    progress.close()  # once only
    assert stream.getvalue().splitlines() == [
        "recommend: 250 / 1,000 users (25.0%), 50.0 users/s, ETA 15s",
        "recommend: 750 / 1,000 users (75.0%), 50.0 users/s, ETA 5s",
        "recommend: 750 users in 25s, 30.0 users/s",
    ]


def test_progress_without_a_total_and_long_etas():
    clock, stream = FakeClock(), io.StringIO()
    with Progress(None, "index add", "vectors", stream=stream, interval=1, clock=clock) as progress:
        clock.now += 4
        progress.update(2_000_000)
    assert stream.getvalue().splitlines()[0] == "index add: 2,000,000 vectors, 500,000 vectors/s"
    slow = Progress(10_000, "recommend", "users", stream=stream, interval=1, clock=clock, terminal=False)
    clock.now += 10
    slow.update(2)
    assert stream.getvalue().splitlines()[-1].endswith("ETA 13h53m")
    # A loop done before its first line is due writes nothing, not even the last line.
    quick = io.StringIO()
    with Progress(10, "recommend", "users", stream=quick, interval=5, clock=clock) as progress:
        clock.now += 4
        progress.update(10)
    assert quick.getvalue() == ""
    assert [format_duration(s) for s in (0, 59.9, 60, 3599, 3600, 7500)] == ["0s", "59s", "1m00s", "59m59s",
                                                                             "1h00m", "2h05m"]


def test_progress_on_a_terminal_is_a_tqdm_bar():
    stream = io.StringIO()
    with Progress(40, "recommend", "users", stream=stream, terminal=True, delay=0) as progress:
        progress.update(40)
    assert "recommend: 100%" in stream.getvalue() and "40/40 [" in stream.getvalue()
    with Progress(40, "recommend", "users", stream=stream, terminal=True) as progress:  # the default delay
        progress.update(40)
    assert stream.getvalue().count("recommend: 100%") == 1  # done before the bar was due: none shown


def test_the_command_shows_progress_lines_on_stderr(world, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr("retrieval.common.progress.DEFAULT_INTERVAL", 1e-9, raising=True)
    out = tmp_path / "recs.parquet"
    argv = ["--bundle", str(world["seen"]), "--users", "all", "-k", "2", "--out", str(out), "--block-size", "10"]
    assert serving.main(argv) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith(f"recommend: {NUM_USERS - 1} users in ")
    assert any(line.startswith("recommend: 10 / 39 users (25.6%), ") and "ETA" in line for line in lines)


def test_an_id_file_line_is_bounded_and_never_read_whole(tmp_path):
    """An id of MAX_ID_BYTES bytes (with \\r\\n) is read; a 32 MB line is refused after reading at most
    a bounded piece of it (peak Python allocation far below the line's size)."""
    import tracemalloc

    from retrieval.serving.batch import MAX_ID_BYTES

    longest = tmp_path / "longest.txt"
    longest.write_bytes(b"a\r\n" + "é".encode() * (MAX_ID_BYTES // 2) + b"\r\nb")
    assert IdFile(longest, "user").ids() == ["a", "é" * (MAX_ID_BYTES // 2), "b"]
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"user01\n" + b"x" * (32 << 20) + b"\n")
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=f"{huge} line 2: longer than 4,096 bytes"):
            IdFile(huge, "user")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_sigterm_during_recommend_out_removes_the_partial_file(world, tmp_path):  # noqa: F811
    """``retrieval recommend --out`` stopped by SIGTERM (and SIGHUP) mid-file: the hidden partial file is
    removed, nothing is left under the final name, and the process ends by that signal."""
    import signal

    users = tmp_path / "users.txt"
    users.write_text("".join(f"user{u % 39:02d}\n" for u in range(200_000)))
    for number in (signal.SIGTERM, signal.SIGHUP):
        out = tmp_path / "out" / "recs.parquet"
        # SIGHUP at its default in the child even where this runner ignores it (under nohup, say).
        process = _recommend_until_a_partial_file(world, users, out, hangup=signal.SIG_DFL)
        try:
            process.send_signal(number)
            process.communicate(timeout=60)
        finally:
            process.kill()
        assert process.returncode == -number
        assert list(out.parent.iterdir()) == []


def _recommend_until_a_partial_file(bundles, users, out, *, hangup):
    """``retrieval recommend --out`` started with SIGHUP set to ``hangup``, once some blocks are written."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-m", "retrieval.serving", "--bundle", str(bundles["seen"]), "--users", str(users),
         "-k", "5", "--block-size", "1", "--out", str(out)],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "3"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup),
    )
    deadline = time.monotonic() + 120
    while not list(out.parent.glob(".recs.parquet.partial-*")):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no partial file appeared: {process.communicate()[1][-3000:]!r}")
        time.sleep(0.05)
    time.sleep(0.3)  # some blocks written
    return process


def test_a_hangup_the_process_ignores_does_not_stop_recommend_out(world, tmp_path):  # noqa: F811
    """Under ``nohup`` (SIGHUP ignored) a closed terminal does not stop ``retrieval recommend --out``; a
    SIGTERM still does, removing the partial file."""
    import signal
    import time

    users = tmp_path / "users.txt"
    users.write_text("".join(f"user{u % 39:02d}\n" for u in range(200_000)))
    out = tmp_path / "out" / "recs.parquet"
    process = _recommend_until_a_partial_file(world, users, out, hangup=signal.SIG_IGN)
    try:
        process.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert process.poll() is None, "SIGHUP stopped a process that ignores it"
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGTERM
    assert list(out.parent.iterdir()) == []


@pytest.mark.skipif(not os.path.exists("/dev/full") or not stat.S_ISCHR(os.stat("/dev/full").st_mode),
                    reason="needs the /dev/full device (Linux), whose writes fail with ENOSPC")
def test_a_full_disk_under_out_is_one_line_and_leaves_no_file(world, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The partial file's writes go to /dev/full: a small result (Arrow's own sink would drop the error of
    its last flush and the truncated file would be renamed) is one line naming --out, status 2, no file."""
    import builtins

    from retrieval.serving import batch as batch_recommend

    def full_disk(path, mode="r", *args, **kwargs):
        full = ".partial-" in str(path) and "w" in mode
        return builtins.open("/dev/full" if full else path, mode, *args, **kwargs)

    monkeypatch.setattr(batch_recommend, "open", full_disk, raising=False)
    listed = tmp_path / "users.txt"
    listed.write_text("user01\nuser02\n")
    out = tmp_path / "recs.parquet"
    assert serving.main(["--bundle", str(world["seen"]), "--users", str(listed), "-k", "3", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error == f"error: {out}: No space left on device: free space on that disk or write elsewhere\n"
    assert sorted(tmp_path.iterdir()) == [listed]
