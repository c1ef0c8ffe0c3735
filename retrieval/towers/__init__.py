"""Towers: Keras models from a dict of raw features to an embedding.

A tower owns all of its preprocessing (lookups, hashing, normalisation), so an
exported tower takes raw values exactly as the log has them.

- ``id_tower``: the ID-only tower (the default two-tower model);
- ``feature_tower`` / ``build_towers``: DSSM / YouTube-DNN style feature towers
  from ``Config.towers``;
- ``ensemble_towers`` / ``build_ensemble_towers``: K independently trained members served as
  one pair (``model.ensemble_members``);
- ``layers``: the preprocessing and pooling layers they are made of.
"""

from retrieval.towers.ensemble import build_ensemble_towers, ensemble_towers, member_embeddings
from retrieval.towers.feature import PositionStates, build_towers, feature_tower, position_states
from retrieval.towers.id import IdEmbedding, IdLookup, id_lookups, id_tower
from retrieval.towers.layers import (
    AttentionPooling,
    HashedText,
    IdDropout,
    MaskedMean,
    NormalizedNumber,
    NotPadding,
    Prefix,
    SplitPad,
    TimestampAge,
    text_tokens,
)

__all__ = [
    "PositionStates",
    "AttentionPooling",
    "HashedText",
    "IdDropout",
    "IdLookup",
    "IdEmbedding",
    "MaskedMean",
    "NormalizedNumber",
    "NotPadding",
    "Prefix",
    "SplitPad",
    "TimestampAge",
    "build_ensemble_towers",
    "build_towers",
    "ensemble_towers",
    "feature_tower",
    "member_embeddings",
    "position_states",
    "id_lookups",
    "id_tower",
    "text_tokens",
]
