"""One epoch order for both click sources: a seeded hash of each click's content.

``FrameClicks`` (a frame in memory) and ``StreamedClicks`` (shards read in a
permuted order, through a buffer) must give the same batches when the buffer
holds every training click; the reference for the stream is the frame.
"""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import retrieval  # noqa: F401
from retrieval.config import ColumnsConfig, SplitConfig, TableConfig
from retrieval.data import click_keys, epoch_order
from retrieval.data.streaming import ClickShards, SplitPlan, plan_split, scan_counts, train_batches, train_clicks
from retrieval.training import FrameClicks, StreamedClicks


def _clicks(seed: int, n: int = 900) -> pd.DataFrame:
    """Clicks with repeated (user, item) pairs, weights and timestamps that repeat too, so that some
    rows are exact copies of others (the ties a content order must break)."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "user_id": [f"u{u}" for u in rng.integers(0, 40, n)],
        "item_id": [f"i{i}" for i in np.minimum(rng.zipf(1.4, n), 50)],
        "timestamp": rng.integers(0, 30, n).astype(np.int64),
        "weight": rng.choice([1.0, 2.0, 0.5], n).astype(np.float32),
    })


def _keys(frame: pd.DataFrame, with_time: bool = True) -> np.ndarray:
    return click_keys(frame["user_id"].to_numpy(dtype=object), frame["item_id"].to_numpy(dtype=object),
                      frame["weight"].to_numpy(np.float32), frame["timestamp"].to_numpy() if with_time else None)


def _rows(frame: pd.DataFrame) -> list[tuple]:
    return list(frame.itertuples(index=False, name=None))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_epoch_order_is_a_function_of_the_clicks_not_of_their_places(seed):
    clicks = _clicks(seed)
    assert clicks.duplicated().any()  # exact copies: the rank among copies keeps their keys apart
    order = epoch_order(_keys(clicks), 7, 1)
    np.testing.assert_array_equal(np.sort(order), np.arange(len(clicks)))  # a permutation
    expected = _rows(clicks.iloc[order])
    # The same clicks in another order are visited in the same order (copies are interchangeable).
    shuffled = clicks.sample(frac=1.0, random_state=seed).reset_index(drop=True)
    assert _rows(shuffled.iloc[epoch_order(_keys(shuffled), 7, 1)]) == expected
    # A subset of clicks without copies (their keys are those in the whole) keeps its relative order.
    some = clicks[~clicks.duplicated(keep=False)].sample(frac=0.3, random_state=seed)
    subset = _rows(some.iloc[epoch_order(_keys(some), 7, 1)])
    assert subset == [row for row in expected if row in set(subset)]
    # Another epoch or seed is another order.
    assert _rows(clicks.iloc[epoch_order(_keys(clicks), 7, 2)]) != expected
    assert _rows(clicks.iloc[epoch_order(_keys(clicks), 8, 1)]) != expected


def test_copies_of_a_click_are_spread_over_the_epoch():
    """Without timestamps many clicks are copies; equal keys would put them side by side every epoch."""
    clicks = pd.DataFrame({"user_id": ["u0"] * 50 + [f"u{i}" for i in range(1, 51)], "item_id": ["i0"] * 100,
                           "weight": np.ones(100, np.float32), "timestamp": np.zeros(100, np.int64)})
    keys = _keys(clicks, with_time=False)
    assert len(np.unique(keys)) == 100
    positions = np.flatnonzero(epoch_order(keys, 0, 0) < 50)  # where the 50 copies of (u0, i0) land
    assert positions.max() - positions.min() > 60  # spread, not a run of 50
    # A timestamp makes two otherwise equal clicks different clicks, not copies.
    timed = click_keys(np.array(["u", "u"], object), np.array(["i", "i"], object), np.ones(2, np.float32),
                       np.array([5, 6]))
    alone = click_keys(np.array(["u"], object), np.array(["i"], object), np.ones(1, np.float32), np.array([6]))
    assert timed[1] == alone[0]  # a second copy would have a rank of 1


def test_click_keys_and_epoch_order_check_their_arguments():
    with pytest.raises(ValueError, match="one length"):
        click_keys(np.array(["u"], object), np.array(["i", "j"], object), np.ones(1, np.float32))
    with pytest.raises(ValueError, match="non-negative"):
        epoch_order(np.zeros(3, np.uint64), -1, 0)


def _shards(clicks: pd.DataFrame, folder: Path, with_time: bool) -> ClickShards:
    """``clicks`` as three Parquet shards read 64 rows at a time (many record batches to interleave)."""
    folder.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(clicks)), 3)):
        clicks.iloc[part].to_parquet(folder / f"part-{i}.parquet", index=False)
    columns = ColumnsConfig(timestamp="timestamp" if with_time else None, weight="weight")
    return ClickShards.open(TableConfig(path=str(folder)), columns, read_batch_size=64)


def _decoded(batch) -> dict[str, list]:
    return {name: [v.decode() if isinstance(v, bytes) else v for v in batch[name].numpy().tolist()]
            for name in ("user_id", "item_id", "weight")}


@pytest.mark.parametrize("with_time", [True, False])
@pytest.mark.parametrize("buffer", ["exactly the rows", "more than the rows"])
def test_streamed_batches_are_the_frame_batches_when_the_buffer_holds_every_click(tmp_path, with_time, buffer):
    clicks = _clicks(3)
    frame = clicks if with_time else clicks.drop(columns="timestamp")
    shards = _shards(frame, tmp_path / "shards", with_time)
    n, batch_size = len(clicks), 64
    stream = StreamedClicks(shards, SplitPlan("none", n), batch_size, seed=5, train_rows=n,
                            shuffle_buffer=n if buffer == "exactly the rows" else 10 * n)
    memory = FrameClicks(frame, batch_size, seed=5)
    assert stream.steps_per_epoch == memory.steps_per_epoch == 15
    for epoch in range(2):
        for skip in (0, 4):
            streamed = [_decoded(b) for b in stream.epoch(epoch, skip_batches=skip)]
            in_memory = [_decoded(b) for b in memory.epoch(epoch, skip_batches=skip)]
            assert len(streamed) == 15 - skip and streamed == in_memory
        if with_time:  # the timestamp, when yielded, is in the same rows
            times = [b["timestamp"].tolist() for b in train_batches(shards, SplitPlan("none", n), batch_size,
                                                                     shuffle_buffer=n, seed=5, epoch=epoch,
                                                                     with_time=True)]
            assert times == [b["timestamp"].numpy().tolist() for b in memory.epoch(epoch)]
    first, second = (np.concatenate([b["user_id"].numpy() for b in memory.epoch(e)]) for e in (0, 1))
    assert not np.array_equal(first, second)  # reshuffled between epochs


@pytest.mark.parametrize("with_time", [True, False])
def test_a_frame_of_the_plans_training_clicks_gives_the_streams_batches(tmp_path, with_time):
    """``train_clicks``: what a job whose log is in memory trains on (``FrameClicks``) instead of the
    stream; a split plan's test and dropped rows are out, the batches are the stream's."""
    clicks = _clicks(5)
    frame = clicks if with_time else clicks.drop(columns="timestamp")
    shards = _shards(frame, tmp_path / "shards", with_time)
    plan = plan_split(shards, SplitConfig(kind="random", test_fraction=0.3, seed=2), "first")
    rows = scan_counts(shards, plan).train_rows
    training = train_clicks(shards, plan)
    assert len(training) == rows < len(clicks) - 0.2 * len(clicks)  # a test part and dropped repeats
    assert list(training.columns) == ["user_id", "item_id", "weight", *(["timestamp"] if with_time else [])]
    stream = StreamedClicks(shards, plan, 64, seed=5, train_rows=rows, shuffle_buffer=rows)
    memory = FrameClicks(training, 64, seed=5)
    for epoch in range(2):
        assert [_decoded(b) for b in memory.epoch(epoch)] == [_decoded(b) for b in stream.epoch(epoch)]


def test_a_smaller_buffer_is_a_bounded_approximation_of_the_frame_order(tmp_path):
    """A buffer of 200 of the 900 clicks: every click once, seeded, but not the frame's order."""
    clicks = _clicks(4)
    shards = _shards(clicks, tmp_path / "shards", with_time=True)
    batches = list(train_batches(shards, SplitPlan("none", len(clicks)), 64, shuffle_buffer=200, seed=5,
                                 with_time=True))
    streamed = pd.DataFrame({name: np.concatenate([b[name] for b in batches]) for name in clicks.columns})
    assert sorted(_rows(streamed)) == sorted(_rows(clicks))
    frame = clicks.iloc[epoch_order(_keys(clicks), 5, 0)]
    assert _rows(streamed) != _rows(frame)
    again = list(train_batches(shards, SplitPlan("none", len(clicks)), 64, shuffle_buffer=200, seed=5,
                               with_time=True))
    assert len(again) == len(batches) and all((a["user_id"] == b["user_id"]).all() for a, b in zip(batches, again))
