"""MovieLens 100K: locating the folder and loading the real files.

The data is never copied into the repository (the licence forbids it); tests
that need it skip when it is not found.
"""

import math
from pathlib import Path

import pytest

from retrieval.config import DataConfig, SplitConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT, load_dataset, load_movielens_100k, locate_movielens_100k


@pytest.fixture(scope="module")
def folder():
    try:
        return locate_movielens_100k()
    except FileNotFoundError as error:
        pytest.skip(f"MovieLens 100K not available: {error}")


@pytest.fixture(scope="module")
def movielens(folder):
    return load_movielens_100k(folder)


def test_ratings_become_clicks(movielens):
    clicks, _, _ = movielens
    assert len(clicks) == 100_000
    assert clicks.iloc[0][[USER, ITEM, TIME, WEIGHT]].tolist() == ["196", "242", 881250949, 3.0]
    assert clicks[USER].nunique() == 943 and clicks[ITEM].nunique() == 1682
    assert sorted(clicks[WEIGHT].unique()) == [1.0, 2.0, 3.0, 4.0, 5.0]
    # September 1997 to April 1998.
    assert 874_700_000 < clicks[TIME].min() and clicks[TIME].max() < 893_300_000


def test_movies(movielens):
    _, items, _ = movielens
    assert items.columns.tolist() == [ITEM, "title", "release_year", "genres"]
    assert len(items) == 1682 and items[ITEM].is_unique
    toy_story = items.iloc[0]
    assert toy_story[ITEM] == "1" and toy_story["title"] == "Toy Story (1995)"
    assert toy_story["release_year"] == 1995.0
    assert toy_story["genres"] == ["Animation", "Children's", "Comedy"]
    unknown = items.set_index(ITEM).loc["267"]  # the one movie without a date
    assert math.isnan(unknown["release_year"]) and unknown["genres"] == ["unknown"]
    assert items["release_year"].isna().sum() == 1
    assert (items["genres"].str.len() >= 1).all()
    assert "Misérables, Les (1995)" in set(items["title"])  # latin-1 decoded


def test_users(movielens):
    _, _, users = movielens
    assert users.columns.tolist() == [USER, "age", "gender", "occupation", "zip"]
    assert len(users) == 943
    assert users.iloc[0].tolist() == ["1", 24, "M", "technician", "85711"]
    assert set(users["gender"]) == {"M", "F"}


def test_locate_through_the_environment_variable(folder, monkeypatch):
    monkeypatch.setenv("RETRIEVAL_DATA_DIR", str(folder))
    assert locate_movielens_100k() == folder
    monkeypatch.setenv("RETRIEVAL_DATA_DIR", str(folder.parent))  # a folder holding ml-100k/
    assert locate_movielens_100k() == folder


def test_explicit_folder_or_its_parent(folder):
    assert locate_movielens_100k(str(folder)) == folder
    assert locate_movielens_100k(str(folder.parent)) == folder


def test_a_wrong_explicit_folder_fails_listing_the_places_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found; looked in") as error:
        locate_movielens_100k(str(tmp_path))
    # Both places tried are listed; the default copy is not silently used instead.
    assert str(tmp_path) in str(error.value) and str(Path(tmp_path) / "ml-100k") in str(error.value)


def test_load_dataset_keeps_every_movie_in_the_catalogue(folder):
    data = DataConfig(source="movielens-100k", movielens_dir=str(folder))
    dataset = load_dataset(data, SplitConfig(kind="leave_last_k"))
    assert len(dataset.test) == 943 and len(dataset.train) == 100_000 - 943
    assert len(dataset.items) == 1682 and len(dataset.users) == 943
    assert dataset.summary()["catalogue_items_without_train_clicks"] == len(
        set(dataset.items[ITEM]) - set(dataset.train[ITEM])
    )
