"""Distributed-training checks, run by ``tests/training/test_distribute.py`` in a subprocess.

Two logical CPU devices must be configured before TensorFlow initialises its
devices, and MultiWorkerMirroredStrategy must be created before any other
TensorFlow work, so each check runs in a fresh interpreter:

    python tests/_distribute_check.py mirrored       # 2 logical CPUs, MirroredStrategy
    TF_CONFIG=... python tests/_distribute_check.py multi_worker   # one process per worker
    TF_CONFIG=... python tests/_distribute_check.py streamed_job CONFIG [KEY=VALUE ...]   # the job, out of core

The last stdout line is one JSON object of measured numbers; the test asserts on them.
"""

from __future__ import annotations

import json
import logging
import sys
import time

START = time.perf_counter()

import numpy as np
import pandas as pd
import tensorflow as tf

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
from retrieval.config import LossConfig, ModelConfig, TrainConfig
from retrieval.features import FeatureStatistics
from retrieval.losses import LossInputs, gather_across_replicas
from retrieval.model import build_model, tower_inputs
from retrieval.training import FrameClicks, distribution_strategy, fit, train_epochs

BATCH = 16
ROWS = 2 * BATCH - 1  # the second batch has 15 rows: 8 on one replica, 7 on the other

# name -> (model config, use_weights). Each must train exactly as on one device.
EXACT = {
    "in_batch_static": (
        ModelConfig(embedding_dim=8, temperature=0.3, l2_regularization=0.01, loss=LossConfig()),
        True,
    ),
    # Streaming log-Q, and the 3 hardest of the global batch's negatives per query.
    "in_batch_streaming_top_k": (
        ModelConfig(
            embedding_dim=8,
            loss=LossConfig(
                log_q_source="streaming",
                streaming={"num_buckets": 64, "learning_rate": 0.2},
                hard_negatives="in_batch_top_k",
                num_hard_negatives=3,
            ),
        ),
        False,
    ),
    "full_softmax": (ModelConfig(embedding_dim=8, loss=LossConfig(kind="full_softmax")), True),
    # The recipe losses average over each row's kept negatives: the global batch's, as one device.
    "in_batch_cosine_contrastive": (
        ModelConfig(
            embedding_dim=8,
            log_q_correction=False,
            loss=LossConfig(kind="cosine_contrastive", margin=0.1, negative_weight=5.0),
        ),
        True,
    ),
    "in_batch_bsl_top_k": (
        ModelConfig(
            embedding_dim=8,
            temperature=0.3,
            loss=LossConfig(kind="bsl", hard_negatives="in_batch_top_k", num_hard_negatives=3),
        ),
        False,
    ),
}
# Corpus draws differ per replica (each replica's generator stream): these only must train.
SMOKE = {"mixed": ModelConfig(embedding_dim=8, loss=LossConfig(negatives="mixed", num_negatives=6))}


def _two_cpus() -> None:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


def _clicks(seed: int = 0, users: int = 40, items: int = 30, clicks: int = ROWS) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "user_id": [f"u{u}" for u in rng.integers(0, users, clicks)],
            # Zipf: repeated items, so accidental hits and log-Q matter.
            "item_id": [f"i{i}" for i in np.minimum(rng.zipf(1.3, clicks), items)],
            "weight": rng.uniform(0.5, 2.0, clicks).astype(np.float32),
        }
    )


def _batch(clicks: pd.DataFrame) -> dict:
    return {
        "user_id": tf.constant(clicks["user_id"].tolist()),
        "item_id": tf.constant(clicks["item_id"].tolist()),
        "weight": tf.constant(clicks["weight"].to_numpy(np.float32)),
    }


def _build(config, stats, use_weights, strategy):
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = build_model(config, stats, use_weights=use_weights)
        model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.5))
    return model


def _loss_inputs(model, features) -> LossInputs:
    """What ``TwoTowerModel.compute_loss`` hands the loss (without observing), gathered across replicas."""
    queries = model.query_tower(tower_inputs(model.query_tower, features))
    positives = model.doc_tower(tower_inputs(model.doc_tower, features))
    positive_ids = model.item_index(features["item_id"])
    negatives = model.sampler.sample(positive_ids)
    return gather_across_replicas(
        LossInputs(
            queries=queries,
            positives=positives,
            positive_ids=positive_ids,
            negatives=(negatives,),
            negative_embeddings=(model.embed_items(negatives.ids),),
            includes_batch_positives=model.sampler.includes_batch_positives,
            sample_weight=features["weight"] if model.use_weights else None,
        )
    )


