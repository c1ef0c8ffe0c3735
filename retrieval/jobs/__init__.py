"""The jobs: the main one and those on an exported bundle.

``train``: the main job, data -> train -> index -> evaluate -> export in one run directory, one
code path for both click sources (``train_evaluate_export``). ``reevaluate_reindex``: re-evaluate an
exported bundle on the data its config names, with the main job's own phases
(``evaluate_bundle``), or rebuild its index (``reindex_bundle``).

The names the Python API, the command line, tuning and the benchmarks use are re-exported here
(``from retrieval.jobs import train_evaluate_export``); a test that patches a name the job looks
up patches it in ``retrieval.jobs.train``.
"""

from retrieval.jobs.reevaluate_reindex import evaluate_bundle, reindex_bundle
from retrieval.jobs.train import (
    EvaluatedClicks,
    JobData,
    RunResult,
    TowerContext,
    TowerFactory,
    build_job_model,
    evaluate,
    evaluation_clicks,
    read_and_split,
    train_evaluate_export,
)

__all__ = [
    "EvaluatedClicks",
    "JobData",
    "RunResult",
    "TowerContext",
    "TowerFactory",
    "build_job_model",
    "evaluate",
    "evaluate_bundle",
    "evaluation_clicks",
    "read_and_split",
    "reindex_bundle",
    "train_evaluate_export",
]
