"""The main job: data -> train -> index -> evaluate -> export, in one run directory."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.bundle.manifest import read_manifest
from retrieval.bundle.run_directory import atomic_directory
from retrieval.bundle.seen_items import SeenItems
from retrieval.bundle.user_histories import UserHistories
from retrieval.bundle.writer import write_bundle
from retrieval.common.arrays import seeded_subset
from retrieval.common.native_logs import runtime_filtered_stderr
from retrieval.config import Config, ConfigError, save_config, warm_start_parent, with_absolute_data_paths
from retrieval.data import ITEM, TIME, USER, WEIGHT, DataError
from retrieval.data.dataset import LogSource, catalogue_table, open_log, split_summary
from retrieval.data.fingerprint import RunInputs
from retrieval.data.shards import ClickTable
from retrieval.data.splits import training_split
from retrieval.data.streaming import (
    ClickLog,
    Plan,
    StreamCounts,
    collect_users,
    plan_hold_out,
    plan_split,
    plan_validation,
    sample_test_users,
    scan_counts,
    scan_pairs,
    scan_train_column,
    train_clicks,
)
from retrieval.evaluation import (
    EvalSet,
    als_factors_ranking,
    build_eval_set,
    compare_rankers,
    fit_als_pairs,
    format_table,
    index_ranking,
    popularity_ranking_from_counts,
    ranker_names,
    skipped_baselines,
    write_report,
)
from retrieval.features import ExampleJoin, FeatureStatistics, TowerTables, Vocabulary
from retrieval.features.histories import ClickHistories
from retrieval.index import ItemIndex, build_index_in_blocks, check_index_fits
from retrieval.model import build_model
from retrieval.model.parts import resolved
from retrieval.samplers import UserHistory
from retrieval.towers import build_ensemble_towers
from retrieval.training import (
    FrameClicks,
    SequenceClicks,
    StreamedClicks,
    ValidationData,
    distribution_strategy,
    embed_frame,
    fit,
    seed_everything,
    training_summary,
)
from retrieval.training.checkpoint_directory import training_checkpoints
from retrieval.training.parameter_server import (
    check_cluster,
    cluster_strategy,
    copy_towers,
    id_table_shapes,
    with_estimator_shards,
)
from retrieval.training.warm_start import (
    ParentState,
    carry_optimizer,
    grown_statistics,
    grown_tower_statistics,
    restore_weights,
    save_training_state,
)
from retrieval.training.worker_input import data_dispatcher

log = logging.getLogger("retrieval")

POPULAR_ITEMS_IN_MANIFEST = 1000


@dataclass(frozen=True)
class RunResult:
    directory: Path
    metrics: dict[str, Any]
    seconds: float


def default_run_name(config_name: str) -> str:
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{config_name}"


def train_evaluate_export(
    config: Config,
    *,
    config_name: str = "default",
    on_epoch_end: Callable[[int, dict], None] | None = None,
    towers: TowerFactory | None = None,
) -> RunResult:
    """Run the whole job; the run directory appears only when every step succeeded.

    One path for every click source: the log is a ``ClickLog`` (its shards with
    ``data.out_of_core``, else one table in memory), split by a plan, counted,
    trained on in batches and scanned for the baselines, the same way for both.

    The input files must not change while it runs: a change found after a streamed epoch or at
    the end fails it with an ``InputsChangedError`` naming the files (``_inputs_and_checkpoints``).

    ``on_epoch_end(epoch, logs)`` is passed to ``training.fit``: it sees each early-stopping epoch's
    validation recall and may raise to abandon the run (pipelines/tune.py prunes trials with it).

    ``towers(context) -> (query_tower, doc_tower)`` replaces the ID towers with the caller's own Keras
    models (``TowerContext``, ``check_custom_towers``); None builds the towers the config names.
    """
    started = time.perf_counter()
    # The run's config.yaml and manifest name the files it read wherever the run is opened later.
    config = with_absolute_data_paths(config)
    if config.train.warm_start is not None:  # the parent read here too, for the Python API's configs
        warm = str(Path(config.train.warm_start).expanduser().resolve())
        config = config.model_copy(update={"train": config.train.model_copy(update={"warm_start": warm})})
        warm_start_parent(config)
    sharded = config.train.distribute == "parameter_server"
    # First: MultiWorkerMirroredStrategy precedes other TF work. A parameter-server strategy shards
    # the ID tables by their shapes, known once the data is read: it comes after read_and_split.
    strategy = None if sharded else distribution_strategy(config.train)
    if sharded:
        check_cluster()  # TF_CONFIG names a chief, workers and ps tasks: before the data is read
        config = with_estimator_shards(config)
        if config.train.parameter_server.input == "workers":  # the workers register while the data is read
            data_dispatcher(config.train.parameter_server.data_dispatcher_port)
    name = config.run.name or default_run_name(config_name)
    final = Path(config.run.output_dir) / name
    seconds: dict[str, float] = {}
    with ExitStack() as cleanup, atomic_directory(final, overwrite=config.run.overwrite) as scratch:
        cleanup.enter_context(runtime_filtered_stderr())  # TensorFlow's runtime lines nobody can act on
        # Outside the run directory: they outlive a killed run; deleted once the run directory is in place.
        inputs, checkpoint_dir = _inputs_and_checkpoints(config, name, cleanup)
        save_config(config, scratch / "config.yaml")
        with _timed(seconds, "data"):
            data = read_and_split(config, _parent_state(config))
            # Who is evaluated follows from the split alone: an empty eval set fails here, not after training.
            evaluated = evaluation_clicks(config, data)
        if strategy is None:
            strategy = cluster_strategy(
                id_table_shapes(len(data.stats.users), len(data.stats.items), config.model.embedding_dim),
                config.train.parameter_server,
            )
        with strategy.scope():  # the towers', samplers' and loss's variables belong to the strategy
            model = build_job_model(config, data, towers)
        _require_servable(model, config)  # before training: the index cannot rank it
        with _timed(seconds, "training"):
            history, timing = train(config, strategy, model, data, scratch, checkpoint_dir, inputs, on_epoch_end)
        if sharded:
            # Indexing, evaluation and export read the weights here, from towers of this process's own
            # variables: the bundle is the one a single-process run writes, whatever the cluster was.
            trained, model = model, build_job_model(config, data, towers)
            copy_towers(trained, model)
        with _timed(seconds, "indexing"):
            index, item_embeddings, tuning_users = index_catalogue(config, model, data)
        with _timed(seconds, "evaluation"):
            queries = embed_frame(model.query_tower, data.tables.queries(evaluated.eval_set.user_ids))
            metrics = evaluate(config, index, queries, data, evaluated)
        with _timed(seconds, "seen_items"):
            seen_items = seen_items_of(data, index)
            if data.parent is not None:
                seen_items = merged_seen_items(seen_items, data.parent, index)
        metrics["data"] = data.summary(len(evaluated.eval_set.user_ids))
        metrics["derived"] = derived_settings(config, data.stats, len(data.catalogue_ids))
        metrics["final_train_loss"] = history["loss"][-1]
        metrics["training"] = training_summary(config.train, history)
        metrics["timing"] = {
            "seconds": {key: round(value, 2) for key, value in seconds.items()},
            "epoch_seconds": timing.get("epoch_seconds"),
            "clicks_per_second": timing.get("clicks_per_second"),
            "hook_seconds": timing.get("hook_seconds"),  # each epoch's validation pass and other hooks
        }
        # The probe query the bundle must reproduce at load: a training user's raw query.
        write_run_outputs(scratch, name, config, metrics, model, index, item_embeddings, data.stats,
                          probe_query=data.tables.queries(tuning_users[:1]), seen_items=seen_items,
                          user_features=user_features_of(data), item_features=data.source.item_features,
                          user_histories=user_histories_of(config, data, index),
                          training_queries=data.tables.queries(tuning_users))
        if config.export.warm_start_state:
            save_training_state(scratch, model, data.stats, config.train.optimizer, list(index.item_ids),
                                data.fitted.get("tower_statistics"))
        inputs.check_content()  # last: the run directory appears only if the inputs held still
    return RunResult(final, metrics, time.perf_counter() - started)


@contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Add the block's wall time to ``seconds[phase]`` (reported under the metrics' ``timing``)."""
    clock = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - clock


