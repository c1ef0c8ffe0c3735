"""A small click log with user and item features of every kind, shared by the feature tests of every stage."""

import numpy as np
import pandas as pd

from retrieval.config import TowersConfig

# Every feature kind, with missing values, an OOV-able prefix, hashing, both list formats and a history.
ALL_KINDS = TowersConfig.model_validate(
    {
        "query": {
            "features": [
                {"name": "user_id", "kind": "id", "embedding_dim": 6, "dropout": 0.2},
                {"name": "age", "kind": "numeric"},
                {"name": "zip", "kind": "categorical", "prefix": 3, "embedding_dim": 3},
                {"name": "country", "kind": "categorical", "hash_buckets": 7, "embedding_dim": 3},
                {"name": "signup", "kind": "timestamp", "unit": "seconds"},
            ],
            "history": {"length": 3, "pooling": "attention", "share_item_embedding": True},
            "mlp": {"widths": [16], "dropout": 0.1},
        },
        "doc": {
            "features": [
                {"name": "item_id", "kind": "id", "embedding_dim": 5},
                {"name": "genres", "kind": "multi_categorical", "max_values": 2, "embedding_dim": 4},
                {"name": "tags", "kind": "multi_categorical", "separator": "|", "max_values": 3, "hash_buckets": 11},
                {"name": "price", "kind": "numeric", "log": True},
                {"name": "released", "kind": "timestamp", "unit": "years"},
                {"name": "title", "kind": "text", "embedding_dim": 4, "text": {"buckets": 64}},
            ]
        },
    }
)


def small_tables(seed: int = 0, n_clicks: int = 60):
    """(clicks, users, items): 6 users, 8 items (i7 never clicked), timestamps with ties."""
    rng = np.random.default_rng(seed)
    users = pd.DataFrame(
        {
            "user_id": [f"u{i}" for i in range(6)],
            "age": [23.0, np.nan, 41.0, 35.0, 19.0, 62.0],
            "zip": ["10001", "10013", "94110", "94105", "60601", None],
            "country": ["US", "US", "DE", "FR", None, "US"],
            "signup": [1.70e9, 1.71e9, np.nan, 1.69e9, 1.72e9, 1.705e9],
        }
    )
    items = pd.DataFrame(
        {
            "item_id": [f"i{i}" for i in range(8)],
            "genres": [["Drama"], ["Comedy", "Drama"], ["Action", "Comedy", "War"], [], ["Drama"], ["Comedy"],
                       ["Action"], ["Horror", "Drama"]],
            "tags": ["a|b", "b", "", "c|a|b|d", "a", None, "b|c", "zz"],
            "price": [9.99, np.nan, 20.0, 3.5, 0.0, 120.0, 15.0, 7.0],
            "released": [1995.0, 1997.0, np.nan, 1980.0, 1999.0, 2001.0, 1994.0, 2002.0],
            "title": ["Toy Story (1995)", "GoldenEye", "Café au lait", "", "Twelve Monkeys: 12", "l'amour",
                      "Heat", "Brand New Thing"],
        }
    )
    clicks = pd.DataFrame(
        {
            "user_id": rng.choice(users["user_id"].to_numpy(), n_clicks),
            "item_id": rng.choice(items["item_id"].to_numpy()[:7], n_clicks),
            "timestamp": 1_700_000_000 + rng.integers(0, 12, n_clicks) * 3600,  # few distinct times: many ties
            "weight": np.ones(n_clicks, np.float32),
        }
    )
    return clicks, users, items


def write_feature_bundle(directory, towers: TowersConfig = ALL_KINDS, *, topk: bool = True, manifest=None,
                         history_clicks: int | None = None):
    """A bundle of untrained (seeded) feature towers over ``small_tables(0)``, with the user table's
    features (``user_features.parquet``): (directory, tables, query tower, doc tower, catalogue,
    item embeddings). Builds two or three SavedModels (~10-30 s on 2 cores). ``history_clicks``:
    store each user's last that many clicks (``user_histories/``) and its training items (``seen_items/``),
    as the job does for a history tower."""
    import tensorflow as tf

    from retrieval.bundle.seen_items import SeenItems
    from retrieval.bundle.writer import write_bundle
    from retrieval.config import ModelConfig
    from retrieval.features import TowerStatistics, TowerTables
    from retrieval.index import ItemIndex
    from retrieval.towers import build_towers
    from retrieval.training import embed_frame

    clicks, users, items = small_tables(0)
    tables = TowerTables(towers, clicks, users, items)
    stats = TowerStatistics.fit(towers, tables.examples(), tables.reference_time)
    tf.keras.utils.set_random_seed(1)
    query, doc = build_towers(towers, ModelConfig(embedding_dim=8), stats)
    catalogue = tables.catalogue()
    item_embeddings = embed_frame(doc, catalogue)
    index = ItemIndex.build(catalogue["item_id"].tolist(), item_embeddings)
    write_bundle(directory, query_tower=query, doc_tower=doc, index=index,
                 manifest=manifest or {"popular_item_ids": ["i0", "i1"]},
                 item_embeddings=item_embeddings if topk else None, topk_k=3 if topk else None,
                 user_features=tables.user_features(),
                 user_histories=None if history_clicks is None else stored_histories(
                     clicks, index.item_ids, history_clicks),
                 seen_items=None if history_clicks is None else SeenItems.from_pairs(
                     clicks["user_id"], pd.Index(index.item_ids, dtype=object).get_indexer(clicks["item_id"])))
    return directory, tables, query, doc, catalogue, item_embeddings


def stored_histories(clicks, index_item_ids, limit: int):
    """``UserHistories`` of a click frame as the job stores them (``jobs.user_histories_of``)."""
    from retrieval.bundle.user_histories import UserHistories
    from retrieval.features.histories import ClickHistories

    user_rows, user_ids = pd.factorize(clicks["user_id"].astype(str))
    item_rows, item_ids = pd.factorize(clicks["item_id"].astype(str))
    histories = ClickHistories(user_rows, item_rows, clicks["timestamp"].to_numpy(), user_ids, item_ids)
    users, indptr, rows = histories.recent(limit)
    index_rows = pd.Index(index_item_ids, dtype=object).get_indexer(pd.Index(histories.item_ids, dtype=object))
    return UserHistories.from_recent(users, indptr, index_rows[rows], limit)

