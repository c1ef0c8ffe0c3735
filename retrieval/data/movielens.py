"""MovieLens 100K: find the folder and load ratings, movies and users.

The files are never copied into this repository (the GroupLens licence forbids
redistribution); they are read where the user keeps them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from retrieval.config import ColumnsConfig, TableConfig
from retrieval.data.loaders import read_clicks, read_feature_table
from retrieval.data.schema import ITEM, USER

ENV_VAR = "RETRIEVAL_DATA_DIR"
_FOLDER = "ml-100k"
_MARKER = "u.data"


def locate_movielens_100k(explicit: str | None = None) -> Path:
    """Find the MovieLens 100K folder (the one holding ``u.data``).

    Places tried, in order:

    1. ``explicit`` (``data.movielens_dir``), or its ``ml-100k`` subfolder. When
       given it is the only place tried: a configured path that is wrong must
       fail, not silently fall back to another copy.
    2. ``$RETRIEVAL_DATA_DIR``, the ml-100k folder itself or a folder holding
       ``ml-100k/``.
    3. ``../shared/datasets/ml-100k`` next to the repository root (the parent
       of the ``retrieval`` package), then relative to the working directory.

    Args:
        explicit: A folder given in the config, or None.

    Returns:
        The resolved folder.

    Raises:
        FileNotFoundError: No candidate holds ``u.data``; the message lists
            every place looked.
    """
    if explicit is not None:
        candidates = [Path(explicit), Path(explicit) / _FOLDER]
    else:
        candidates = []
        if os.environ.get(ENV_VAR):
            root = Path(os.environ[ENV_VAR])
            candidates += [root, root / _FOLDER]
        repo_root = Path(__file__).resolve().parents[2]
        candidates += [
            repo_root.parent / "shared" / "datasets" / _FOLDER,
            Path.cwd().parent / "shared" / "datasets" / _FOLDER,
        ]
    candidates = list(dict.fromkeys(folder.absolute() for folder in candidates))  # no repeats
    for folder in candidates:
        if (folder / _MARKER).is_file():
            return folder.resolve()
    looked = "\n".join(f"  {folder}" for folder in candidates)
    raise FileNotFoundError(
        f"MovieLens 100K ({_MARKER}) not found; looked in:\n{looked}\n"
        f"Set data.movielens_dir or ${ENV_VAR} to the ml-100k folder "
        "(download it from https://grouplens.org/datasets/movielens/100k/)."
    )


def load_movielens_100k(folder: str | os.PathLike) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Load ratings as clicks, and movie and user features.

    Args:
        folder: The ml-100k folder (see ``locate_movielens_100k``).

    Returns:
        ``(clicks, items, users)``:

        - clicks: canonical frame from ``u.data``; the 1-5 rating is the weight.
        - items: ``item_id`` (str), ``title`` (str), ``release_year`` (float,
          NaN where the date is missing) and ``genres`` (a list of genre
          names from ``u.genre``; every movie has at least one, possibly
          ``"unknown"``), one row per movie of ``u.item``.
        - users: ``user_id`` (str), ``age`` (int64), ``gender``,
          ``occupation`` and ``zip`` (str), from ``u.user``.

    Raises:
        DataError: A file is missing or malformed.
    """
    folder = Path(folder)
    clicks = read_clicks(TableConfig(path=str(folder / "u.data"), format="movielens-100k"), ColumnsConfig())
    return clicks, _items(folder), _users(folder)


def _pipe_table(path: Path, id_column: str, encoding: str = "utf-8") -> pd.DataFrame:
    table = TableConfig(path=str(path), format="csv", separator="|", header=False, encoding=encoding)
    return read_feature_table(table, id_column)


def _items(folder: Path) -> pd.DataFrame:
    # u.genre lines are "name|index"; u.item holds 19 flags in that index order.
    genres = _pipe_table(folder / "u.genre", id_column="1")
    names = genres["0"].to_numpy(dtype=object)[np.argsort(genres["1"].astype(int).to_numpy())]
    # Titles are latin-1 ("Café au lait"), as GroupLens wrote them.
    raw = _pipe_table(folder / "u.item", id_column="0", encoding="latin-1")
    flags = raw[[str(5 + i) for i in range(len(names))]].to_numpy(dtype=np.int64) == 1
    # Dates look like "01-Jan-1995"; the year is all the model needs.
    year = pd.to_numeric(raw["2"].astype(str).str[-4:], errors="coerce").astype(np.float64)
    return pd.DataFrame(
        {
            ITEM: raw["0"],
            "title": raw["1"],
            "release_year": year,
            "genres": [list(names[row]) for row in flags],
        }
    )


def _users(folder: Path) -> pd.DataFrame:
    raw = _pipe_table(folder / "u.user", id_column="0")
    return pd.DataFrame(
        {
            USER: raw["0"],
            "age": raw["1"].astype(np.int64),
            "gender": raw["2"].astype(str),
            "occupation": raw["3"].astype(str),
            "zip": raw["4"].astype(str),
        }
    )