def _inputs_and_checkpoints(config: Config, name: str, cleanup: ExitStack) -> tuple[RunInputs, Path | None]:
    """The input files as the run starts and its checkpoint directory (``training_checkpoints``).

    The inputs are content-hashed when training is checkpointed (a resume
    compares the hashes) and stat-ed otherwise (``retrieval.data.fingerprint``
    has the cost). Until ``cleanup`` closes, an error of a run whose inputs
    changed meanwhile becomes the ``InputsChangedError`` naming them.
    """
    inputs = RunInputs.take(config.data, hashed=config.train.checkpoints)
    checkpoint_dir = training_checkpoints(config, name, cleanup, inputs.fingerprints)
    cleanup.enter_context(inputs.explaining())  # closed before the checkpoints' cleanup, which sees its error
    return inputs, checkpoint_dir


def _require_servable(model, config: Config) -> None:
    """Refuse, before training, a model the FAISS inner-product index cannot rank (``servable_by_dot_product``)."""
    if not model.servable_by_dot_product:
        raise ConfigError(
            f"model.loss.kind={config.model.loss.kind!r} scores items by tree paths, not dot products, "
            "so it cannot be served from the FAISS index; it is a comparison loss (make bench-losses)"
        )


def write_run_outputs(
    directory: Path,
    name: str,
    config: Config,
    metrics: dict[str, Any],
    model,
    index: ItemIndex,
    item_embeddings: np.ndarray | None,
    stats: FeatureStatistics,
    *,
    probe_query: pd.DataFrame | None = None,
    seen_items: SeenItems | None = None,
    user_features: pd.DataFrame | None = None,
    item_features: pd.DataFrame | None = None,
    user_histories: UserHistories | None = None,
    training_queries: pd.DataFrame | None = None,
) -> None:
    """Metrics (JSON, Markdown, report, TensorBoard) and the serving bundle of a finished run.

    ``probe_query``: one row of a training user's raw query features (``TowerTables.queries``),
    recorded with its top-k for serving to reproduce at load (``bundle.writer.write_bundle``).
    ``seen_items``: each training user's items as rows of ``index``, which the bundle excludes
    from what it serves (``bundle.writer.write_bundle``).
    ``user_features``: each known user's raw query features (``user_features_of``), which the
    bundle fills into requests that lack them (``bundle.writer.write_bundle``).
    ``item_features``: the raw item feature table (``data.item_features``), whose display columns
    the bundle ships for the web page and ``POST /items`` (``bundle.writer.write_bundle``).
    ``training_queries``: raw query features of training users, whose embeddings' norm range the
    bundle records; serving refuses a query embedded far outside it (``bundle.writer.write_bundle``).
    """
    (directory / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (directory / "metrics.md").write_text(format_table(metrics) + "\n")
    write_report(directory, metrics, title=f"Offline evaluation: {name}", plots=config.evaluation.plots)
    # At the step of the last epoch trained (early stopping may train fewer than train.epochs).
    write_metric_summaries(directory / "tensorboard" / "evaluation", metrics,
                           step=metrics.get("training", {}).get("epochs", config.train.epochs))
    write_bundle(
        directory,
        query_tower=model.query_tower,
        doc_tower=model.doc_tower,
        index=index,
        item_embeddings=item_embeddings if config.export.topk_model else None,
        topk_k=config.export.topk_k,
        probe_query=probe_query,
        seen_items=seen_items,
        user_features=user_features,
        item_features=item_features,
        user_histories=user_histories,
        training_queries=training_queries,
        manifest={
            "run": name,
            "config": config.to_dict(),
            "metrics": {k: metrics[k] for k in [*ranker_names(metrics), "counts"]},
            "popular_item_ids": stats.item_popularity.ranked_item_ids(POPULAR_ITEMS_IN_MANIFEST),
            "derived": metrics.get("derived", {}),
            **({} if config.train.warm_start is None else {"parent": parent_record(config.train.warm_start)}),
        },
    )


def parent_record(directory: str) -> dict[str, Any]:
    """The manifest's ``parent`` of a run warm-started from ``directory`` (its run name and creation time)."""
    parent = read_manifest(directory)
    return {"directory": str(directory), "run": parent.run, "created_at": parent.created_at, "change": "warm_start"}


def _parent_state(config: Config) -> ParentState | None:
    return None if config.train.warm_start is None else ParentState.read(config.train.warm_start)


def derived_settings(config: Config, stats: FeatureStatistics, catalogue_items: int) -> dict[str, Any]:
    """The settings the config leaves to the data (``auto``), as this run resolved them; logged."""
    model = resolved(config.model, stats)
    derived: dict[str, Any] = {
        f"model.{key}": getattr(model, key)
        for key in ("temperature",)
        if getattr(config.model, key) == "auto"
    }
    if config.index.factory == "auto":
        derived["index.factory"] = config.index.factory_for(catalogue_items, config.model.output_dim)
    als = config.evaluation.baselines.als
    if "als" in config.evaluation.baselines.rankers and als.factors is None:
        derived["evaluation.baselines.als.factors"] = als.factors_for(int(stats.item_popularity.counts.sum()))
    if derived:
        log.info("derived from the training log: %s", json.dumps(derived))
    return derived


def write_metric_summaries(log_dir: str | Path, metrics: dict[str, Any], step: int) -> None:
    """Write every ranker's final metrics as TensorBoard scalars ``<ranker>/<metric@k>`` at ``step``."""
    writer = tf.summary.create_file_writer(str(log_dir))
    with writer.as_default():
        for ranker in ranker_names(metrics):
            for key, value in metrics[ranker].items():
                tf.summary.scalar(f"{ranker}/{key}", float(value), step=step)
    writer.close()


# --- The job's phases, in the order it runs them. ---


@dataclass(frozen=True)
class JobData:
    """The split click log and what the later phases read of it.

    Attributes:
      source: the opened log (``ClickLog``), its test log and feature tables.
      plan: which clicks train and which are held out (``retrieval.data.streaming``'s plans).
      counts: per-id training counts and the test side (``scan_counts``).
      stats: vocabularies and popularity of the training clicks.
      tables: the catalogue and user tables the towers' inputs come from.
      join: the feature towers' inputs joined onto each click batch; None for ID towers.
      catalogue_ids: every item the index holds, in catalogue order.
      held_out: items whose training clicks ``split.hold_out_items`` removed.
      evaluated_on: ``split.evaluate_on``.
      parent: ``train.warm_start``'s training state (``retrieval.training.warm_start``); None from scratch.
      fitted: what the model's build derived from the data (the feature towers' statistics), which the
        run's training state keeps.
    """

    source: LogSource
    plan: Plan
    counts: StreamCounts
    stats: FeatureStatistics
    tables: TowerTables
    join: ExampleJoin | None
    catalogue_ids: list[str]
    held_out: tuple[str, ...]
    evaluated_on: str
    parent: ParentState | None = None
    fitted: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _pairs: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def clicks(self) -> ClickLog:
        return self.source.clicks

    def training_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Every training click of ``plan`` as (row of ``stats.users.ids``, row of ``stats.items.ids``),
        [train clicks] int32 each: coded in one pass over the log on first use (8 bytes a click) and
        shared by the click histories, mined negatives, ALS and the bundle's seen items."""
        if "train" not in self._pairs:
            self._pairs["train"] = _training_pairs(self.clicks, self.plan, self.stats)
        return self._pairs["train"]

    def shuffle_buffer(self, config: Config) -> int:
        """Training rows shuffled at a time: every click when the log is in memory (the batches
        ``FrameClicks`` gives it), else ``data.stream.shuffle_buffer``."""
        buffer = config.data.stream.shuffle_buffer
        return max(buffer, self.counts.train_rows) if self.source.in_memory else buffer

    def summary(self, evaluated_users: int | None = None) -> dict[str, Any]:
        """Counts for logs and run reports (plain ints and strings); ``evaluated_users`` once known
        (None, before evaluation: the key is left out rather than shown as 0)."""
        counts = self.counts
        summary = split_summary(
            self.source.source, (set(counts.user_ids), set(counts.test_user_ids)),
            (set(counts.item_ids), set(counts.test_item_ids)), (counts.train_rows, counts.test_rows),
            self.catalogue_ids, None if self.tables.users is None else len(self.tables.users),
            len(self.held_out), self.evaluated_on,
        )
        return {
            **summary,
            "clicks": self.plan.rows,
            **({} if evaluated_users is None else {"evaluated_users": evaluated_users}),
            "time_range": list(self.plan.time_range) if self.plan.time_range else None,
            "temporal_cut": self.plan.cut,
        }


def read_and_split(config: Config, parent: ParentState | None = None) -> JobData:
    """Open the log, plan its split and count both sides (a few passes over the log; none
    holds more than the plan needs, ``retrieval.data.streaming``).

    With a warm start's ``parent`` the vocabularies and item counts are the parent's grown by the
    new training clicks' (``grown_statistics``) and the catalogue holds the parent's items too."""
    source = open_log(config.data)
    if parent is not None and config.train.replay_fraction > 0:
        source = with_replay(source, parent, config)
    clicks, split = source.clicks, config.split
    given_test = source.test_clicks
    plan: Plan = plan_split(clicks, split, config.data.duplicates)
    if split.evaluate_on == "validation":  # tuning: the test part goes, the training part is split again
        plan = plan_validation(clicks, plan, split.test_fraction, split)
    held_out: tuple[str, ...] = ()
    if split.hold_out_items > 0:  # drawn after the split, from both sides
        plan = plan_hold_out(clicks, plan, split.hold_out_items, split.seed,
                             () if given_test is None else given_test[ITEM].astype(str))
        held_out = plan.items
    counts = scan_counts(clicks, plan)
    if given_test is not None:
        counts = counts.with_test(given_test)
    stats = FeatureStatistics.from_counts(counts.user_ids, counts.item_ids, counts.item_counts, counts.has_weights)
    if parent is not None:
        stats = grown_statistics(stats, parent)
    histories, pairs = None, {}
    if config.towers.query.history is not None:  # each click's earlier clicks, coded once (16 bytes a click)
        pairs["train"] = _training_pairs(clicks, plan, stats)
        histories = _histories(clicks, plan, stats, pairs["train"])
    tables, join = _tower_tables(config, source, counts, histories, () if parent is None else parent.catalogue)
    catalogue_ids = tables.items[ITEM].tolist()  # the feature table's items first, then the log's
    items = len(catalogue_ids)
    check_index_fits(config.index.factory_for(items, config.model.output_dim), items, config.index.train_sample_size)
    data = JobData(source, plan, counts, stats, tables, join, catalogue_ids, held_out, split.evaluate_on, parent,
                   _pairs=pairs)
    log.info("data: %s", json.dumps(data.summary()))
    return data


def with_replay(source: LogSource, parent: ParentState, config: Config) -> LogSource:
    """``source`` with a sample of the parent's training clicks added before its first click
    (``train.replay_fraction``): the parent bundle's seen items, one (user, item) pair per distinct
    click the parent and its own parents trained on, drawn without replacement with ``train.seed``
    so that they make about ``replay_fraction`` of the training clicks (the new log's training side
    estimated as ``1 - split.test_fraction`` of it under a temporal split, all of it under
    ``split.kind: none``). Timestamped one second before the new log's first click, so a temporal
    split keeps them on the training side (the config refuses the other split kinds)."""
    assert isinstance(source.clicks, ClickTable)  # the config refuses data.out_of_core
    table = source.clicks.table
    pairs = parent_seen_pairs(parent)
    if pairs is None:
        raise ConfigError(f"train.replay_fraction: the parent {parent.directory} has no seen items to replay")
    fraction = config.train.replay_fraction
    new_training = table.num_rows * (1.0 if config.split.kind == "none" else 1.0 - config.split.test_fraction)
    wanted = min(len(pairs), int(round(fraction / (1.0 - fraction) * new_training)))
    chosen = np.sort(np.random.default_rng(config.train.seed).choice(len(pairs), wanted, replace=False))
    replay = pairs.iloc[chosen].reset_index(drop=True)
    new = table.to_pandas()
    if TIME in new:
        replay[TIME] = int(new[TIME].min()) - 1
    if WEIGHT in new:
        replay[WEIGHT] = 1.0
    log.info("replay: %d of the parent's %d (user, item) pairs added to the %d new clicks", wanted,
             len(pairs), table.num_rows)
    mixed = pd.concat([replay, new], ignore_index=True)
    return dataclasses.replace(source, clicks=ClickTable.from_frame(mixed, source.clicks.read_batch_size))


def parent_seen_pairs(parent: ParentState, users: set[str] | None = None) -> pd.DataFrame | None:
    """The parent bundle's seen items as (``user_id``, ``item_id``) rows, in the CSR's order (of
    ``users`` only, when given); None for a parent bundle without seen items."""
    manifest = read_manifest(parent.directory)
    if "seen_items" not in manifest.files:
        return None
    seen = SeenItems.load(parent.directory / manifest.files["seen_items"])
    user_ids = np.repeat(np.char.decode(seen.user_ids, "utf-8").astype(object), np.diff(seen.indptr))
    pairs = pd.DataFrame({USER: user_ids, ITEM: np.asarray(parent.catalogue, dtype=object)[seen.item_rows]})
    return pairs if users is None else pairs[pairs[USER].isin(users)].reset_index(drop=True)


def _training_pairs(clicks: ClickLog, plan: Plan, stats: FeatureStatistics) -> tuple[np.ndarray, np.ndarray]:
    return scan_pairs(clicks, plan, pd.Index(stats.users.ids), pd.Index(stats.items.ids))


def _recoded(rows: np.ndarray, ids, target) -> np.ndarray:
    """``rows`` (rows of ``ids``) as rows of ``target``, which holds every id they name; int32."""
    positions = pd.Index(target, dtype=object).get_indexer(pd.Index(ids, dtype=object))
    recoded = positions[rows]
    if (recoded < 0).any():
        raise DataError("a training click's user or item is missing from the ids it is coded against")
    return recoded.astype(np.int32)


def _histories(
    clicks: ClickLog, plan: Plan, stats: FeatureStatistics, pairs: tuple[np.ndarray, np.ndarray] | None = None
) -> ClickHistories:
    """The plan's training clicks coded in time order (``ClickHistories``); ``pairs``: the plan's
    ``_training_pairs`` when already coded."""
    pairs = pairs if pairs is not None else _training_pairs(clicks, plan, stats)
    times = scan_train_column(clicks, plan, TIME) if clicks.columns.timestamp is not None else None
    return ClickHistories(*pairs, times, stats.users.ids, stats.items.ids)


def _tower_tables(
    config: Config, source: LogSource, counts: StreamCounts, histories: ClickHistories | None,
    parent_items: Sequence[str] = (),
) -> tuple[TowerTables, ExampleJoin | None]:
    """The catalogue and user tables (feature rows first, then ids only in the log, then a warm
    start's ``parent_items`` not in either) and their join onto click batches (None: ID towers)."""
    items = catalogue_table(ITEM, source.item_features, pd.DataFrame({ITEM: counts.catalogue()}),
                            pd.DataFrame({ITEM: list(parent_items)}))
    users = None
    if source.user_features is not None:
        users = catalogue_table(USER, source.user_features, pd.DataFrame({USER: counts.user_ids}),
                                pd.DataFrame({USER: counts.test_user_ids}))
    end = None if counts.last_train_time is None else float(counts.last_train_time)
    tables = TowerTables(config.towers, None, users, items, end_time=end, histories=histories)
    join = None
    if not config.towers.is_id_only:
        has_time = source.clicks.columns.timestamp is not None
        join = ExampleJoin(config.towers, users, items, has_time=has_time, histories=histories)
    return tables, join


@dataclass(frozen=True)
class EvaluatedClicks:
    """The evaluated users' clicks: the evaluation set and their training clicks (masks, activity)."""

    eval_set: EvalSet
    user_train: pd.DataFrame


def users_clicks(data: JobData, plan: Plan, users: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(train, test)`` click frames of ``users`` under ``plan``; the test side of the job's own plan is the
    given test clicks (``data.test_clicks``) where the log came with them."""
    user_train, user_test = collect_users(data.clicks, plan, users)
    given_test = data.source.test_clicks
    if given_test is not None and plan is data.plan:
        user_test = given_test[given_test[USER].astype(str).isin(set(users))].reset_index(drop=True)
    return user_train, user_test


def evaluation_clicks(config: Config, data: JobData) -> EvaluatedClicks:
    """Every test user of a log in memory, or ``data.stream.max_test_users`` of them sampled
    when streamed: their clicks are all the evaluation holds. Ranked over ``data.catalogue_ids``.
    A warm start's training clicks include its parent's (its bundle's seen items): excluded from
    the ranking and known to the unseen-user filter alike."""
    stream = config.data.stream
    users = sample_test_users(data.counts, None if data.source.in_memory else stream.max_test_users, stream.seed)
    user_train, user_test = users_clicks(data, data.plan, users)
    if data.parent is not None:
        # A warm-started model trained on its parent's clicks too: they are known and excluded as its own are.
        parent_pairs = parent_seen_pairs(data.parent, set(users))
        if parent_pairs is not None:
            user_train = pd.concat([parent_pairs, user_train], ignore_index=True)
    eval_set = _eval_set(user_train, user_test, data.stats, data.catalogue_ids, config.evaluation)
    return EvaluatedClicks(eval_set, user_train)


@dataclass(frozen=True)
class TowerContext:
    """What a custom tower factory builds from (``train_evaluate_export(towers=...)``).

    ``users`` and ``items`` are the training vocabularies: sorted ids, where a lookup such as
    ``tf.keras.layers.StringLookup(vocabulary=list(context.items.ids))`` gives row ``position + 1``
    and 0 to ids never seen in training, as the project's ID towers do.
    """

    users: Vocabulary
    items: Vocabulary
    embedding_dim: int


# context -> (query tower: {"user_id": tf.string [batch]} -> [batch, D],
#             doc tower: {"item_id": tf.string [batch]} -> [batch, D])
TowerFactory = Callable[[TowerContext], tuple[tf.keras.Model, tf.keras.Model]]


def check_custom_towers(towers: Any) -> tuple[tf.keras.Model, tf.keras.Model]:
    """``towers`` as a factory returned them, or a ``ConfigError`` saying what the job needs instead:
    two Keras models with named inputs (the SavedModel's signature is built from them), the query
    tower reading ``user_id`` and the doc tower ``item_id`` (raw strings, [batch]), both [batch, D]."""
    if not (isinstance(towers, tuple | list) and len(towers) == 2):
        raise ConfigError(f"a tower factory returns (query_tower, doc_tower), got {type(towers).__name__}")
    for tower, side, feature in zip(towers, ("query", "doc"), (USER, ITEM)):
        if not isinstance(tower, tf.keras.Model) or not getattr(tower, "input_names", None):
            raise ConfigError(
                f"the custom {side} tower must be a functional tf.keras.Model over "
                f"{{{feature!r}: tf.keras.Input(shape=(), dtype=tf.string, name={feature!r})}}, "
                f"got {type(tower).__name__}"
            )
        if list(tower.input_names) != [feature]:
            raise ConfigError(
                f"the custom {side} tower reads {list(tower.input_names)}; an ID-only job feeds it only {feature!r}"
            )
        if len(tower.output_shape) != 2 or tower.output_shape[-1] is None:
            raise ConfigError(f"the custom {side} tower returns shape {tower.output_shape}; it must be [batch, D]")
    query, doc = towers
    if query.output_shape[-1] != doc.output_shape[-1]:
        raise ConfigError(
            f"the custom towers' embeddings differ in size: query {query.output_shape[-1]}, doc {doc.output_shape[-1]}"
        )
    return query, doc


def build_job_model(config: Config, data: JobData, custom_towers: TowerFactory | None = None):
    """The two towers, samplers and loss the config names (call under the strategy's scope);
    ``custom_towers`` (``TowerFactory``) builds the towers instead, for a config without feature towers."""
    seed_everything(config.train.seed)  # before the towers are built: their init is random
    towers = catalogue = None  # None: build_model makes the ID towers
    counts, stats = data.counts, data.stats
    if custom_towers is not None:
        if config.model.ensemble_members > 1:
            raise ConfigError(
                "model.ensemble_members > 1 builds its members from the config's towers; custom towers are one "
                "pair: set model.ensemble_members=1"
            )
        if data.join is not None:
            raise ConfigError(
                "custom towers are not yet supported with feature towers (the towers: section); "
                "a custom tower reads user_id or item_id only: remove the towers: section or the factory"
            )
        towers = check_custom_towers(custom_towers(TowerContext(stats.users, stats.items, config.model.embedding_dim)))
    elif data.join is not None:
        clicks = {column: scan_train_column(data.clicks, data.plan, column) for column in data.join.scanned_columns}
        statistics = data.join.statistics((counts.user_ids, counts.user_counts), (counts.item_ids, counts.item_counts),
                                          clicks, stats.items, data.tables.reference_time)
        del clicks
        if data.parent is not None:
            statistics = grown_tower_statistics(statistics, data.parent)
        data.fitted["tower_statistics"] = statistics
        towers = build_ensemble_towers(config.towers, config.model, statistics)
        catalogue = data.tables.catalogue()  # sampled negatives are embedded from their raw features
    user_history = None
    if config.model.reads_users_training_items:  # coded while scanning
        user_rows, item_rows = data.training_pairs()
        user_history = UserHistory(user_rows, item_rows.astype(np.int64) + 1, len(stats.users))  # +1: OOV is 0
    model = build_model(config.model, stats, use_weights=config.train.use_weights, towers=towers,
                        catalogue_features=catalogue, user_history=user_history)
    if data.parent is not None:
        new_rows = restore_weights(model, data.parent)
        log.info("warm start from %s: every variable carried, %d new table rows at their initialisation",
                 data.parent.directory, new_rows)
    return model


def train(
    config: Config, strategy, model, data: JobData, log_dir: Path, checkpoint_dir: Path | None,
    inputs: RunInputs, on_epoch_end: Callable[[int, dict], None] | None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``training.fit`` on the plan's training clicks; ``(history, timing)``."""
    source = _click_source(config, data, data.plan, data.counts.train_rows)
    validation = _validation(config, data) if config.train.validation_fraction > 0 else None
    log.info("training: %d clicks, %d epochs", data.counts.train_rows, config.train.epochs)
    timing: dict[str, list[float]] = {}
    prepare = None
    if data.parent is not None and config.train.warm_start_optimizer == "carry":
        parent = data.parent

        def prepare(optimizer) -> None:
            carry_optimizer(optimizer, model, parent, config.train.optimizer)

    with strategy.scope():  # fit compiles: the optimizer's variables too
        history = fit(model, source, config.train, log_dir=log_dir, checkpoint_dir=checkpoint_dir,
                      prepare_optimizer=prepare,
                      say=log.info, timing=timing, validation=validation,
                      epoch_hooks=[inputs.after_epoch],  # a streamed epoch reads the shards again
                      on_epoch_end=on_epoch_end)
    return history, timing


def _click_source(config: Config, data: JobData, plan: Plan,
                  rows: int) -> StreamedClicks | SequenceClicks | FrameClicks:
    """The training batches of ``plan``'s training side: clicks, or each user's sequence of them.

    A log held in memory, read by ID towers on one device, gives its training clicks to a
    ``FrameClicks``: the batches the stream would give (its buffer holds every click), cut in the
    training loop's graph from tensors in memory (``train.steps_per_execution``), with no
    ``tf.data`` pipeline between the steps."""
    stream, train = config.data.stream, config.train
    if train.examples == "sequences":
        history = config.towers.query.history
        assert history is not None  # the config refuses sequences without a history
        histories = data.tables.histories if plan is data.plan else None
        return SequenceClicks(histories or _histories(data.clicks, plan, data.stats), history.name, history.length,
                              train.batch_size, seed=train.seed, windows=train.sequence_windows)
    if data.source.in_memory and data.join is None and stream.max_train_batches is None and train.distribute == "none":
        return FrameClicks(train_clicks(data.clicks, plan), train.batch_size, seed=train.seed)
    return StreamedClicks(
        data.clicks, plan, train.batch_size, shuffle_buffer=data.shuffle_buffer(config), seed=train.seed,
        train_rows=rows, max_batches=stream.max_train_batches, join=data.join,
    )


def _validation(config: Config, data: JobData) -> ValidationData:
    """Early stopping's data: the validation part carved from the training side (``plan_validation``:
    as the test part was carved) or, with ``train.validation_part: test``, the test part itself; the
    fit part batched, and the validation clicks (of up to ``train.validation_users`` sampled users;
    ``data.stream.max_test_users`` when streamed) with the query tower's inputs."""
    stream = config.data.stream
    carved: Plan
    if config.train.validation_part == "test":  # the test clicks themselves, every training click trained on
        carved, counts = data.plan, data.counts
    else:
        carved = plan_validation(data.clicks, data.plan, config.train.validation_fraction,
                                 training_split(config.split))
        counts = scan_counts(data.clicks, carved)
    cap = config.train.validation_users
    if not data.source.in_memory:
        cap = stream.max_test_users if cap is None else min(cap, stream.max_test_users or cap)
    users = sample_test_users(counts, cap, stream.seed)
    fit_clicks, validation = users_clicks(data, carved, users)
    log.info("early stopping: %d fit-part clicks, validation on %d clicks of %d users",
             counts.train_rows, len(validation), len(users))
    source = _click_source(config, data, carved, counts.train_rows)
    return ValidationData(source, validation if data.join is None else data.join.examples(validation), fit_clicks)


def index_catalogue(config: Config, model, data: JobData) -> tuple[ItemIndex, np.ndarray | None, list[str]]:
    """Every catalogue item embedded from its features (clicked in training or not) into the index;
    ``(index, item_embeddings, tuning_users)``, approximate indexes tuned on a sample of training users.

    The items are embedded a block at a time, straight into the index (``build_index_in_blocks``): the
    catalogue's [items, dim] matrix is never held beside the index. ``item_embeddings`` is that matrix
    only when the bundle's topk model needs it (``export.topk_model``; a Flat index's own vectors),
    else None.
    """
    items = len(data.catalogue_ids)
    dim = int(model.doc_tower.output_shape[-1])
    log.info("indexing %d catalogue items (%s)", items, config.index.factory_for(items, dim))
    catalogue = data.tables.catalogue()
    users = np.sort(np.asarray(data.stats.users.ids, dtype=object))
    tuning_users = seeded_subset(users, config.index.tune_queries, config.index.seed).tolist()
    index = build_index_in_blocks(
        data.catalogue_ids, lambda rows: embed_frame(model.doc_tower, catalogue.iloc[rows]), dim, config.index,
        embed_frame(model.query_tower, data.tables.queries(tuning_users)), "training users",
    )
    item_embeddings = None
    if config.export.topk_model:
        item_embeddings = index.flat_vectors()
        if item_embeddings is None:
            item_embeddings = embed_frame(model.doc_tower, catalogue)
    return index, item_embeddings, tuning_users


def evaluate(
    config: Config, index: ItemIndex, query_embeddings: np.ndarray, data: JobData, evaluated: EvaluatedClicks
) -> dict[str, Any]:
    """The model (``query_embeddings`` [evaluated users, dim] searched in ``index``) and the
    baselines over the full catalogue: popularity from the counts, ALS on the click matrix coded
    once (``JobData.training_pairs``). The dict ``compare_rankers`` returns."""
    eval_set, evaluation = evaluated.eval_set, config.evaluation
    log.info("evaluating %d test users over the full corpus", len(eval_set.user_ids))
    depth = max(evaluation.ks)
    catalogue = pd.Index(index.item_ids, dtype=object)
    stats = data.stats
    item_counts = np.zeros(len(catalogue), np.int64)
    item_counts[catalogue.get_indexer(pd.Index(stats.items.ids, dtype=object))] = stats.item_popularity.counts[1:]
    user_train = evaluated.user_train
    activity = user_train[USER].value_counts().reindex(pd.Index(eval_set.user_ids, dtype=object), fill_value=0)
    rankers = {"model": lambda: index_ranking(index, query_embeddings, eval_set, depth, evaluation.query_batch_size)}
    if "popularity" in evaluation.baselines.rankers:
        rankers["popularity"] = lambda: popularity_ranking_from_counts(item_counts, eval_set, depth)
    skipped = skipped_baselines(int(stats.item_popularity.counts.sum()), evaluation)
    if "als" in evaluation.baselines.rankers and "als" not in skipped:
        rankers["als"] = lambda: _als_ranking(data, catalogue, eval_set, depth, evaluation)
    results = compare_rankers(rankers, eval_set, item_counts, activity.to_numpy(), evaluation)
    return {**results, "skipped_baselines": skipped} if skipped else results


def _als_ranking(data: JobData, catalogue: pd.Index, eval_set: EvalSet, depth: int, config) -> np.ndarray:
    """The ALS baseline fitted on the click matrix coded while scanning the training clicks."""
    stats = data.stats
    users = pd.Index(np.sort(np.asarray(stats.users.ids, dtype=object)), dtype=object)  # fit_als's order
    user_rows, item_rows = data.training_pairs()
    user_rows, item_rows = _recoded(user_rows, stats.users.ids, users), _recoded(item_rows, stats.items.ids, catalogue)
    factors = fit_als_pairs(user_rows, item_rows, users, len(catalogue), config.baselines.als)
    return als_factors_ranking(factors, list(catalogue), eval_set, depth, config.query_batch_size)


def seen_items_of(data: JobData, index: ItemIndex) -> SeenItems:
    """Each training user's items as rows of ``index``: what serving excludes (every training
    click, the early-stopping validation part included, which the bundle's model trained on too),
    from the shared training pairs (``JobData.training_pairs``) sorted into the bundle's CSR arrays
    (~18 bytes a click)."""
    users = pd.Index(np.asarray(data.stats.users.ids, dtype=object), dtype=object)
    user_rows, item_rows = data.training_pairs()
    item_rows = _recoded(item_rows, data.stats.items.ids, index.item_ids)
    return SeenItems.from_coded_pairs(user_rows, item_rows, users.to_numpy())


def merged_seen_items(seen: SeenItems, parent: ParentState, index: ItemIndex) -> SeenItems:
    """``seen`` (the new training clicks' items, rows of ``index``) with the parent bundle's seen items
    added: a user's items are the union of both (``index`` holds the parent's catalogue)."""
    manifest = read_manifest(parent.directory)
    if "seen_items" not in manifest.files:
        return seen
    old = SeenItems.load(parent.directory / manifest.files["seen_items"])
    old = old.remapped(pd.Index(index.item_ids, dtype=object).get_indexer(pd.Index(parent.catalogue, dtype=object)))
    users = np.concatenate([np.char.decode(seen.user_ids, "utf-8"), np.char.decode(old.user_ids, "utf-8")])
    codes, vocabulary = pd.factorize(pd.Series(users, dtype=object))
    user_rows = np.concatenate([np.repeat(codes[: len(seen)], np.diff(seen.indptr)),
                                np.repeat(codes[len(seen):], np.diff(old.indptr))])
    return SeenItems.from_coded_pairs(user_rows, np.concatenate([seen.item_rows, old.item_rows]),
                                      np.asarray(vocabulary, dtype=object))


def user_histories_of(config: Config, data: JobData, index: ItemIndex) -> UserHistories | None:
    """Each training user's last ``export.history_clicks`` training clicks as rows of ``index``, newest
    first (``ClickHistories.recent``), for serving to fill the history a query lacks; None when the
    query tower reads no click history."""
    if config.towers.query.history is None:
        return None
    histories = data.tables.histories or _histories(data.clicks, data.plan, data.stats)
    user_ids, indptr, item_rows = histories.recent(config.export.history_clicks)
    rows = _recoded(item_rows, histories.item_ids, index.item_ids)
    return UserHistories.from_recent(user_ids, indptr, rows, config.export.history_clicks)


def user_features_of(data: JobData) -> pd.DataFrame | None:
    """The raw user features of every known user, as training saw them (``TowerTables.user_features``):
    the users of the user feature table and the training users (their features missing when the
    table lacks them); None when the query tower reads no user table feature. A user only in the
    test log is not known: a request for it must send its features."""
    features = data.source.user_features
    if data.tables.users is None or features is None or not data.tables.user_table_features():
        return None
    ids = data.tables.users[USER].astype(str)
    known = ids.isin(pd.Index(features[USER].astype(str))) | ids.isin(pd.Index(data.stats.users.ids, dtype=object))
    return data.tables.user_features(ids[known].to_numpy(dtype=object))


def _eval_set(user_train, user_test, stats: FeatureStatistics, catalogue_ids, config) -> EvalSet:
    """``build_eval_set`` when only the evaluated users' clicks are in memory.

    ``build_eval_set`` reads "items with training clicks" from its train frame;
    here that frame holds the evaluated users' clicks only, so unseen items are
    judged against the training vocabulary first and build_eval_set keeps the rest.
    """
    known = pd.Index(stats.items.ids, dtype=object)
    unseen_item = ~user_test[ITEM].isin(known)
    if config.unseen_users == "drop":
        unseen_item &= user_test[USER].isin(set(user_train[USER]))
    unseen_clicks = int(user_test.loc[unseen_item, [USER, ITEM]].drop_duplicates().shape[0])
    if config.unseen_items == "drop":
        user_test = user_test[~unseen_item]
    eval_set = build_eval_set(user_train, user_test, catalogue_ids, config.model_copy(update={"unseen_items": "keep"}))
    eval_set.counts["test_clicks_on_items_unseen_in_training"] = unseen_clicks
    return eval_set
