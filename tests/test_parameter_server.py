"""train.distribute: parameter_server, first slice: config refusals and ID tables sharded over ps tasks.

The cluster is in-process: two workers and two ps tasks as tf.distribute.Server threads on free
ports, the test process the chief (TensorFlow's parameter-server tutorial recipe).
"""

import socket

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from pydantic import ValidationError

import retrieval  # noqa: F401
from retrieval.config import Config, ModelConfig, ParameterServerConfig, TrainConfig
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.training.parameter_server import (
    parameter_server_strategy,
    table_bytes,
)

pytestmark = pytest.mark.slow
DIM = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def sharded():
    spec = {kind: [f"localhost:{_free_port()}" for _ in range(2)] for kind in ("worker", "ps")}
    cluster = tf.train.ClusterSpec(spec)
    try:
        for kind, tasks in spec.items():
            for index in range(len(tasks)):
                tf.distribute.Server(cluster, job_name=kind, task_index=index, protocol="grpc", start=True)
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"in-process tf.distribute servers cannot start here: {error}")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    rng = np.random.default_rng(0)
    clicks = pd.DataFrame({"user_id": [f"u{u}" for u in rng.integers(0, 40, 400)],
                           "item_id": [f"i{i}" for i in rng.integers(0, 30, 400)]})
    stats = FeatureStatistics.from_training_clicks(clicks)
    shapes = [(len(stats.users) + 1, DIM), (len(stats.items) + 1, DIM)]
    strategy = parameter_server_strategy(shapes, ParameterServerConfig(min_shard_bytes=64, max_shards=2), resolver)
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = build_model(ModelConfig(embedding_dim=DIM), stats)
    tf.keras.utils.set_random_seed(0)
    reference = build_model(ModelConfig(embedding_dim=DIM), stats)
    return model, reference, shapes


@pytest.mark.parametrize("tower, layer, which", [("query_tower", "user_id_embedding", 0),
                                                 ("doc_tower", "item_id_embedding", 1)])
def test_tables_are_disjoint_row_ranges_on_the_ps_tasks(sharded, tower, layer, which):
    model, reference, shapes = sharded
    table = getattr(model, tower).get_layer(layer).embeddings
    assert isinstance(table, tf.__internal__.distribute.ShardedVariable)
    shards = table.variables
    assert len(shards) == 2
    assert sum(s.shape[0] for s in shards) == shapes[which][0]
    assert {s.device.split("/")[1] for s in shards} == {"job:ps"}
    assert len({s.device for s in shards}) == 2
    whole = np.concatenate([s.numpy() for s in shards])
    np.testing.assert_array_equal(whole, tf.convert_to_tensor(table).numpy())
    assert whole.shape == getattr(reference, tower).get_layer(layer).embeddings.shape
    # Row 0 (the OOV row, zero-initialised) is the first shard's first row: rows are in order.
    np.testing.assert_array_equal(whole[0], 0.0)
    assert np.all(np.abs(whole[1:]).sum(axis=1) > 0)


def test_only_tables_are_sharded(sharded):
    model, _, _ = sharded
    gap = model.sampler.frequency.gap
    assert not isinstance(gap, tf.__internal__.distribute.ShardedVariable)


def test_memory_arithmetic():
    assert table_bytes(1_000_000, 64, optimizer_slots=2) == 1_000_000 * 64 * 4 * 3


def test_config():
    assert TrainConfig(distribute="parameter_server").parameter_server.max_shards == 1
    with pytest.raises(ValidationError, match="max_shards"):
        TrainConfig(parameter_server={"max_shards": 0})
    with pytest.raises(ValidationError, match="min_shard_bytes"):
        TrainConfig(parameter_server={"min_shard_bytes": -1})


@pytest.mark.parametrize("override, key", [
    ({"model": {"loss": {"kind": "full_softmax"}}}, "model.loss.kind"),
    ({"model": {"loss": {"hard_negatives": "mined", "num_hard_negatives": 2}}}, "model.loss.hard_negatives"),
])
def test_config_refuses_what_the_first_slice_cannot_run(override, key):
    with pytest.raises(ValidationError, match=key.replace(".", r"\.")):
        Config.model_validate({"data": {"synthetic": {}}, "train": {"distribute": "parameter_server"}, **override})
