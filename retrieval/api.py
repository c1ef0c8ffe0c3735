"""The Python API: a whole run in a few calls, for notebooks and scripts (``docs/python-api.md``).

    import retrieval

    run = retrieval.train("configs/ml100k.yaml", overrides=["train.epochs=5"])
    run.metrics["model"]["recall@20"]        # the job's evaluation, as in metrics.json
    run.recommend("196", k=10)               # Recommendations: item_ids, scores, fallback
    run.similar_items("50", k=10)
    run.evaluate(["evaluation.ks=[10,50]"])  # re-evaluated from the exported bundle

    run = retrieval.open_run("artifacts/20261203-120000-ml100k")   # an exported run, later

``train`` is ``make train``'s job (``jobs.train_evaluate_export``): the same defaults, run directory
and bundle. ``towers=`` plugs in one's own Keras towers (``jobs.TowerFactory``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrieval.config import Config, ConfigError, apply_overrides, load_config
from retrieval.data import USER
from retrieval.jobs import TowerFactory, evaluate_bundle, train_evaluate_export
from retrieval.serving import Bundle, HistoryOrder, Recommendations

ConfigLike = Config | str | os.PathLike | None


@dataclass
class Run:
    """An exported run: its directory, the job's metrics, and its bundle (loaded on first use).

    ``seconds`` is the job's wall time (None for a run opened from disk).
    """

    directory: Path
    metrics: dict[str, Any]
    seconds: float | None = None
    _bundle: Bundle | None = field(default=None, repr=False)

    @property
    def bundle(self) -> Bundle:
        """The served bundle (``serving.Bundle``): SavedModel, FAISS index, item ids, seen items."""
        if self._bundle is None:
            self._bundle = Bundle.load(self.directory)
        return self._bundle

    @property
    def config(self) -> Config:
        """The config the run trained with (its manifest's copy, every default filled in)."""
        return Config.from_dict(self.bundle.manifest["config"], source=f"{self.directory}/manifest.json config")

    def recommend(
        self,
        user_id: str | int | None = None,
        k: int = 10,
        *,
        exclude_item_ids: Sequence[str | int] | None = (),
        exclude_seen: bool = True,
        history_order: HistoryOrder = "newest_first",
        filters: Mapping[str, Any] | None = None,
        **features: Any,
    ) -> Recommendations:
        """Top-k for one user: ``user_id`` and/or raw query ``features`` (e.g. ``history=[...]``) as the
        bundle's query tower reads them (a known user's id alone: its stored features and clicks);
        the user's training items are left out unless ``exclude_seen=False``; a history in time
        order takes ``history_order="oldest_first"``; ``filters`` (e.g. ``{"year": {"min": 1990}}``)
        keep the answer to the items of the bundle's item table that pass them (``Bundle.recommend``)."""
        query: dict[str, Any] = dict(features)
        if user_id is not None:
            query[USER] = user_id  # checked by the bundle: a string or an int, as every entry point reads ids
        return self.bundle.recommend(query, k, exclude_item_ids, exclude_seen=exclude_seen,
                                     history_order=history_order, filters=filters)

    def recommend_batch(
        self, queries: Sequence[Mapping[str, Any]], k: int = 10, *, exclude_seen: bool = True,
        history_order: HistoryOrder = "newest_first", filters: Mapping[str, Any] | None = None,
    ) -> list[Recommendations]:
        """``recommend`` for many raw queries at once (one embedding and one index search)."""
        return self.bundle.recommend_batch(queries, k, exclude_seen=exclude_seen, history_order=history_order,
                                           filters=filters)

    def similar_items(
        self, item_id: str | int, k: int = 10, *, filters: Mapping[str, Any] | None = None
    ) -> Recommendations:
        """The k catalogue items nearest ``item_id`` by the doc tower's embeddings, itself left out;
        ``filters`` as ``recommend`` takes them."""
        return self.bundle.similar_items(item_id, k, filters=filters)

    def evaluate(self, overrides: Sequence[str] = (), *, out: str | os.PathLike | None = None) -> dict[str, Any]:
        """Re-evaluate the exported bundle on the data its config names (``jobs.evaluate_bundle``):
        ``overrides`` such as ``"evaluation.ks=[10,50]"``; ``out`` writes metrics.json and report.md."""
        return evaluate_bundle(self.directory, list(overrides), out=None if out is None else Path(out))


def train(
    config: ConfigLike = None,
    *,
    overrides: Sequence[str] = (),
    towers: TowerFactory | None = None,
    name: str | None = None,
) -> Run:
    """Train, evaluate and export one run, as ``make train`` does.

    Args:
      config: a ``Config``, a YAML path, or None for the code's defaults (the project's recipe on
        the built-in synthetic log).
      overrides: ``"section.key=value"`` changes, as ``--set`` on the command line.
      towers: ``context -> (query_tower, doc_tower)``, one's own Keras towers in place of the ID
        towers (see ``jobs.TowerContext``; not yet with a ``towers:`` feature section).
      name: the run directory's name under ``run.output_dir`` (default: time and config name).

    Returns:
      The exported ``Run``.
    """
    if isinstance(config, Config):
        loaded = _overridden(config, overrides)
        config_name = "python"
    elif config is None or isinstance(config, str | os.PathLike):
        loaded = load_config(config, list(overrides))
        config_name = "default" if config is None else Path(config).stem
    else:
        raise ConfigError(f"config must be a Config, a YAML path or None, got {type(config).__name__}")
    if name is not None:
        loaded = _overridden(loaded, [f"run.name={json.dumps(name)}"])
    result = train_evaluate_export(loaded, config_name=config_name, towers=towers)
    return Run(result.directory, result.metrics, result.seconds)


def open_run(directory: str | os.PathLike) -> Run:
    """An exported run directory (``artifacts/<run>``), its metrics and bundle, as ``train`` returned it;
    a directory that holds no loadable bundle is a ``BundleError`` saying why."""
    directory = Path(directory)
    bundle = Bundle.load(directory)
    metrics_file = directory / "metrics.json"  # a re-indexed bundle holds none of its own
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    return Run(directory, metrics, _bundle=bundle)


def _overridden(config: Config, overrides: Sequence[str]) -> Config:
    if not overrides:
        return config
    return Config.from_dict(apply_overrides(config.to_dict(), list(overrides)), "<Config> + " + " ".join(overrides))


__all__ = ["Run", "train", "open_run", "load_config"]
