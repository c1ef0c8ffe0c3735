"""``model.remove_user_items``: no training item of a click's user is among that click's negatives.

The loss of a batch of clicks against the in-batch softmax computed in numpy with those columns
removed (``tests/reference_losses.py``), and the config's refusals.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from reference_losses import numpy_in_batch_loss

import retrieval  # noqa: F401
from retrieval.config import ConfigError, LossConfig, ModelConfig, load_config
from retrieval.features import FeatureStatistics
from retrieval.model import build_model


def _clicks(seed: int = 0, users: int = 6, items: int = 12, clicks: int = 60) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"user_id": [f"u{u}" for u in rng.integers(users, size=clicks)],
                          "item_id": [f"i{i}" for i in rng.integers(items, size=clicks)],
                          "timestamp": np.arange(clicks)})
    frame["weight"] = np.float32(1.0)
    return frame


def _model(clicks: pd.DataFrame, **settings):
    stats = FeatureStatistics.from_training_clicks(clicks)
    tf.keras.utils.set_random_seed(0)
    config = ModelConfig(**{"embedding_dim": 8, "temperature": 0.2, "loss": LossConfig(log_q_source="static"),
                            **settings})
    return build_model(config, stats, train_clicks=clicks)


@pytest.mark.parametrize("unknown_user", [False, True])
def test_the_loss_masks_every_training_item_of_the_rows_user(unknown_user):
    clicks = _clicks()
    model = _model(clicks, remove_user_items=True)
    batch = clicks.sample(16, random_state=1).reset_index(drop=True)
    if unknown_user:
        batch.loc[0, "user_id"] = "a user training never saw"  # removes its accidental hits only
    features = {"user_id": tf.constant(batch["user_id"]), "item_id": tf.constant(batch["item_id"])}
    loss = float(model.compute_loss(features, training=False))
    owned = clicks.groupby("user_id")["item_id"].agg(set)
    removed = np.array([[item in owned.get(user, set()) for item in batch["item_id"]] for user in batch["user_id"]])
    q = model.query_tower({"user_id": features["user_id"]}).numpy()
    d = model.doc_tower({"item_id": features["item_id"]}).numpy()
    log_prob = np.log(clicks["item_id"].value_counts().reindex(batch["item_id"]).to_numpy() / len(clicks))
    ids = pd.factorize(batch["item_id"])[0]
    expected = numpy_in_batch_loss(q, d, log_prob, ids, 0.2, removed=removed)
    plain = numpy_in_batch_loss(q, d, log_prob, ids, 0.2)
    assert (removed & (ids[:, None] != ids[None, :])).any()  # the user's items remove more than accidental hits
    assert loss == pytest.approx(expected, rel=1e-5) and abs(expected - plain) > 1e-3
    assert float(_model(clicks).compute_loss(features, training=False)) == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.remove_user_items=true", "model.remove_accidental_hits=false"],
     "model.remove_user_items masks more than model.remove_accidental_hits"),
    (["model.remove_user_items=true", "train.examples=sequences", "towers.query.features=[]",
      "towers.query.history={length: 5, pooling: transformer}", "split.kind=leave_last_k", "split.k=1"],
     "with train.examples: sequences use model.remove_sequence_items"),
    (["model.remove_user_items=true", "train.distribute=parameter_server"],
     "parameter_server: model.remove_user_items"),
])
def test_the_config_says_where_user_items_cannot_be_removed(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