def _per_replica(strategy, model, features):
    """Per replica: rows, logits, labels, loss share (training=False: nothing is observed)."""
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(features).batch(BATCH))

    def replica(batch):
        inputs = _loss_inputs(model, batch)
        logits, labels = model.objective.logits_and_labels(inputs)
        return tf.shape(inputs.queries)[0], logits, labels, model.compute_loss(batch, training=False)

    # Eager (no tracing: these run once); the replicas still all-gather as in a compiled step.
    rows, logits, labels, shares = strategy.run(replica, args=(next(iter(dataset)),))
    local = strategy.experimental_local_results
    return (
        [int(r) for r in local(rows)],
        [x.numpy() for x in local(logits)],
        [x.numpy() for x in local(labels)],
        [float(x) for x in local(shares)],
    )


def _max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def _one_epoch(model, clicks: pd.DataFrame, strategy) -> dict[str, list[float]]:
    """One epoch of the project's training loop (``train_epochs``) under ``strategy``: its history."""
    with strategy.scope():
        return train_epochs(model, FrameClicks(clicks, BATCH, seed=0, shuffle=False), 1, verbose=0).history


def _exact(name, config, use_weights, strategy, clicks, stats) -> dict:
    one = _build(config, stats, use_weights, tf.distribute.get_strategy())
    two = _build(config, stats, use_weights, strategy)
    initial = one.get_weights()
    initial_trainable = [v.numpy() for v in one.trainable_variables]
    out = {"initial_weight_difference": _max_difference(initial, two.get_weights())}

    out["batches"] = []
    for start in range(0, len(clicks), BATCH):  # 16 rows, then 15 (uneven split)
        part = clicks.iloc[start : start + BATCH]
        rows, logits, labels, shares = _per_replica(strategy, two, _batch(part))
        reference_logits, reference_labels = one.objective.logits_and_labels(_loss_inputs(one, _batch(part)))
        # What each replica would compute on its own rows only (TFRS under MirroredStrategy).
        halves = [_batch(part[begin : begin + n]) for begin, n in zip(np.cumsum([0] + rows), rows)]
        out["batches"].append(
            {
                "rows": len(part),
                "replica_rows": rows,
                "replica_logit_columns": [x.shape[1] for x in logits],
                "logit_difference": float(np.max(np.abs(np.concatenate(logits) - reference_logits.numpy()))),
                "labels_equal": bool(np.array_equal(np.concatenate(labels), reference_labels.numpy())),
                "loss_two_replicas": sum(shares),
                "loss_one_device": float(one.compute_loss(_batch(part), training=False)),
                "loss_without_gathering": float(
                    sum(n * one.compute_loss(half, training=False) for n, half in zip(rows, halves)) / len(part)
                ),
            }
        )

    history_one = _one_epoch(one, clicks, tf.distribute.get_strategy())
    history_two = _one_epoch(two, clicks, strategy)
    for key in ("loss", "regularization_loss", "total_loss"):
        out[f"fit_{key}"] = [history_one[key][-1], history_two[key][-1]]
    out["trained_weight_difference"] = _max_difference(one.get_weights(), two.get_weights())
    trainable = [v.numpy() for v in one.trainable_variables]
    out["weight_change"] = _max_difference(trainable, initial_trainable)
    frequency = getattr(one.sampler, "frequency", None)
    if hasattr(frequency, "gap"):
        other = two.sampler.frequency
        out["streaming_steps"] = [int(frequency.step.numpy()), int(other.step.numpy())]
        out["streaming_gap_difference"] = float(np.max(np.abs(frequency.gap.numpy() - other.gap.numpy())))
        out["streaming_draws_per_step"] = [float(frequency.draws_per_step.numpy()), float(other.draws_per_step.numpy())]
    return out


def _fit_job(strategy, train: pd.DataFrame, stats) -> dict:
    """``retrieval.training.fit`` with early stopping (the job's path) under ``strategy``."""
    config = TrainConfig(
        epochs=2, batch_size=64, learning_rate=0.05, verbose=0, validation_fraction=0.2, refit=False
    )
    with strategy.scope():
        tf.keras.utils.set_random_seed(config.seed)
        model = build_model(ModelConfig(embedding_dim=16), stats)
        history = fit(model, train, config)
    return {"replicas": strategy.num_replicas_in_sync, "history": history}


