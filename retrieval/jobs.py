"""The main job: data -> train -> index -> evaluate -> export, in one run directory."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.arrays import seeded_subset
from retrieval.config import Config, ConfigError, save_config
from retrieval.data import ITEM, USER, load_dataset, read_clicks
from retrieval.data.dataset import catalogue_table, feature_tables
from retrieval.data.fingerprint import RunInputs
from retrieval.data.splits import training_split

# The out-of-core path (data.out_of_core):
from retrieval.data.streaming import (
    ClickShards,
    Plan,
    collect_users,
    plan_hold_out,
    plan_split,
    plan_validation,
    sample_test_users,
    scan_counts,
    scan_pairs,
    scan_train_column,
)
from retrieval.evaluation import (
    EvalSet,
    als_factors_ranking,
    build_eval_set,
    compare_rankers,
    evaluate_against_baselines,
    fit_als_pairs,
    format_table,
    index_ranking,
    popularity_ranking_from_counts,
    ranker_names,
    skipped_baselines,
    write_report,
)
from retrieval.export import atomic_directory, write_bundle
from retrieval.features import ExampleJoin, FeatureStatistics, TowerStatistics, TowerTables
from retrieval.index import ItemIndex, build_index, check_index_fits
from retrieval.model import build_model
from retrieval.objectives import resolved
from retrieval.run_checkpoints import training_checkpoints
from retrieval.samplers import UserHistory
from retrieval.seen_items import SeenItems
from retrieval.towers import build_towers
from retrieval.training import (
    StreamedClicks,
    ValidationData,
    distribution_strategy,
    embed_frame,
    fit,
    seed_everything,
)

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
    config: Config, *, config_name: str = "default", on_epoch_end: Callable[[int, dict], None] | None = None
) -> RunResult:
    """Run the whole job; the run directory appears only when every step succeeded.

    The input files must not change while it runs: a change found after a streamed epoch or at
    the end fails it with an ``InputsChangedError`` naming the files (``_inputs_and_checkpoints``).

    ``on_epoch_end(epoch, logs)`` is passed to ``training.fit``: it sees each early-stopping epoch's
    validation recall and may raise to abandon the run (pipelines/tune.py prunes trials with it).
    """
    started = time.perf_counter()
    if config.data.out_of_core:  # click shards streamed through tf.data, never loaded whole
        return _train_evaluate_export_out_of_core(config, config_name, started, on_epoch_end)
    # First: MultiWorkerMirroredStrategy must exist before other TensorFlow work.
    strategy = distribution_strategy(config.train)
    name = config.run.name or default_run_name(config_name)
    final = Path(config.run.output_dir) / name
    with ExitStack() as cleanup, atomic_directory(final, overwrite=config.run.overwrite) as scratch:
        # Outside the run directory: they outlive a killed run; deleted once the run directory is in place.
        inputs, checkpoint_dir = _inputs_and_checkpoints(config, name, cleanup)
        save_config(config, scratch / "config.yaml")
        dataset = load_dataset(config.data, config.split)
        log.info("data: %s", json.dumps(dataset.summary()))
        # Who is evaluated follows from the split alone: an empty eval set fails here, not after training.
        catalogue_ids = dataset.items[ITEM].astype(str).tolist()
        check_index_fits(config.index.factory, len(catalogue_ids), config.index.train_sample_size)
        eval_set = build_eval_set(dataset.train, dataset.test, catalogue_ids, config.evaluation)
        stats = FeatureStatistics.from_training_clicks(dataset.train)
        derived = derived_settings(config, stats)
        tables = TowerTables.from_dataset(dataset, config.towers)
        examples = tables.examples()
        seed_everything(config.train.seed)  # before the towers are built: their init is random
        towers = catalogue = None  # None: build_model makes the ID towers
        with strategy.scope():  # the towers', samplers' and loss's variables belong to the strategy
            if not config.towers.is_id_only:
                statistics = TowerStatistics.fit(config.towers, examples, tables.reference_time)
                towers = build_towers(config.towers, config.model, statistics)
                catalogue = tables.catalogue()  # sampled negatives are embedded from their raw features
            model = build_model(
                config.model,
                stats,
                use_weights=config.train.use_weights,
                train_clicks=dataset.train,
                towers=towers,
                catalogue_features=catalogue,
            )
        _require_servable(model, config)  # before training: the index cannot rank it

        log.info("training: %d clicks, %d epochs", len(dataset.train), config.train.epochs)
        with strategy.scope():  # fit compiles: the optimizer's variables too
            history = fit(
                model, examples, config.train, log_dir=scratch, split=training_split(config.split),
                checkpoint_dir=checkpoint_dir,
                on_epoch_end=on_epoch_end, say=log.info,
            )

        log.info("indexing %d catalogue items (%s)", len(catalogue_ids), config.index.factory)
        # Every catalogue item is embedded from its features, clicked in training or not.
        item_embeddings = embed_frame(model.doc_tower, tables.catalogue())
        # Approximate indexes are tuned on real queries: a sample of training users.
        tuning_users = _user_sample(dataset.train, config.index.tune_queries, config.index.seed)
        index = build_index(
            catalogue_ids,
            item_embeddings,
            config.index,
            embed_frame(model.query_tower, tables.queries(tuning_users)),
            "training users",
        )

        log.info("evaluating %d test users over the full corpus", len(eval_set.user_ids))
        # per-model metric dicts, then the run's "data" summary and "final_train_loss" beside them
        metrics: dict[str, Any] = evaluate_against_baselines(
            index,
            embed_frame(model.query_tower, tables.queries(eval_set.user_ids)),
            eval_set,
            dataset.train,
            config.evaluation,
        )
        metrics["data"] = dataset.summary()
        metrics["derived"] = derived
        metrics["final_train_loss"] = history["loss"][-1]
        # The probe query the bundle must reproduce at load: a training user's raw query.
        write_run_outputs(scratch, name, config, metrics, model, index, item_embeddings, stats,
                          probe_query=tables.queries(tuning_users[:1]),
                          seen_items=seen_items_of(dataset.train, index))
        inputs.check_content()  # last: the run directory appears only if the inputs held still
    return RunResult(final, metrics, time.perf_counter() - started)


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


def seen_items_of(train: pd.DataFrame, index: ItemIndex) -> SeenItems:
    """Each training user's items as rows of ``index``: what serving excludes (all of ``train``,
    the early-stopping validation clicks included, which the bundle's model trained on too)."""
    item_rows = pd.Index(index.item_ids, dtype=object).get_indexer(train[ITEM].astype(str))
    return SeenItems.from_pairs(train[USER].astype(str).to_numpy(), item_rows)


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
    item_embeddings: np.ndarray,
    stats: FeatureStatistics,
    *,
    probe_query: pd.DataFrame | None = None,
    seen_items: SeenItems | None = None,
) -> None:
    """Metrics (JSON, Markdown, report, TensorBoard) and the serving bundle of a finished run.

    ``probe_query``: one row of a training user's raw query features (``TowerTables.queries``),
    recorded with its top-k for serving to reproduce at load (``export.write_bundle``).
    ``seen_items``: each training user's items as rows of ``index``, which the bundle excludes
    from what it serves (``export.write_bundle``).
    """
    (directory / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (directory / "metrics.md").write_text(format_table(metrics) + "\n")
    write_report(directory, metrics, title=f"Offline evaluation: {name}", plots=config.evaluation.plots)
    write_metric_summaries(directory / "tensorboard" / "evaluation", metrics, step=config.train.epochs)
    write_bundle(
        directory,
        query_tower=model.query_tower,
        doc_tower=model.doc_tower,
        index=index,
        item_embeddings=item_embeddings if config.export.topk_model else None,
        topk_k=config.export.topk_k,
        probe_query=probe_query,
        seen_items=seen_items,
        manifest={
            "run": name,
            "config": config.to_dict(),
            "metrics": {k: metrics[k] for k in [*ranker_names(metrics), "counts"]},
            "popular_item_ids": stats.item_popularity.ranked_item_ids(POPULAR_ITEMS_IN_MANIFEST),
            "derived": metrics.get("derived", {}),
        },
    )


def derived_settings(config: Config, stats: FeatureStatistics) -> dict[str, Any]:
    """The settings the config leaves to the data (``auto``), as this run resolved them; logged."""
    model = resolved(config.model, stats)
    derived = {
        f"model.{key}": getattr(model, key)
        for key in ("temperature",)
        if getattr(config.model, key) == "auto"
    }
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


def _user_sample(train, size: int, seed: int) -> list[str]:
    return seeded_subset(np.sort(train[USER].astype(str).unique()), size, seed).tolist()


# --- Out of core (data.out_of_core): click shards streamed through tf.data. ---


def _train_evaluate_export_out_of_core(
    config: Config, config_name: str, started: float, on_epoch_end: Callable[[int, dict], None] | None = None
) -> RunResult:
    """The main job on a click log streamed from shards (``retrieval.data.streaming``).

    No click frame of the whole log is ever built: vocabularies and popularity
    come from streaming passes, training reads the shards through ``tf.data``,
    and evaluation holds only the clicks of ``data.stream.max_test_users``
    sampled test users. Feature tables are read whole and joined onto each
    batch (``ExampleJoin``); the catalogue and the queries are embedded from
    them as in memory (``TowerTables``). The run directory is the in-memory job's.
    """
    stream = config.data.stream
    if config.data.clicks is None:
        raise ValueError("data.out_of_core needs data.clicks (the click shards)")
    # First: MultiWorkerMirroredStrategy must exist before other TensorFlow work.
    strategy = distribution_strategy(config.train)
    name = config.run.name or default_run_name(config_name)
    final = Path(config.run.output_dir) / name
    with ExitStack() as cleanup, atomic_directory(final, overwrite=config.run.overwrite) as scratch:
        inputs, checkpoint_dir = _inputs_and_checkpoints(config, name, cleanup)
        save_config(config, scratch / "config.yaml")
        seconds: dict[str, float] = {}
        clock = time.perf_counter()
        shards = ClickShards.open(config.data.clicks, config.data.columns, stream.read_batch_size)
        plan: Plan = plan_split(shards, config.split, config.data.duplicates)
        if config.split.evaluate_on == "validation":  # as splits.split_validation carves it in memory
            plan = plan_validation(shards, plan, config.split.test_fraction, config.split)
        given_test = None
        if config.data.test_clicks is not None:  # split.kind: none; a test log is small: read whole
            given_test = read_clicks(config.data.test_clicks, config.data.columns, duplicates=config.data.duplicates)
        held_out: tuple[str, ...] = ()
        if config.split.hold_out_items > 0:  # drawn after the split, from both sides, as load_dataset draws
            plan = plan_hold_out(shards, plan, config.split.hold_out_items, config.split.seed,
                                 () if given_test is None else given_test[ITEM].astype(str))
            held_out = plan.items
        counts = scan_counts(shards, plan)
        if given_test is not None:
            counts = counts.with_test(given_test)
        stats = FeatureStatistics.from_counts(counts.user_ids, counts.item_ids, counts.item_counts, counts.has_weights)
        tables, join = _streamed_tables(config, counts, shards.columns.timestamp is not None)
        catalogue_ids = tables.items[ITEM].tolist()  # the feature table's items first, as Dataset.items
        check_index_fits(config.index.factory, len(catalogue_ids), config.index.train_sample_size)
        derived = derived_settings(config, stats)
        seconds["streaming_stats"] = time.perf_counter() - clock
        summary = {
            "source": f"files:{config.data.clicks.path} ({len(shards.files)} {shards.format} shards, out of core)",
            "clicks": plan.rows,
            "train_clicks": counts.train_rows,
            "test_clicks": counts.test_rows,
            "train_users": len(stats.users),
            "train_items": len(stats.items),
            "test_users": len(counts.test_user_ids),
            "catalogue_items": len(catalogue_ids),
            "time_range": list(plan.time_range) if plan.time_range else None,
            "temporal_cut": plan.cut,
            "held_out_items": len(held_out),
        }
        log.info("data (streamed in %.1fs): %s", seconds["streaming_stats"], json.dumps(summary))
        # Pass 3 before training: an empty eval set fails now, not after training.
        clock = time.perf_counter()
        users = sample_test_users(counts, stream.max_test_users, stream.seed)
        user_train, user_test = collect_users(shards, plan, users)
        if given_test is not None:
            user_test = given_test[given_test[USER].astype(str).isin(set(users))].reset_index(drop=True)
        eval_set = _streamed_eval_set(user_train, user_test, stats, catalogue_ids, config.evaluation)
        seconds["evaluation"] = time.perf_counter() - clock

        seed_everything(config.train.seed)  # before the towers are built: their init is random
        towers = catalogue = None  # None: build_model makes the ID towers
        if join is not None:
            clicks = {column: scan_train_column(shards, plan, column) for column in join.scanned_columns}
            statistics = join.statistics((counts.user_ids, counts.user_counts), (counts.item_ids, counts.item_counts),
                                         clicks, stats.items, tables.reference_time)
            del clicks
            with strategy.scope():
                towers = build_towers(config.towers, config.model, statistics)
            catalogue = tables.catalogue()
        user_history = None
        if config.model.loss.hard_negatives == "mined":  # each user's training items, coded while streaming
            user_rows, item_rows = scan_pairs(shards, plan, pd.Index(stats.users.ids), pd.Index(stats.items.ids))
            user_history = UserHistory(user_rows, item_rows.astype(np.int64) + 1, len(stats.users))  # +1: OOV is 0
            del user_rows, item_rows
        with strategy.scope():  # the towers', samplers' and loss's variables belong to the strategy
            model = build_model(config.model, stats, use_weights=config.train.use_weights, towers=towers,
                                catalogue_features=catalogue, user_history=user_history)
        _require_servable(model, config)  # before training: the index cannot rank it
        source = StreamedClicks(
            shards, plan, config.train.batch_size, shuffle_buffer=stream.shuffle_buffer, seed=config.train.seed,
            train_rows=counts.train_rows, max_batches=stream.max_train_batches, join=join,
        )
        clock = time.perf_counter()
        validation = None
        if config.train.validation_fraction > 0:
            validation = _streamed_validation(shards, plan, config, join)
            seconds["validation_split"] = time.perf_counter() - clock
        log.info("training: %d clicks streamed, %d epochs", counts.train_rows, config.train.epochs)
        clock = time.perf_counter()
        timing: dict[str, list[float]] = {}
        with strategy.scope():  # fit compiles: the optimizer's variables too; each worker streams its own shards
            history = fit(model, source, config.train, log_dir=scratch, checkpoint_dir=checkpoint_dir,
                          say=log.info, timing=timing, validation=validation,
                          epoch_hooks=[inputs.after_epoch],  # each epoch streams the shards again
                          on_epoch_end=on_epoch_end)
        seconds["training"] = time.perf_counter() - clock

        clock = time.perf_counter()
        log.info("indexing %d catalogue items (%s)", len(catalogue_ids), config.index.factory)
        item_embeddings = embed_frame(model.doc_tower, tables.catalogue())
        tuning_users = seeded_subset(np.asarray(stats.users.ids, dtype=object), config.index.tune_queries,
                                     config.index.seed)
        index = build_index(catalogue_ids, item_embeddings, config.index,
                            embed_frame(model.query_tower, tables.queries(tuning_users)), "training users")
        seconds["indexing"] = time.perf_counter() - clock

        clock = time.perf_counter()
        log.info("evaluating %d sampled test users over the full corpus", len(eval_set.user_ids))
        metrics = _evaluate_streamed(
            index, embed_frame(model.query_tower, tables.queries(eval_set.user_ids)), eval_set, user_train, stats,
            config.evaluation,
            shards, plan,
        )
        seconds["evaluation"] += time.perf_counter() - clock
        metrics["data"] = {**summary, "evaluation_users_sampled": len(users)}
        metrics["derived"] = derived
        metrics["final_train_loss"] = history["loss"][-1]
        metrics["out_of_core"] = {
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "epoch_seconds": timing.get("epoch_seconds"),
            "clicks_per_second": timing.get("clicks_per_second"),
        }
        clock = time.perf_counter()
        seen_items = _streamed_seen_items(shards, plan, stats, index)
        seconds["seen_items"] = time.perf_counter() - clock
        metrics["out_of_core"]["seconds"]["seen_items"] = round(seconds["seen_items"], 2)
        # The probe query the bundle must reproduce at load: a training user's raw query.
        write_run_outputs(scratch, name, config, metrics, model, index, item_embeddings, stats,
                          probe_query=tables.queries(tuning_users[:1]), seen_items=seen_items)
        inputs.check_content()  # last: the shards are read up to evaluation's ALS pass
    return RunResult(final, metrics, time.perf_counter() - started)


def _streamed_seen_items(shards: ClickShards, plan, stats: FeatureStatistics, index: ItemIndex) -> SeenItems:
    """``seen_items_of`` on the shards: every training click coded while streaming (``scan_pairs``,
    8 bytes a click) and turned into the bundle's CSR arrays by sorting (about 18 bytes a click more)."""
    users = pd.Index(np.asarray(stats.users.ids, dtype=object), dtype=object)
    user_rows, item_rows = scan_pairs(shards, plan, users, pd.Index(index.item_ids, dtype=object))
    return SeenItems.from_coded_pairs(user_rows, item_rows, users.to_numpy())


def _streamed_tables(config: Config, counts, has_time: bool) -> tuple[TowerTables, ExampleJoin | None]:
    """The catalogue and user tables of a streamed log as ``load_dataset`` builds them (feature
    rows first, then ids only in the log), and their join onto click batches (None: ID towers)."""
    item_table, user_table = feature_tables(config.data)
    items = catalogue_table(ITEM, item_table, pd.DataFrame({ITEM: counts.catalogue()}))
    users = None
    if user_table is not None:
        users = catalogue_table(USER, user_table, pd.DataFrame({USER: counts.user_ids}),
                                pd.DataFrame({USER: counts.test_user_ids}))
    end = None if counts.last_train_time is None else float(counts.last_train_time)
    tables = TowerTables(config.towers, None, users, items, end_time=end)
    join = None if config.towers.is_id_only else ExampleJoin(config.towers, users, items, has_time=has_time)
    return tables, join


def _streamed_validation(shards: ClickShards, plan, config: Config, join: ExampleJoin | None) -> ValidationData:
    """Early stopping's data from the shards: the validation part carved from the training side
    (``plan_validation``: temporal with timestamps, else a seeded hash), the fit part streamed,
    and the validation clicks of up to ``data.stream.max_test_users`` sampled users in memory
    (with the query tower's inputs joined on)."""
    stream, train = config.data.stream, config.train
    carved = plan_validation(shards, plan, train.validation_fraction, training_split(config.split))
    counts = scan_counts(shards, carved)
    users = sample_test_users(counts, stream.max_test_users, stream.seed)
    fit_clicks, validation = collect_users(shards, carved, users)
    log.info("early stopping: %d fit-part clicks streamed, validation on %d clicks of %d sampled users",
             counts.train_rows, len(validation), len(users))
    source = StreamedClicks(
        shards, carved, train.batch_size, shuffle_buffer=stream.shuffle_buffer, seed=train.seed,
        train_rows=counts.train_rows, max_batches=stream.max_train_batches, join=join,
    )
    return ValidationData(source, validation if join is None else join.examples(validation), fit_clicks)


def _streamed_eval_set(user_train, user_test, stats: FeatureStatistics, catalogue_ids, config) -> EvalSet:
    """``build_eval_set`` when only the sampled users' clicks are in memory.

    ``build_eval_set`` reads "items with training clicks" from its train frame;
    here that frame holds the sampled users' clicks only, so unseen items are
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


def _evaluate_streamed(
    index, query_embeddings, eval_set: EvalSet, user_train, stats, config, shards: ClickShards, plan
) -> dict[str, Any]:
    """``evaluate_against_baselines`` with popularity from the streamed counts and ALS from a click
    matrix coded while streaming (``scan_pairs``)."""
    depth = max(config.ks)
    catalogue = pd.Index(index.item_ids, dtype=object)
    item_counts = np.zeros(len(catalogue), np.int64)
    item_counts[catalogue.get_indexer(pd.Index(stats.items.ids, dtype=object))] = stats.item_popularity.counts[1:]
    activity = user_train[USER].value_counts().reindex(pd.Index(eval_set.user_ids, dtype=object), fill_value=0)
    rankers = {"model": lambda: index_ranking(index, query_embeddings, eval_set, depth, config.query_batch_size)}
    if "popularity" in config.baselines.rankers:
        rankers["popularity"] = lambda: popularity_ranking_from_counts(item_counts, eval_set, depth)
    skipped = skipped_baselines(int(stats.item_popularity.counts.sum()), config)
    if "als" in config.baselines.rankers and "als" not in skipped:
        rankers["als"] = lambda: _streamed_als(shards, plan, stats, catalogue, eval_set, depth, config)
    results = compare_rankers(rankers, eval_set, item_counts, activity.to_numpy(), config)
    return {**results, "skipped_baselines": skipped} if skipped else results


def _streamed_als(shards, plan, stats, catalogue: pd.Index, eval_set: EvalSet, depth: int, config) -> np.ndarray:
    """The ALS baseline fitted on the click matrix coded while streaming the training clicks."""
    users = pd.Index(np.sort(np.asarray(stats.users.ids, dtype=object)), dtype=object)  # fit_als's order
    user_rows, item_rows = scan_pairs(shards, plan, users, catalogue)
    factors = fit_als_pairs(user_rows, item_rows, users, len(catalogue), config.baselines.als)
    return als_factors_ranking(factors, list(catalogue), eval_set, depth, config.query_batch_size)
