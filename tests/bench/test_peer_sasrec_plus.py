"""benchmarks.peer_sasrec_plus's split and metrics (plain numpy; no torch needed): a 3-user file split by
hand, ranks against a brute-force sort, HR/NDCG against figures computed by hand."""

import math

import numpy as np
import pytest

from benchmarks.peer_sasrec_plus import (
    data_counts,
    hit_rate_and_ndcg,
    leave_last_two,
    metrics_at,
    parse_args,
    read_catalogue,
    read_sequences,
    target_ranks,
)


def test_the_last_item_is_the_test_target_the_one_before_it_validation(tmp_path):
    path = tmp_path / "sequences.txt"
    path.write_text("1 10 11 12 13\n2 20 21 22\n\n3 30 31 32 33 34\n")
    split = leave_last_two(read_sequences(path))
    assert split.test == {1: 13, 2: 22, 3: 34}
    assert split.validation == {1: 12, 2: 21, 3: 33}
    assert {user: items.tolist() for user, items in split.train.items()} == {1: [10, 11], 2: [20], 3: [30, 31, 32]}


def test_counts_of_training_positions_and_unrankable_targets(tmp_path):
    path = tmp_path / "sequences.txt"
    # training items: [10, 11, 12, 13], [20], [30, 10]; validation 14, 21, 31; test 40 (unseen), 21, 10
    path.write_text("1 10 11 12 13 14 40\n2 20 21 21\n3 30 10 31 10\n")
    split = leave_last_two(read_sequences(path))
    # windows of at most max_length + 1 = 3 items: [11, 12, 13] -> 2 targets, [20] -> 0, [30, 10] -> 1
    assert data_counts(split, max_length=2) == {
        "training_positions": 3,
        "test_targets_unseen_in_training": 2,  # 40 and 21 (21 is only a validation item)
        "test_targets_unseen_in_training_or_validation": 1,  # 40
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1 10 11 12\n2 20 21\n", r"line 2: user 2 has 2 items"),
        ("1 10 11 12\n1 20 21 22\n", r"line 2: user 1 appears twice"),
        ("1 10 x 12\n", r"line 1: a field is not an integer"),
        ("\n", "no sequences"),
    ],
)
def test_bad_sequence_files_are_refused_naming_the_line(tmp_path, text, message):
    path = tmp_path / "sequences.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_sequences(path)


def test_the_catalogue_is_the_first_column(tmp_path):
    path = tmp_path / "items.txt"
    path.write_text("1\tlipstick\n2\n5\tsoap\n")
    assert read_catalogue(path).tolist() == [1, 2, 5]
    path.write_text("1\nsoap\n")
    with pytest.raises(ValueError, match=r"line 2: item id 'soap'"):
        read_catalogue(path)


def test_ranks_of_a_known_row_with_exclusions_and_a_catalogue():
    scores = np.array([[0.0, 0.9, 0.5, 0.7, 0.2, 0.8]])
    target = np.array([2])
    assert target_ranks(scores, target, [np.array([], int)]).tolist() == [4]  # 0.9, 0.8, 0.7 above it
    assert target_ranks(scores, target, [np.array([1, 5])]).tolist() == [2]  # only 0.7 left above
    catalogue = np.array([False, True, True, False, True, True])  # column 3 is no item
    assert target_ranks(scores, target, [np.array([1])], catalogue).tolist() == [2]  # only 0.8
    assert target_ranks(scores, target, [np.array([2])]).tolist() == [7]  # an excluded target is a miss
    assert target_ranks(scores, np.array([3]), [np.array([], int)], catalogue).tolist() == [7]


def test_a_padded_history_row_excludes_its_padding_column_too():
    scores = np.array([[3.0, 1.0, 2.0, 0.5], [3.0, 1.0, 2.0, 0.5]])
    padded = np.array([[2, 0], [2, 1]])  # the first row's history is one item, padded with column 0
    assert target_ranks(scores, np.array([3, 3]), padded).tolist() == [2, 2]
    assert target_ranks(scores, np.array([3, 3]), [np.array([2]), np.array([2, 1])]).tolist() == [3, 2]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranks_equal_a_brute_force_sort(seed):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(20, 50)).astype(np.float32)
    targets = rng.integers(0, 50, size=20)
    catalogue = rng.random(50) < 0.8
    catalogue[targets] = True
    excluded = [rng.choice(np.setdiff1d(np.arange(50), [t]), size=rng.integers(0, 10), replace=False) for t in targets]
    expected = []
    for row, target, seen in zip(scores, targets, excluded):
        order = [c for c in np.argsort(-row, kind="stable") if catalogue[c] and c not in set(seen.tolist())]
        expected.append(order.index(target) + 1)
    assert target_ranks(scores, targets, excluded, catalogue).tolist() == expected


def test_hit_rate_and_ndcg_by_hand():
    ranks = np.array([1, 3, 11, 2])
    hr, ndcg = hit_rate_and_ndcg(ranks, 10)
    assert hr == pytest.approx(0.75)
    assert ndcg == pytest.approx((1 + 1 / math.log2(4) + 1 / math.log2(3)) / 4)
    assert hit_rate_and_ndcg(ranks, 2) == pytest.approx((0.5, (1 + 1 / math.log2(3)) / 4))
    assert metrics_at(ranks, (1,)) == pytest.approx({"hr@1": 0.25, "ndcg@1": 0.25})


def test_bad_metric_and_rank_input_is_refused():
    with pytest.raises(ValueError, match="k >= 1"):
        hit_rate_and_ndcg(np.array([1]), 0)
    with pytest.raises(ValueError, match=r"scores \(4,\) and targets \(1,\)"):
        target_ranks(np.zeros(4), np.array([0]), [np.array([], int)])
    with pytest.raises(ValueError, match="2 excluded rows for 1 score rows"):
        target_ranks(np.zeros((1, 4)), np.array([0]), [np.array([], int)] * 2)


def test_caps_below_one_are_refused():
    with pytest.raises(SystemExit):
        parse_args(["--reference-dir", "ref", "--max-epochs", "0"])
    args = parse_args(["--reference-dir", "ref", "--max-epochs", "100", "--patience", "10"])
    assert (args.max_epochs, args.patience) == (100, 10)
    assert args.command.endswith("--reference-dir ref --max-epochs 100 --patience 10")
