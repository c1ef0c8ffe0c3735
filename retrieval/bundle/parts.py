"""The parts of a bundle: each one class that writes its files, reads them back and describes them.

A part (``BundlePart``) writes its files into a bundle directory and returns their entries of the
manifest's ``files`` (``write``), says what the manifest records about it (``info``: manifest keys
and values, e.g. ``{"seen_items": {"num_users", "num_pairs", ...}}``), loads itself from a bundle
through the manifest (``read``; None for a bundle without it) and fingerprints its files
(``fingerprint``). ``LAYOUT`` lists each part's files with what they hold:
docs/operations.md's bundle layout is generated from it (``layout_markdown``), so a new part is
one class here and one entry in ``PARTS``, and the docs cannot leave it out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.bundle.display_features import DISPLAY_FEATURES_FILE, DisplayFeatures
from retrieval.bundle.fingerprints import fingerprint_files
from retrieval.bundle.manifest import MANIFEST_FILE, Manifest
from retrieval.bundle.saved_models import (
    TF_SERVING_CONFIG,
    describe_inputs,
    model_dir,
    save_topk_model,
    save_tower,
    write_tf_serving_config,
)
from retrieval.bundle.seen_items import SEEN_ITEMS_DIR, SeenItems
from retrieval.bundle.user_features import USER_FEATURES_FILE, UserFeatures
from retrieval.bundle.user_histories import USER_HISTORIES_DIR, UserHistories
from retrieval.index import INDEX_FILE, INDEX_INFO_FILE, ITEM_IDS_FILE, ItemIndex


class BundlePart(Protocol):
    """One part of a bundle: its files, its manifest record, how it is read back."""

    # (path in the bundle, what it holds) of each file or folder it writes, for the docs.
    LAYOUT: ClassVar[tuple[tuple[str, str], ...]]

    def write(self, directory: Path) -> dict[str, str]:
        """Write the part's files into ``directory``; return their entries of the manifest's ``files``."""
        ...

    def info(self) -> dict[str, Any]:
        """The manifest keys this part records, with their values."""
        ...

    @classmethod
    def read(cls, directory: Path, manifest: Manifest) -> Any:
        """The part as the bundle holds it (through the manifest's ``files``); None when it holds none."""
        ...

    def fingerprint(self, directory: Path) -> dict[str, Any]:
        """The fingerprints of the files ``write`` wrote (``fingerprint_files``): path -> size and hash."""
        return fingerprint_files(directory, self.write_entries)["files"]

    @property
    def write_entries(self) -> dict[str, str]:
        """The manifest ``files`` entries of this part (known before it is written)."""
        ...


@dataclass
class SavedModelsPart(BundlePart):
    """The towers as SavedModels, where TensorFlow Serving loads them (``retrieval.bundle.saved_models``).

    ``topk``: (item ids [num_items], item embeddings [num_items, dim] in index order, k, popular
    item ids) for the topk model; None writes none.
    """

    query_tower: tf.keras.Model
    doc_tower: tf.keras.Model
    version: int
    topk: tuple[Sequence[str], np.ndarray, int, Sequence[str]] | None = None

    LAYOUT: ClassVar[tuple[tuple[str, str], ...]] = (
        ("models/", "the SavedModels, laid out as TensorFlow Serving loads them (see Serving, \"TensorFlow "
                    "Serving\"); <version> = manifest.json model_version, the export's Unix time in seconds"),
        ("  query/<version>/", "SavedModel: serving_default(user_id: tf.string [batch]) -> {\"embedding\": "
                               "[batch, dim]}"),
        ("  doc/<version>/", "SavedModel: serving_default(item_id: tf.string [batch]) -> {\"embedding\": "
                             "[batch, dim]}"),
        ("  topk/<version>/", "SavedModel: serving_default(raw query features, exclude_item_ids: tf.string "
                              "[batch, E]) -> {\"item_ids\", \"scores\", \"fallback\"}: query tower + every item "
                              "embedding, exact top-k of the items not excluded (export.topk_model)"),
        ("  models.config", "TensorFlow Serving's model config listing the three, base paths under /models "
                            "(docker)"),
    )

    @property
    def write_entries(self) -> dict[str, str]:
        keys = ["query_model", "doc_model", *(["topk_model"] if self.topk is not None else [])]
        return {**{key: model_dir(key, self.version) for key in keys}, "tf_serving_config": TF_SERVING_CONFIG}

    def write(self, directory: Path) -> dict[str, str]:
        files = self.write_entries
        save_tower(self.query_tower, directory / files["query_model"])
        save_tower(self.doc_tower, directory / files["doc_model"])
        if self.topk is not None:
            item_ids, embeddings, k, popular = self.topk
            save_topk_model(directory / files["topk_model"], query_tower=self.query_tower, item_ids=list(item_ids),
                            item_embeddings=embeddings, k=k, popular_item_ids=popular)
        write_tf_serving_config(directory, files)
        return files

    def info(self) -> dict[str, Any]:
        return {
            "model_version": self.version,
            "query_features": list(self.query_tower.input_names),
            "doc_features": list(self.doc_tower.input_names),
            "query_inputs": describe_inputs(self.query_tower),
            "doc_inputs": describe_inputs(self.doc_tower),
        }

    @classmethod
    def read(cls, directory: Path, manifest: Manifest) -> Any:
        """The query SavedModel (what serving runs), loaded with ``tf.saved_model.load``."""
        return tf.saved_model.load(str(directory / manifest.files["query_model"]))


@dataclass
class IndexPart(BundlePart):
    """The FAISS index over every catalogue item, its item ids and its description (``retrieval.index``)."""

    index: ItemIndex

    LAYOUT: ClassVar[tuple[tuple[str, str], ...]] = (
        (INDEX_FILE, "FAISS inner-product index over every catalogue item"),
        (ITEM_IDS_FILE, "index row -> item id (columns row, item_id)"),
        (INDEX_INFO_FILE, "factory string, dim, size, normalized, tuned search params + measured recall"),
    )

    @property
    def write_entries(self) -> dict[str, str]:
        return {"index": INDEX_FILE, "item_ids": ITEM_IDS_FILE, "index_info": INDEX_INFO_FILE}

    def write(self, directory: Path) -> dict[str, str]:
        self.index.save(directory)
        return self.write_entries

    def info(self) -> dict[str, Any]:
        return {"embedding_dim": self.index.dim, "metric": "inner_product", "normalized": self.index.normalized,
                "num_items": len(self.index), "index": self.index.info()}

    @classmethod
    def read(cls, directory: Path, manifest: Manifest) -> ItemIndex:
        return ItemIndex.load(directory)


@dataclass
class _TablePart(BundlePart):
    """A part that is one table at one path of the bundle (a file or a folder), under its manifest key.

    A subclass names them in its header: ``key`` (its entry under the manifest's files, and the key
    of its record), ``path`` (in the bundle; a folder ends in "/"), ``table`` (the class whose
    ``load(path)`` reads it) and ``layout`` (what it holds, for the docs).
    """

    table: Any
    KEY: ClassVar[str]
    PATH: ClassVar[str]
    TABLE: ClassVar[Any]
    LAYOUT: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init_subclass__(cls, *, key: str = "", path: str = "", table: Any = None, layout: str = "", **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if key:
            cls.KEY, cls.PATH, cls.TABLE = key, path.rstrip("/"), table
            cls.LAYOUT = ((path, layout),)

    @property
    def write_entries(self) -> dict[str, str]:
        return {self.KEY: self.PATH}

    def write(self, directory: Path) -> dict[str, str]:
        self.table.save(directory / self.PATH)
        return self.write_entries

    def info(self) -> dict[str, Any]:
        return {self.KEY: self.table.info()}

    @classmethod
    def read(cls, directory: Path, manifest: Manifest) -> Any:
        path = manifest.files.get(cls.KEY)
        return None if path is None else cls.load(directory / path, manifest)

    @classmethod
    def load(cls, path: Path, manifest: Manifest) -> Any:
        """The table at ``path`` (the manifest's entry), as the manifest describes it."""
        return cls.TABLE.load(path)


@dataclass
class _UserRowsPart(_TablePart):
    """A per-user table of index rows (a ``UserRowTable``), refused when a row is past the index."""

    table: SeenItems | UserHistories
    num_items: int

    def write(self, directory: Path) -> dict[str, str]:
        rows = self.table.item_rows
        if len(rows) and int(rows.max()) >= self.num_items:
            raise ValueError(f"{self.KEY} holds index rows up to {int(rows.max())}, "
                             f"past the {self.num_items} items of the index")
        return super().write(directory)


@dataclass
class SeenItemsPart(
    _UserRowsPart, key="seen_items", path=f"{SEEN_ITEMS_DIR}/", table=SeenItems,
    layout="each training user's distinct training items as index rows, which serving excludes: user_ids.npy "
           "(sorted UTF-8 ids), indptr.npy (int64), item_rows.npy (int32), CSR",
):
    """Each training user's distinct training items, which serving excludes (``retrieval.bundle.seen_items``)."""

    table: SeenItems


@dataclass
class UserHistoriesPart(
    _UserRowsPart, key="user_histories", path=f"{USER_HISTORIES_DIR}/", table=UserHistories,
    layout="with a query tower that reads a click history: each training user's last export.history_clicks "
           "(default 200) training clicks as index rows, newest first, the same three .npy files; serving fills "
           "the history of a query that sends only the user id",
):
    """Each training user's recent clicks, newest first, which serving fills into a query lacking its
    history (``retrieval.bundle.user_histories``)."""

    table: UserHistories

    @classmethod
    def load(cls, path: Path, manifest: Manifest) -> UserHistories:
        """The histories, read with the manifest's ``limit``.

        Raises:
          KeyError: the manifest lists the folder but records no ``user_histories.limit``.
        """
        return UserHistories.load(path, int((manifest.user_histories or {})["limit"]))


@dataclass
class UserFeaturesPart(
    _TablePart, key="user_features", path=USER_FEATURES_FILE, table=UserFeatures,
    layout="with feature towers and a user feature table: user_id and each raw user feature the query tower "
           "reads, one row per known user; serving fills the features a request lacks from its user's row",
):
    """Each known user's raw query features, which serving fills into a request lacking them
    (``retrieval.bundle.user_features``); every feature column must be a query input."""

    table: UserFeatures

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, query_inputs: Sequence[str]) -> UserFeaturesPart:
        table = UserFeatures.from_frame(frame)
        strangers = [name for name in table.features if name not in query_inputs]
        if strangers:
            raise ValueError(f"user_features columns {strangers} are not inputs of the query tower "
                             f"({list(query_inputs)})")
        return cls(table)


# Its manifest key is "item_features" since the first bundles that shipped it.
@dataclass
class DisplayFeaturesPart(
    _TablePart, key="item_features", path=DISPLAY_FEATURES_FILE, table=DisplayFeatures,
    layout="with an item feature table: item_id and its string, number and list-of-string columns, one row per "
           "indexed item it describes, for display (POST /items, the web page); the towers never read it",
):
    """The catalogue's display features (title, category, ...) for the web page and ``POST /items``;
    never read by the towers (``retrieval.bundle.display_features``)."""

    table: DisplayFeatures

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, catalogue: Sequence[str]) -> DisplayFeaturesPart | None:
        """The part of a raw item feature table; None when no display column is left."""
        table = DisplayFeatures.from_frame(frame, list(catalogue))
        return cls(table) if table.features else None