def mirrored() -> dict:
    _two_cpus()
    strategy = distribution_strategy(TrainConfig(distribute="mirrored"))
    clicks = _clicks()
    stats = FeatureStatistics.from_training_clicks(clicks)
    result = {"replicas": strategy.num_replicas_in_sync, "exact": {}, "smoke": {}}
    for name, (config, use_weights) in EXACT.items():
        result["exact"][name] = _exact(name, config, use_weights, strategy, clicks, stats)
        print(f"{time.perf_counter() - START:.1f}s {name}", file=sys.stderr)
    for name, config in SMOKE.items():
        model = _build(config, stats, False, strategy)
        history = _one_epoch(model, clicks, strategy)
        result["smoke"][name] = history["loss"]
    with strategy.scope():
        miner = build_model(
            ModelConfig(embedding_dim=8, loss=LossConfig(hard_negatives="mined", num_hard_negatives=2)),
            stats,
            train_clicks=clicks,
        )
        miner.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.5))
    print(f"{time.perf_counter() - START:.1f}s smoke", file=sys.stderr)
    try:
        _one_epoch(miner, clicks, strategy)
        result["mined_error"] = None
    except ValueError as error:
        result["mined_error"] = str(error)

    print(f"{time.perf_counter() - START:.1f}s mined", file=sys.stderr)
    train = _clicks(seed=1, users=60, items=40, clicks=600)
    train_stats = FeatureStatistics.from_training_clicks(train)
    # One MirroredStrategy per process: a second one over the same devices reuses collective keys.
    result["fit"] = {
        name: _fit_job(chosen, train, train_stats)
        for name, chosen in (("none", tf.distribute.get_strategy()), ("mirrored", strategy))
    }
    return result


def multi_worker() -> dict:
    strategy = distribution_strategy(TrainConfig(distribute="multi_worker"))
    clicks = _clicks(clicks=4 * BATCH)
    stats = FeatureStatistics.from_training_clicks(clicks)
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = build_model(ModelConfig(embedding_dim=8), stats)
        model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.5))
    with strategy.scope():
        history = train_epochs(model, FrameClicks(clicks, BATCH, seed=0), 2, verbose=0).history
    # The same model and global batches on this process alone (the default strategy).
    tf.keras.utils.set_random_seed(0)
    reference = build_model(ModelConfig(embedding_dim=8), stats)
    reference.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.5))
    one_device = train_epochs(reference, FrameClicks(clicks, BATCH, seed=0), 2, verbose=0).history
    return {
        "is_multi_worker": isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
        "replicas": strategy.num_replicas_in_sync,
        "loss": history["loss"],
        "loss_one_device": one_device["loss"],
        "weight_difference": _max_difference(model.get_weights(), reference.get_weights()),
    }


def streamed_job() -> dict:
    """The out-of-core job (``train.distribute: multi_worker``) on this worker, then what this worker's
    share of each epoch holds (``distributed_epoch``, the loop's input) beside the whole epoch's."""
    from retrieval.config import load_config
    from retrieval.data.streaming import ClickShards, plan_split, scan_counts
    from retrieval.jobs import train_evaluate_export
    from retrieval.training import StreamedClicks
    from retrieval.training.loop import distributed_epoch
    from retrieval.training.runtime import worker_count

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")  # the test reads "resuming from step"
    config = load_config(sys.argv[2], [arg for arg in sys.argv[3:] if arg != "--no-probe"])
    strategy = distribution_strategy(config.train)  # the job's (one per process)
    result = train_evaluate_export(config)
    out = {"metrics": {key: result.metrics[key] for key in ("model", "final_train_loss", "data")},
           "train_log": (result.directory / "train_log.csv").read_text(), "workers": worker_count(strategy)}
    if "--no-probe" in sys.argv:
        return out
    stream = config.data.stream
    shards = ClickShards.open(config.data.clicks, config.data.columns, stream.read_batch_size)
    plan = plan_split(shards, config.split)
    source = StreamedClicks(shards, plan, config.train.batch_size, shuffle_buffer=stream.shuffle_buffer,
                            seed=stream.seed, train_rows=scan_counts(shards, plan).train_rows)
    task = strategy.cluster_resolver.task_id
    out.update(files=list(source.worker_files(task, worker_count(strategy))), steps=source.steps_per_epoch,
               epochs=[], whole_epochs=[])

    def rows(batch) -> list:
        return [[u.decode(), i.decode(), float(w)] for u, i, w in
                zip(batch["user_id"].numpy(), batch["item_id"].numpy(), batch["weight"].numpy())]

    for epoch in range(2):
        mine, steps = [], 0
        with strategy.scope():  # as the job trains
            if epoch == 0:  # through the loop's distributed input (a collective a batch: slow, so once)
                for batch in distributed_epoch(source, epoch):
                    steps += 1
                    mine += [rows(local) for local in strategy.experimental_local_results(batch)]
            else:  # what distribute_datasets_from_function asks this worker for
                context = tf.distribute.InputContext(2, task, strategy.num_replicas_in_sync)
                mine = [rows(batch) for batch in source.worker_epoch(epoch, 0, context)]
                steps = len(mine) // (strategy.num_replicas_in_sync // 2)
        out["epochs"].append({"steps": steps, "batches": mine})
        out["whole_epochs"].append([row for batch in source.epoch(epoch) for row in rows(batch)])
    return out


if __name__ == "__main__":
    check = {"mirrored": mirrored, "multi_worker": multi_worker, "streamed_job": streamed_job}[sys.argv[1]]
    print(json.dumps(check()))
