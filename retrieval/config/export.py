"""The ``export`` section: what the bundle holds besides the SavedModels and the FAISS index."""

from __future__ import annotations

from pydantic import Field

from retrieval.config.base import _Section


class ExportConfig(_Section):
    """What the bundle holds besides the query/doc SavedModels and the FAISS index."""

    topk_model: bool = Field(
        True,
        description="Also write the topk model (models/topk/<version>/): a SavedModel holding the query "
        "tower and every item embedding that returns top-k ids itself, leaving out the ids it is asked "
        "to exclude (brute force; num_items x dim floats, so large catalogues may want it off).",
    )
    topk_k: int = Field(100, gt=0, description="How many ids the topk model returns per query.")
    history_clicks: int = Field(
        200,
        gt=0,
        description="With a query tower that reads a click history: each training user's most recent "
        "training clicks the bundle stores (user_histories/, newest first; 4 bytes a click), from which "
        "serving fills the history of a query that sends only the user id. At least "
        "towers.query.history.length (the tower reads that many); more lets a page list them.",
    )
    warm_start_state: bool = Field(
        True,
        description="Write <run>/warm_start/ (every variable, the optimizer's slots, the vocabularies and counts: "
        "about the model's size plus its slots, x3 the tables with lazy_adam), from which a later run can "
        "train on (train.warm_start). false saves the disk and the write; the run then cannot be a parent.",
    )
