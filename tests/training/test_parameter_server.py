"""train.distribute: parameter_server: the ID tables sharded over ps tasks, steps scheduled on workers.

The cluster is real: 2 worker and 2 ps tasks as subprocesses (``pipelines.local_cluster.LocalCluster``,
each ``python -m retrieval.training.cluster``), started once for the module; the test process is
the chief. The job test starts its own cluster through the launcher (``python -m
pipelines.local_cluster``), whose chief is a subprocess.
"""

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from conftest import SMALL_JOB as SMALL  # the shared trained bundle's job: the one-process reference
from pydantic import ValidationError

import retrieval  # noqa: F401
from pipelines.local_cluster import CAPPED_STACK_BYTES, LocalCluster, _task_setup, free_port, peak_rss_bytes
from retrieval.config import Config, ModelConfig, ParameterServerConfig, SyntheticConfig, TrainConfig, load_config
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.serving import Bundle
from retrieval.training import FrameClicks, embed, train_epochs
from retrieval.training.checkpoints import TrainingCheckpoint
from retrieval.training.cluster import start_task
from retrieval.training.loop import step_function
from retrieval.training.optimizers import make_optimizer
from retrieval.training.parameter_server import (
    ClusterError,
    cluster_strategy,
    copy_towers,
    id_table_shapes,
    parameter_server_strategy,
    table_bytes,
    with_estimator_shards,
)
from retrieval.training.worker_input import (
    WorkerFedClicks,
    data_dispatcher,
    fed_by,
    read_staged,
    stage_batches,
    staged_dataset,
    wait_for_data_workers,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DIM = 8
ShardedVariable = tf.__internal__.distribute.ShardedVariable


@pytest.fixture(scope="module")
def cluster():
    # Not stopped at the end: this process, the chief, keeps a remote eager context whose clean-up at
    # exit would log an error a line for every task gone. The tasks die with this process instead.
    return LocalCluster(workers=2, ps=2).start()


@pytest.fixture(scope="module")
def chief(cluster):
    """The strategy (this process the chief) and the clicks its tables are shaped for."""
    rng = np.random.default_rng(0)
    clicks = pd.DataFrame({"user_id": [f"u{u}" for u in rng.integers(0, 40, 640)],
                           "item_id": [f"i{i}" for i in rng.integers(0, 30, 640)]})
    stats = FeatureStatistics.from_training_clicks(clicks)
    shapes = id_table_shapes(len(stats.users), len(stats.items), DIM)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = parameter_server_strategy(shapes, ParameterServerConfig(min_shard_bytes=64, max_shards=2), resolver)
    return strategy, clicks, stats, shapes


def _model(strategy, stats, seed=0):
    with strategy.scope():
        tf.keras.utils.set_random_seed(seed)
        model = build_model(ModelConfig(embedding_dim=DIM), stats)
        model.compile(optimizer=make_optimizer(TrainConfig(optimizer="lazy_adam", learning_rate=0.05)))
    return model


def _table(model, tower, layer):
    return getattr(model, tower).get_layer(layer).embeddings


def _whole(variable) -> np.ndarray:
    return tf.convert_to_tensor(variable).numpy()


@pytest.mark.parametrize("tower, layer, which", [("query_tower", "user_id_embedding", 0),
                                                 ("doc_tower", "item_id_embedding", 1)])
def test_tables_are_disjoint_row_ranges_on_the_ps_tasks(chief, tower, layer, which):
    strategy, _, stats, shapes = chief
    table = _table(_model(strategy, stats), tower, layer)
    assert isinstance(table, ShardedVariable)
    shards = table.variables
    assert len(shards) == 2
    assert sum(s.shape[0] for s in shards) == shapes[which][0]
    assert {s.device.split("/")[1] for s in shards} == {"job:ps"}
    assert len({s.device for s in shards}) == 2
    whole = np.concatenate([s.numpy() for s in shards])
    np.testing.assert_array_equal(whole, _whole(table))
    assert whole.shape == shapes[which]
    # Row 0 (the OOV row, zero-initialised) is the first shard's first row: rows are in order.
    np.testing.assert_array_equal(whole[0], 0.0)
    assert np.all(np.abs(whole[1:]).sum(axis=1) > 0)


def test_only_tables_are_sharded(chief):
    strategy, _, stats, _ = chief
    frequency = _model(strategy, stats).sampler.frequency
    variables = [v for hashes in (frequency.gaps, frequency.last_steps) for shards in hashes for v in shards]
    assert not any(isinstance(v, ShardedVariable) for v in variables)


def test_the_streaming_estimator_is_spread_over_the_ps_tasks(chief):
    """model.loss.streaming.num_shards: each hash array in row-range variables, placed on the ps tasks
    in turn (the job sets it to train.parameter_server.max_shards)."""
    strategy, _, stats, _ = chief
    with strategy.scope():
        model = build_model(ModelConfig(embedding_dim=DIM, loss={"streaming": {"num_shards": 2}}), stats)
    frequency = model.sampler.frequency
    for hashes in (frequency.gaps, frequency.last_steps):
        for shards in hashes:
            assert len({shard.device for shard in shards}) == 2 and all("job:ps" in s.device for s in shards)
    config = load_config(None, ["train.distribute=parameter_server", "train.parameter_server.max_shards=3"])
    assert with_estimator_shards(config).model.loss.streaming.num_shards == 3
    pinned = load_config(None, ["train.parameter_server.max_shards=3", "model.loss.streaming.num_shards=1"])
    assert with_estimator_shards(pinned).model.loss.streaming.num_shards == 1


def test_one_scheduled_step_updates_the_batch_rows_as_one_process_does(chief):
    """A step scheduled on a worker changes exactly the rows of the batch's ids, by what the same
    step on one process computes (same weights, same batch, lazy_adam)."""
    strategy, clicks, stats, _ = chief
    model = _model(strategy, stats)
    reference = build_model(ModelConfig(embedding_dim=DIM), stats)
    copy_towers(model, reference)
    reference.compile(optimizer=make_optimizer(TrainConfig(optimizer="lazy_adam", learning_rate=0.05)))
    batch = next(iter(FrameClicks(clicks, 64, seed=0).epoch(0)))
    layers = [("query_tower", "user_id_embedding", "user_id"), ("doc_tower", "item_id_embedding", "item_id")]
    before = [_whole(_table(model, tower, layer)) for tower, layer, _ in layers]
    np.testing.assert_array_equal(before[0], _whole(_table(reference, "query_tower", "user_id_embedding")))

    with strategy.scope():
        step = step_function(model)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    loss = float(coordinator.schedule(step, args=(batch,)).fetch()["loss"])
    expected_loss = float(step_function(reference)(batch)["loss"])
    assert loss == pytest.approx(expected_loss, rel=1e-5)

    for (tower, layer, feature), old in zip(layers, before):
        new = _whole(_table(model, tower, layer))
        rows = np.unique(getattr(model, tower).get_layer(f"{feature}_lookup")(batch[feature]).numpy())
        changed = np.flatnonzero(np.abs(new - old).sum(axis=1) > 0)
        np.testing.assert_array_equal(changed, rows)
        first_shard = _table(model, tower, layer).variables[0].shape[0]
        assert rows.min() < first_shard <= rows.max()  # the batch's rows are on both ps tasks
        np.testing.assert_allclose(new, _whole(_table(reference, tower, layer)), atol=1e-6)


def test_training_loop_through_the_coordinator(chief, tmp_path):
    """train_epochs schedules every batch, its epoch logs are the steps' mean loss, and a
    checkpoint due mid-epoch holds every step before it."""
    strategy, clicks, stats, _ = chief
    model = _model(strategy, stats)
    source = FrameClicks(clicks, 64, seed=0)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
        checkpoint = TrainingCheckpoint(tmp_path, model, model.optimizer, every_steps=7)
        state = train_epochs(model, source, 3, checkpoint=checkpoint, verbose=0)
    assert state.epoch == 3 and state.steps == 3 * source.steps_per_epoch == int(model.optimizer.iterations)
    losses = state.history["loss"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert losses[2] < losses[0]
    # Saves at steps 7, 14, 21, 28 (10 steps an epoch); the last two are kept.
    saved = json.loads((tmp_path / "state-28.json").read_text())
    assert (saved["epoch"], saved["batch"], saved["steps"]) == (2, 8, 28)
    assert saved["history"]["loss"] == losses[:2]
    # Every step scheduled before the save had run: the optimizer's count and the values read.
    reader = tf.train.load_checkpoint(str(tmp_path / "ckpt-28"))
    assert reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 28
    assert set(saved["epoch_sums"]) == set(state.history) and np.isfinite(saved["epoch_sums"]["loss"])


def test_a_killed_worker_restarted_at_its_address_loses_no_step(chief, cluster):
    strategy, clicks, stats, _ = chief
    model = _model(strategy, stats, seed=1)

    class KillsAWorker(FrameClicks):
        def epoch(self, epoch, skip_batches=0):
            for number, batch in enumerate(super().epoch(epoch, skip_batches)):
                if epoch == 0 and number == 3:
                    cluster.kill("worker", 1)  # SIGKILL with steps scheduled on it
                yield batch
                if epoch == 0 and number == 6:
                    cluster.start_task("worker", 1)

    source = KillsAWorker(clicks, 32, seed=0)
    with strategy.scope():
        state = train_epochs(model, source, 2, verbose=0)
    assert state.steps == 2 * source.steps_per_epoch
    # Every step ran; the coordinator runs a function at least once, so the step in flight on the
    # killed worker, if its update had landed, ran again.
    assert state.steps <= int(model.optimizer.iterations) <= state.steps + 1
    assert all(np.isfinite(state.history["loss"]))


def test_trained_towers_copy_into_unsharded_ones_and_export_the_same_embeddings(chief, tmp_path):
    strategy, clicks, stats, _ = chief
    model = _model(strategy, stats, seed=2)
    with strategy.scope():
        train_epochs(model, FrameClicks(clicks, 64, seed=0), 1, verbose=0)
    plain = build_model(ModelConfig(embedding_dim=DIM), stats)
    copy_towers(model, plain)
    assert not any(isinstance(v, ShardedVariable) or "part_" in v.name for v in plain.query_tower.weights)
    users = [f"u{u}" for u in range(40)] + ["unknown"]
    sharded_embeddings = embed(model.query_tower, "user_id", users)
    np.testing.assert_allclose(embed(plain.query_tower, "user_id", users), sharded_embeddings, atol=1e-6)
    tf.saved_model.save(plain.query_tower, str(tmp_path / "query"))
    loaded = tf.saved_model.load(str(tmp_path / "query"))
    served = loaded.signatures["serving_default"](user_id=tf.constant(users))
    np.testing.assert_allclose(next(iter(served.values())).numpy(), sharded_embeddings, atol=1e-6)


def test_workers_read_the_staged_batches_themselves(chief, cluster, tmp_path):
    """input: workers: the chief reads the source once, to stage it; the workers read the staged
    files through the tf.data service for every epoch after."""
    strategy, clicks, stats, _ = chief
    model = _model(strategy, stats, seed=3)

    class CountsEpochs(FrameClicks):
        read = 0

        def epoch(self, epoch, skip_batches=0):
            CountsEpochs.read += 1
            return super().epoch(epoch, skip_batches)

    source = CountsEpochs(clicks, 64, seed=0)
    config = ParameterServerConfig(min_shard_bytes=64, max_shards=2, input="workers", staged_files=4,
                                   data_dispatcher_port=cluster.data_dispatcher_port, staging_dir=str(tmp_path))
    with strategy.scope(), fed_by(source, config) as batches:
        assert isinstance(batches, WorkerFedClicks) and CountsEpochs.read == 1
        staged = read_staged(tf.data.Dataset.from_tensor_slices(batches.paths), batches.element_spec)
        pairs = sorted(pair for batch in staged for pair in zip(batch["user_id"].numpy(), batch["item_id"].numpy()))
        state = train_epochs(model, batches, 3, verbose=0)
        directory = Path(batches.paths[0]).parent
    assert pairs == sorted(zip(clicks["user_id"].str.encode("utf-8"), clicks["item_id"].str.encode("utf-8")))
    assert CountsEpochs.read == 1  # 3 epochs trained from the staged files, none fed by the chief
    assert state.steps == 3 * source.steps_per_epoch == int(model.optimizer.iterations)
    losses = state.history["loss"]
    assert all(np.isfinite(losses)) and losses[2] < losses[0], losses
    assert not directory.exists()  # the staged files go with the run


def test_a_killed_worker_that_reads_its_own_batches_recovers(chief, cluster, tmp_path):
    """input: workers: a worker SIGKILLed after the first epoch and started again at its address (its
    tf.data worker registers again); the coordinator rebuilds its dataset and the run completes."""
    strategy, clicks, stats, _ = chief
    model = _model(strategy, stats, seed=4)
    source = FrameClicks(clicks, 32, seed=0)
    config = ParameterServerConfig(min_shard_bytes=64, max_shards=2, input="workers", staged_files=4,
                                   data_dispatcher_port=cluster.data_dispatcher_port, staging_dir=str(tmp_path))

    def kill_and_restart(epoch, logs):
        if epoch == 0:
            cluster.restart("worker", 1)

    with strategy.scope(), fed_by(source, config) as batches:
        state = train_epochs(model, batches, 3, hooks=[kill_and_restart], verbose=0)
    assert state.steps == 3 * source.steps_per_epoch
    assert state.steps <= int(model.optimizer.iterations) <= state.steps + 1
    assert all(np.isfinite(state.history["loss"]))


def test_staged_batches_stream_every_row_once_a_pass():
    rng = np.random.default_rng(1)
    clicks = pd.DataFrame({"user_id": [f"u{u}" for u in range(300)],
                           "item_id": [f"i{i}" for i in rng.integers(0, 9, 300)]})
    source = FrameClicks(clicks, 32, seed=0)
    with tempfile.TemporaryDirectory() as directory:
        paths = stage_batches(source.epoch(0), Path(directory), 3)
        stream = staged_dataset(paths, source.epoch(0).element_spec, 50)
        first, second = ([user for batch in stream.skip(skip).take(6) for user in batch["user_id"].numpy()]
                         for skip in (0, 6))
    assert sorted(first) == sorted(second) == sorted(clicks["user_id"].str.encode("utf-8"))
    assert first != second  # each pass in another order


# --- The job on a launched cluster ---------------------------------------------------------------



@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cluster-artifacts")
    flags = [f"--set={kv}" for kv in [*SMALL, "train.verbose=2", f"run.output_dir={out}", "run.name=ps",
                                      "train.parameter_server.max_shards=2",
                                      "train.parameter_server.min_shard_bytes=1024"]]
    finished = subprocess.run(
        [sys.executable, "-m", "pipelines.local_cluster", "--workers", "2", "--ps", "2",
         "--task-logs", str(out / "tasks"), "--rss-report", str(out / "rss.json"),
         "--", "--config", str(ROOT / "configs" / "default.yaml"), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env={**os.environ, "TF_CONFIG": ""},
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    return out / "ps", finished.stderr


def test_the_job_trains_on_the_cluster_close_to_one_process(cluster_run, trained_bundle):
    directory, log = cluster_run
    metrics = json.loads((directory / "metrics.json").read_text())
    config = load_config(directory / "config.yaml")
    assert config.train.distribute == "parameter_server"
    assert "early stopping: best epoch" in log and "epoch 1/" in log
    single = trained_bundle.result  # the same job in one process
    model, popular, alone = metrics["model"], metrics["popularity"], single.metrics["model"]
    assert model["recall@20"] > 2 * popular["recall@20"], (model, popular)
    # Asynchronous steps (two workers) train other weights than one process does, and every run
    # differs: measured 0.68 to 0.70 in most runs, 0.60 and 0.61 in two of 19, and 0.58 once in a full
    # suite (2026-12-05: early stopping chose epoch 4 of 6), against 0.704 for one process on this
    # data; the tolerance covers them, and a model that did not train stays far outside it.
    chosen = [line for line in log.splitlines() if "best epoch" in line]
    assert model["recall@20"] == pytest.approx(alone["recall@20"], abs=0.15), (model["recall@20"], alone["recall@20"],
                                                                               chosen)
    assert metrics["data"] == single.metrics["data"]


def test_a_streamed_log_trains_on_the_cluster_as_one_process_streams_it(tmp_path, train_run):
    """``data.out_of_core``: the chief streams the shards and feeds the batches, as one process does."""
    from retrieval.data.synthetic import generate_clicks

    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=600, n_items=300, mean_clicks_per_user=30, seed=0))
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, rows in enumerate(np.array_split(np.arange(len(clicks)), 3)):
        clicks.iloc[rows].to_parquet(shards / f"part-{i}.parquet", index=False)
    streamed = ["data.source=files", f"data.clicks.path={shards}/*.parquet", "data.out_of_core=true",
                *SMALL[3:], "train.validation_fraction=0"]
    flags = [f"--set={kv}" for kv in [*streamed, "train.verbose=2", f"run.output_dir={tmp_path / 'runs'}",
                                      "run.name=streamed", "train.parameter_server.max_shards=2",
                                      "train.parameter_server.min_shard_bytes=1024"]]
    finished = subprocess.run(
        [sys.executable, "-m", "pipelines.local_cluster", "--workers", "1", "--ps", "2",
         "--", "--config", str(ROOT / "configs" / "default.yaml"), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env={**os.environ, "TF_CONFIG": ""},
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    metrics = json.loads((tmp_path / "runs" / "streamed" / "metrics.json").read_text())
    _, single = train_run("default.yaml", streamed, "streamed-single")
    assert metrics["data"] == single.metrics["data"] and metrics["data"]["train_clicks"] > 10_000
    # One worker runs one step at a time, so the run is close to one process's: measured recall@20
    # 0.6961 on the cluster against 0.6970 for one process streaming the same shards (popularity 0.2098).
    assert metrics["model"]["recall@20"] == pytest.approx(single.metrics["model"]["recall@20"], abs=0.05)
    assert metrics["model"]["recall@20"] > 2 * metrics["popularity"]["recall@20"]


def test_the_job_trains_with_the_workers_reading_the_batches(tmp_path, trained_bundle):
    """input: workers: the chief stages the batches, the workers read them through the tf.data service."""
    flags = [f"--set={kv}" for kv in [*SMALL, "train.verbose=2", f"run.output_dir={tmp_path}", "run.name=fed",
                                      "train.parameter_server.max_shards=2", "train.parameter_server.input=workers",
                                      "train.parameter_server.min_shard_bytes=1024",
                                      f"train.parameter_server.staging_dir={tmp_path / 'staging'}"]]
    finished = subprocess.run(
        [sys.executable, "-m", "pipelines.local_cluster", "--workers", "2", "--ps", "2",
         "--", "--config", str(ROOT / "configs" / "default.yaml"), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env={**os.environ, "TF_CONFIG": ""},
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert not list((tmp_path / "staging").iterdir())  # each run's staged files went with it
    assert finished.stderr.count("staging the training batches for the workers") == 2  # selection, refit
    metrics = json.loads((tmp_path / "fed" / "metrics.json").read_text())
    single = trained_bundle.result  # the same job in one process
    # Measured recall@20 0.683 and 0.692 in two runs, against 0.704 for one process (popularity 0.210).
    assert metrics["model"]["recall@20"] == pytest.approx(single.metrics["model"]["recall@20"], abs=0.12)
    assert metrics["model"]["recall@20"] > 2 * metrics["popularity"]["recall@20"]


def test_the_cluster_bundle_loads_and_serves_without_a_cluster(cluster_run):
    directory, _ = cluster_run
    bundle = Bundle.load(directory)  # loading reproduces the recorded probe query's top-k
    probe = bundle.manifest["probe"]
    served = bundle.recommend(probe["query"], k=10, exclude_seen=False)
    assert served.item_ids == probe["item_ids"]
    assert np.allclose(served.scores, probe["scores"], atol=1e-5)
    data = json.loads((directory / "metrics.json").read_text())["data"]
    dim = bundle.manifest["embedding_dim"]
    for name, rows in (("query", data["train_users"] + 1), ("doc", data["train_items"] + 1)):
        saved = next((directory / "models" / name).iterdir()) / "variables" / "variables"
        shapes = tf.train.load_checkpoint(str(saved)).get_variable_to_shape_map().values()
        assert [rows, dim] in shapes  # the whole table, as one process exports it
        assert not [shape for shape in shapes if len(shape) == 2 and shape[1] == dim and shape[0] < rows]


def test_the_launcher_reports_each_tasks_peak_rss(cluster_run):
    directory, _ = cluster_run
    report = json.loads((directory.parent / "rss.json").read_text())
    assert sorted(report) == ["chief", "ps-0", "ps-1", "worker-0", "worker-1"]
    for task, peak in report.items():  # each a TensorFlow process: hundreds of MB, less than the machine
        assert 100 << 20 < peak < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), (task, peak)


def test_peak_rss_is_the_kernels_high_water_mark():
    # The same figure as this process's rusage (both the kernel's hiwater_rss, in kB).
    by_rusage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak_rss_bytes(os.getpid()) == pytest.approx(by_rusage, rel=0.05)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert peak_rss_bytes(ended.pid) is None


def test_a_capped_task_gets_its_data_limit_and_small_stacks():
    limits = ("import resource; "
              "print(resource.getrlimit(resource.RLIMIT_DATA), resource.getrlimit(resource.RLIMIT_STACK))")
    capped = subprocess.run([sys.executable, "-c", limits], preexec_fn=_task_setup(3 << 30),
                            capture_output=True, text=True, check=True).stdout.split(") (")
    assert capped[0] == f"({3 << 30}, {3 << 30}"
    assert capped[1].startswith(f"{CAPPED_STACK_BYTES},")
    free = subprocess.run([sys.executable, "-c", limits], preexec_fn=_task_setup(None),
                          capture_output=True, text=True, check=True).stdout
    assert free.startswith(str(resource.getrlimit(resource.RLIMIT_DATA)).replace("L", ""))


def test_the_launcher_stops_its_tasks_when_the_chief_fails():
    finished = subprocess.run(
        [sys.executable, "-m", "pipelines.local_cluster", "--workers", "1", "--ps", "1", "--",
         "--set", "train.epochs=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert finished.returncode == 2, finished.stderr[-2000:]  # the chief's status: a config error
    assert "train.epochs" in finished.stderr
    line = next(line for line in finished.stderr.splitlines() if line.startswith("local cluster: "))
    spec = json.loads(line.removeprefix("local cluster: "))
    for address in spec["worker"] + spec["ps"]:
        host, port = address.rsplit(":", 1)
        with pytest.raises(OSError):  # nothing listens there any more
            socket.create_connection((host, int(port)), timeout=2).close()


# --- Errors and config ---------------------------------------------------------------------------


def test_cluster_errors_name_what_is_missing(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ClusterError, match="TF_CONFIG"):
        cluster_strategy([(3, 2)], ParameterServerConfig())
    spec = {"chief": ["localhost:1"], "worker": ["localhost:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}}))
    with pytest.raises(ClusterError, match="no ps task"):
        cluster_strategy([(3, 2)], ParameterServerConfig())
    spec["ps"] = ["localhost:3"]
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ClusterError, match="retrieval.training.cluster"):
        cluster_strategy([(3, 2)], ParameterServerConfig())
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}}))
    with pytest.raises(ClusterError, match="worker or ps task"):
        start_task()


def test_the_job_refuses_a_missing_cluster_before_reading_the_data(monkeypatch, tmp_path):
    from retrieval.jobs import train_evaluate_export

    monkeypatch.delenv("TF_CONFIG", raising=False)
    config = load_config(None, ["train.distribute=parameter_server", f"run.output_dir={tmp_path}"])
    with pytest.raises(ClusterError, match="TF_CONFIG"):
        train_evaluate_export(config)
    assert not list(tmp_path.iterdir())


def test_memory_arithmetic():
    assert table_bytes(1_000_000, 64, optimizer_slots=2) == 1_000_000 * 64 * 4 * 3
    assert id_table_shapes(10, 5, 4) == [(11, 4), (6, 4)]


def test_config():
    assert TrainConfig(distribute="parameter_server").parameter_server.max_shards == 1
    with pytest.raises(ValidationError, match="max_shards"):
        TrainConfig(parameter_server={"max_shards": 0})
    with pytest.raises(ValidationError, match="min_shard_bytes"):
        TrainConfig(parameter_server={"min_shard_bytes": -1})
    fed = TrainConfig(parameter_server={"input": "workers", "data_dispatcher_port": 5050})
    assert fed.parameter_server.staged_files == 16
    with pytest.raises(ValidationError, match="data_dispatcher_port"):
        TrainConfig(parameter_server={"input": "workers"})
    with pytest.raises(ValidationError, match=r"input: workers needs train\.distribute: parameter_server"):
        Config.model_validate({"data": {"synthetic": {}},
                               "train": {"parameter_server": {"input": "workers", "data_dispatcher_port": 5050}}})


def test_workers_without_a_tf_data_worker_are_named():
    """A worker started without --data-dispatcher never registers: the chief says so, not a hang."""
    with pytest.raises(ClusterError, match=r"0 of the 2 worker tasks registered .*--data-dispatcher"):
        wait_for_data_workers(data_dispatcher(free_port()), 2, timeout=1.0)


@pytest.mark.parametrize("override, key", [
    ({"model": {"loss": {"kind": "full_softmax"}}}, "model.loss.kind"),
    ({"model": {"loss": {"hard_negatives": "mined", "num_hard_negatives": 2}}}, "model.loss.hard_negatives"),
])
def test_config_refuses_what_the_cluster_cannot_run(override, key):
    with pytest.raises(ValidationError, match=key.replace(".", r"\.")):
        Config.model_validate({"data": {"synthetic": {}}, "train": {"distribute": "parameter_server"}, **override})
