"""Click logs in, canonical frames out: loaders, generators, splits, datasets.

Importing this package reads no data and does not import TensorFlow.
"""

from retrieval.data.dataset import Dataset, load_dataset
from retrieval.data.loaders import apply_duplicates, read_clicks, read_feature_table, resolve_format
from retrieval.data.movielens import load_movielens_100k, locate_movielens_100k
from retrieval.data.schema import ITEM, TIME, USER, WEIGHT, DataError
from retrieval.data.shuffle import click_keys, epoch_order
from retrieval.data.splits import hold_out_items, temporal_cut
from retrieval.data.stream_splits import split_clicks
from retrieval.data.synthetic import SyntheticTruth, generate_clicks, synthetic_truth

__all__ = [
    "ITEM",
    "TIME",
    "USER",
    "WEIGHT",
    "DataError",
    "Dataset",
    "SyntheticTruth",
    "apply_duplicates",
    "click_keys",
    "epoch_order",
    "generate_clicks",
    "hold_out_items",
    "load_dataset",
    "load_movielens_100k",
    "locate_movielens_100k",
    "read_clicks",
    "read_feature_table",
    "resolve_format",
    "split_clicks",
    "synthetic_truth",
    "temporal_cut",
]