# Every part, in the order the layout lists them.
PARTS: tuple[type[BundlePart], ...] = (
    SavedModelsPart, IndexPart, SeenItemsPart, UserHistoriesPart, UserFeaturesPart, DisplayFeaturesPart,
)
# manifest.json's line: every key of the typed manifest, so a new key is documented once regenerated.
MANIFEST_LAYOUT = (
    MANIFEST_FILE,
    "written last, a JSON object of the keys of retrieval.bundle.manifest.Manifest (see its comments): "
    + ", ".join(Manifest.model_fields),
)
LAYOUT_WIDTH = 110  # characters a layout line may take


def layout_lines(entries: Mapping[str, str] | Sequence[tuple[str, str]]) -> list[str]:
    """``path  description`` lines, the description wrapped under itself at ``LAYOUT_WIDTH``."""
    pairs = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
    column = max(len(path) for path, _ in pairs) + 2
    lines = []
    for path, text in pairs:
        words, line = text.split(), ""
        first = True
        for word in words:
            if line and column + len(line) + 1 + len(word) > LAYOUT_WIDTH:
                lines.append((path if first else "").ljust(column) + line)
                first, line = False, word
            else:
                line = f"{line} {word}" if line else word
        lines.append((path if first else "").ljust(column) + line)
    return lines


def layout_markdown() -> str:
    """The bundle layout as docs/operations.md shows it: manifest.json and every part's files."""
    entries = [MANIFEST_LAYOUT, *(entry for part in PARTS for entry in part.LAYOUT)]
    return "```\nartifacts/<run>/\n" + "\n".join("  " + line for line in layout_lines(entries)) + "\n```\n"
