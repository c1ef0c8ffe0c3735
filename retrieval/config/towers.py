"""The ``towers`` section: which raw features each tower reads and how it encodes them (ID, categorical,
numeric, timestamp and text features; the query history and its transformer; the MLP on top)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from retrieval.config.base import _Section

# --- Towers: which raw features each tower reads and how it encodes them. ---
# Every feature is preprocessed *inside* its tower (lookup, hashing,
# normalisation), so the exported SavedModels take raw values as logged.

_FEATURE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # becomes a SavedModel signature argument


class _Feature(_Section):
    # Not on every field, as _Section's is: pydantic takes no before-validator on the discriminator
    # `kind`, and no feature field is a tuple or a Literal of ints (strict mode refuses a bool elsewhere).
    @field_validator("name", "source", mode="before")
    @classmethod
    def _no_silent_conversions(cls, value: Any, info: ValidationInfo) -> Any:
        return value

    name: str = Field(pattern=_FEATURE_NAME, description="Tower input name (and serving argument).")
    source: str | None = Field(
        None,
        description="Column it is read from: the user (query) or item (doc) feature table, or the click "
        "log (user_id, item_id, timestamp). None = the name.",
    )

    @property
    def column(self) -> str:
        return self.source or self.name


class _EmbeddedFeature(_Feature):
    embedding_dim: int | None = Field(None, gt=0, description="None = model.embedding_dim.")


class _VocabularyFeature(_EmbeddedFeature):
    hash_buckets: int | None = Field(
        None, gt=0, description="Hash values into this many rows; None = vocabulary of training values."
    )
    oov_buckets: int = Field(1, gt=0, description="Rows shared by values outside the vocabulary.")
    min_count: int = Field(1, gt=0, description="Training examples a value needs to enter the vocabulary.")


class IdFeature(_EmbeddedFeature):
    """An id (user_id, item_id): training vocabulary, one zero-initialised OOV row."""

    kind: Literal["id"]
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Training only: replace the id by the OOV row with this probability, so the tower "
        "learns to embed unseen ids from its other features (DropoutNet, Volkovs et al., NeurIPS 2017).",
    )


class CategoricalFeature(_VocabularyFeature):
    """One string value per row (gender, occupation, zip prefix)."""

    kind: Literal["categorical"]
    prefix: int | None = Field(None, gt=0, description="Keep only the first n characters (zip -> region).")


class MultiCategoricalFeature(_VocabularyFeature):
    """Several string values per row (genres), mean-pooled; served as [batch, max_values] padded with ''."""

    kind: Literal["multi_categorical"]
    max_values: int = Field(8, gt=0, description="Values kept per row (serving shape [batch, max_values]).")
    separator: str | None = Field(
        None, min_length=1, description="Split string cells on this; None = cells are lists."
    )


class NumericFeature(_Feature):
    """A number, z-normalised with training mean/variance; NaN -> 0 plus an is-missing indicator."""

    kind: Literal["numeric"]
    log: bool = Field(False, description="Normalise log1p(max(x, 0)) instead of x (prices, counts).")


class TimestampFeature(_Feature):
    """A point in time, encoded as its age at the end of training (days and log-days, normalised)."""

    kind: Literal["timestamp"]
    unit: Literal["seconds", "days", "years"] = Field(
        "seconds", description="Raw value: seconds or days since the epoch, or a calendar year (1995)."
    )


class TextConfig(_Section):
    """Hashed bag of tokens; letter trigrams are DSSM word hashing (Huang et al., CIKM 2013)."""

    trigrams: bool = Field(True, description="Letter trigrams of each '#word#'.")
    words: bool = Field(True, description="Each whole word, as the token '#word#'.")
    buckets: int = Field(50_000, gt=0, description="Hash buckets (embedding rows) shared by all tokens.")

    @model_validator(mode="after")
    def _some_tokens(self) -> TextConfig:
        if not (self.trigrams or self.words):
            raise ValueError("text needs trigrams or words (or both)")
        return self


class TextFeature(_EmbeddedFeature):
    """Free text (titles, queries): lower-cased, split on non-alphanumerics, hashed, mean-pooled."""

    kind: Literal["text"]
    text: TextConfig = TextConfig()


FeatureConfig = Annotated[
    IdFeature | CategoricalFeature | MultiCategoricalFeature | NumericFeature | TimestampFeature | TextFeature,
    Field(discriminator="kind"),
]


class TransformerConfig(_Section):
    """The causal self-attention encoder of ``history.pooling: transformer`` (SASRec, Kang & McAuley 2018)."""

    blocks: int = Field(2, gt=0, description="Self-attention blocks (attention then a feed-forward layer each).")
    heads: int = Field(1, gt=0, description="Attention heads; the item dimension must divide by it.")
    dropout: float = Field(
        0.2, ge=0, lt=1, description="On the embedded inputs and after each sub-layer, training only."
    )
    layout: Literal["pre_norm", "sasrec"] = Field(
        "pre_norm",
        description="pre_norm: x + dropout(sublayer(norm(x))) for attention and the feed-forward layer; "
        "sasrec: the SASRec reference code's block (the item embeddings scaled by sqrt(dim), each residual "
        "taken from the normalised input, dropout on the attention weights and inside the feed-forward "
        "layer only, layer-norm epsilon 1e-8, positions counted from the window's oldest item, the reference's "
        "initialisation: normal(0, 0.02) positions and feed-forward / attention-output kernels, Xavier-uniform "
        "query / key / value kernels). pre_norm counts positions from the window's start (the newest item at "
        "the last one). Both: dropout on the embedded inputs, a final layer norm.",
    )


class HistoryConfig(_Section):
    """The user's last clicked items, strictly before each example (YouTube DNN, Covington et al. 2016);
    on a log without time (format: user-items), the user's other training items, the example's own item
    left out (SimpleX's pooled history, Mao et al. 2021), which mean / attention pooling read."""

    name: str = Field("history", pattern=_FEATURE_NAME, description="Input name; served as [batch, length].")
    length: int = Field(20, gt=0, description="Most recent clicks kept (most recent first, '' padded).")
    pooling: Literal["mean", "attention", "transformer"] = Field(
        "mean",
        description="mean; attention: learned scores plus a learned bias per position; transformer: causal "
        "self-attention over the items in time order with learned positions, the newest item's state "
        "(section `transformer`).",
    )
    transformer: TransformerConfig = Field(TransformerConfig(), description="Encoder of pooling: transformer.")
    share_item_embedding: bool = Field(
        True, description="Use the doc tower's item-id embedding (needs an id feature on item_id there)."
    )
    embedding_dim: int | None = Field(None, gt=0, description="Own table only; None = model.embedding_dim.")


class MLPConfig(_Section):
    """Layers from the concatenated feature encodings to the output (always a final linear projection)."""

    widths: tuple[int, ...] = Field((), description="Hidden widths; () = projection only.")
    activation: Literal["relu", "gelu", "tanh", "swish"] = Field("relu", description="Activation of the hidden layers.")
    dropout: float = Field(0.0, ge=0, lt=1, description="After each hidden layer, training only.")
    projection: bool = Field(
        True,
        description="End in a linear projection to model.embedding_dim. false: the output is the encoding "
        "itself (no hidden widths; one encoding of model.embedding_dim), as SASRec scores its encoder's "
        "state against the item table it reads (doc tower: the item-id embedding, unprojected).",
    )

    @model_validator(mode="after")
    def _positive_widths(self) -> MLPConfig:
        if any(width <= 0 for width in self.widths):
            raise ValueError(f"mlp.widths must be positive, got {list(self.widths)}")
        if not self.projection and self.widths:
            raise ValueError(
                f"mlp.projection=false outputs the encoding itself, so it takes no hidden layers: got "
                f"mlp.widths={list(self.widths)}; set mlp.widths=[] or mlp.projection=true"
            )
        return self


class TowerConfig(_Section):
    """One tower: its features, optional click history (query only) and MLP."""

    features: tuple[FeatureConfig, ...] = Field((), description="The tower's input features (see the feature kinds).")
    history: HistoryConfig | None = Field(None, description="Pooled click history (query tower only); None = none.")
    mlp: MLPConfig = MLPConfig()

    @model_validator(mode="after")
    def _has_inputs(self) -> TowerConfig:
        if not self.features and self.history is None:
            raise ValueError("a tower needs at least one feature or a history")
        return self

    @property
    def input_names(self) -> list[str]:
        return [f.name for f in self.features] + ([self.history.name] if self.history else [])


class TowersConfig(_Section):
    """Both towers. The default is ID-only (user_id | item_id), the original two-tower model."""

    query: TowerConfig = TowerConfig(features=(IdFeature(name="user_id", kind="id"),))
    doc: TowerConfig = TowerConfig(features=(IdFeature(name="item_id", kind="id"),))

    @model_validator(mode="after")
    def _consistent(self) -> TowersConfig:
        if self.doc.history is not None:
            raise ValueError("towers.doc.history: click history is a query-tower feature")
        names = self.query.input_names + self.doc.input_names
        if "weight" in names or "item_id" in self.query.input_names:
            raise ValueError("towers: 'weight' (and 'item_id' in the query tower) are reserved batch keys")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"towers: input names must be unique across both towers, repeated: {repeated}")
        history = self.query.history
        if history is not None and history.share_item_embedding and self.item_id_feature is None:
            raise ValueError(
                "towers.query.history.share_item_embedding needs an id feature with source item_id in "
                "towers.doc.features (or set share_item_embedding: false)"
            )
        return self

    @property
    def item_id_feature(self) -> IdFeature | None:
        """The doc tower's item-id feature, if it has one."""
        return next((f for f in self.doc.features if f.kind == "id" and f.column == "item_id"), None)

    @property
    def is_id_only(self) -> bool:
        """True for the default towers (built by ``retrieval.towers.id_tower``)."""
        return self == TowersConfig()
