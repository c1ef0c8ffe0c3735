"""A FAISS inner-product index over every catalogue item, with the row -> id map.

Retrieval is an argmax over logits: softmax is monotone, so
``argmax_i softmax(z)_i == argmax_i z_i`` and the top-k by dot product is the
top-k by model probability. Neither softmax nor the log-Q correction (a
training-time fix for how negatives were sampled) is applied at inference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import faiss
import numpy as np
import pandas as pd

from retrieval.arrays import drop_members

INDEX_FILE = "index.faiss"
ITEM_IDS_FILE = "item_ids.parquet"
INDEX_INFO_FILE = "index.json"


@dataclass(frozen=True)
class TopK:
    """Search results, best first.

    Attributes:
      scores: [num_queries, k] float32 dot products; -inf where fewer than k
        items were available.
      rows: [num_queries, k] int64 index rows; -1 where no item.
    """

    scores: np.ndarray
    rows: np.ndarray


class ItemIndex:
    """FAISS index + item ids; row r of the index is ``item_ids[r]``."""

    def __init__(self, index: faiss.Index, item_ids: Sequence[str], factory: str):
        if index.ntotal != len(item_ids):
            raise ValueError(f"index holds {index.ntotal} vectors but {len(item_ids)} item ids were given")
        self.index = index
        self.item_ids = np.asarray(item_ids, dtype=object)
        self.factory = factory

    @classmethod
    def build(cls, item_ids: Sequence[str], embeddings: np.ndarray, factory: str = "Flat") -> "ItemIndex":
        """Index ``embeddings`` [num_items, dim] for inner-product search.

        Args:
          item_ids: [num_items] unique string ids, in embedding row order.
          embeddings: [num_items, dim] float32.
          factory: a FAISS index factory string ("Flat", "IVF256,Flat", "HNSW32", ...).
        """
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        if embeddings.ndim != 2 or embeddings.shape[0] == 0:
            raise ValueError(f"embeddings must be [num_items, dim] with num_items > 0, got {embeddings.shape}")
        if len(item_ids) != embeddings.shape[0]:
            raise ValueError(f"{len(item_ids)} item ids for {embeddings.shape[0]} embeddings")
        if len(set(item_ids)) != len(item_ids):
            raise ValueError("item ids must be unique")
        if not np.all(np.isfinite(embeddings)):
            raise ValueError("embeddings contain NaN or inf")
        try:
            index = faiss.index_factory(embeddings.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as error:
            raise ValueError(f"index.factory {factory!r} is not a valid FAISS factory string: {error}") from None
        if not index.is_trained:
            index.train(embeddings)
        index.add(embeddings)
        return cls(index, list(item_ids), factory)

    @property
    def dim(self) -> int:
        return self.index.d

    def __len__(self) -> int:
        return self.index.ntotal

    @property
    def is_exact(self) -> bool:
        """True when search is brute force (results equal a full argsort)."""
        return isinstance(self.index, (faiss.IndexFlatIP, faiss.IndexFlat))

    def search(
        self,
        queries: np.ndarray,
        k: int,
        exclude: Sequence[np.ndarray] | None = None,
    ) -> TopK:
        """Top-k rows by inner product for each query.

        Args:
          queries: [num_queries, dim] float32.
          k: results per query.
          exclude: optional per-query arrays of index rows that must not be
            returned (e.g. items the user already clicked).

        Returns:
          TopK with [num_queries, k] scores and rows.
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be [num_queries, {self.dim}], got {queries.shape}")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if exclude is not None and len(exclude) != len(queries):
            raise ValueError(f"exclude has {len(exclude)} entries for {len(queries)} queries")
        extra = 0 if exclude is None else max((len(rows) for rows in exclude), default=0)
        depth = min(k + extra, len(self))
        scores, rows = self.index.search(queries, depth)
        if extra:
            rows, scores = drop_members(rows, scores, exclude)
        return _pad(scores[:, :k], rows[:, :k], k)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        faiss.write_index(self.index, str(directory / INDEX_FILE))
        pd.DataFrame({"row": np.arange(len(self)), "item_id": self.item_ids.astype(str)}).to_parquet(
            directory / ITEM_IDS_FILE, index=False
        )
        info = {"factory": self.factory, "dim": self.dim, "ntotal": len(self), "metric": "inner_product"}
        (directory / INDEX_INFO_FILE).write_text(json.dumps(info, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "ItemIndex":
        directory = Path(directory)
        info = json.loads((directory / INDEX_INFO_FILE).read_text())
        item_ids = pd.read_parquet(directory / ITEM_IDS_FILE).sort_values("row")["item_id"].tolist()
        return cls(faiss.read_index(str(directory / INDEX_FILE)), item_ids, info["factory"])


def _pad(scores: np.ndarray, rows: np.ndarray, k: int) -> TopK:
    missing = k - rows.shape[1]
    if missing > 0:
        scores = np.pad(scores, ((0, 0), (0, missing)), constant_values=-np.inf)
        rows = np.pad(rows, ((0, 0), (0, missing)), constant_values=-1)
    scores = np.where(rows < 0, -np.inf, scores).astype(np.float32)
    return TopK(scores=scores, rows=rows.astype(np.int64))
