"""Training: click sources, one tf.function step loop, checkpoints, early stopping, embeddings.

Modules, in the order they build on each other: ``optimizers``, ``runtime``
(seeds, tf.distribute), ``interfaces`` (which interfaces a cluster's servers listen on),
``parameter_server`` (ParameterServerStrategy: sharded ID
tables, the chief's coordinator), ``sources`` (click frame or streamed shards, one
epoch at a time), ``worker_input`` (a source's batches staged for a cluster's workers
to read through the tf.data service), ``cluster`` (a worker or ps task's server),
``checkpoints``, ``loop`` (the step loop every run uses), ``early_stopping``,
``fit`` (selection + final run), ``embeddings``, ``checkpoint_directory`` (the directory the
job gives ``fit``: located, locked, checked on resume, cleaned up), ``warm_start`` (a run trained
on from a finished run's weights, its vocabularies grown by id).
"""

from retrieval.training.checkpoints import TrainingCheckpoint, TrainingState
from retrieval.training.early_stopping import ValidationData, ValidationRecall, validation_split
from retrieval.training.embeddings import embed, embed_frame
from retrieval.training.fit import fit, select_epochs, training_summary
from retrieval.training.loop import RunLogs, TrainingDiverged, train_epochs
from retrieval.training.optimizers import OPTIMIZERS, LazyAdam, RowWiseAdagrad, make_optimizer
from retrieval.training.runtime import distribution_strategy, seed_everything
from retrieval.training.sources import (
    ClickSource,
    FrameClicks,
    SequenceClicks,
    StreamedClicks,
    steps_per_epoch,
)

__all__ = [
    "OPTIMIZERS",
    "ClickSource",
    "FrameClicks",
    "LazyAdam",
    "RowWiseAdagrad",
    "RunLogs",
    "SequenceClicks",
    "StreamedClicks",
    "TrainingCheckpoint",
    "TrainingDiverged",
    "TrainingState",
    "ValidationData",
    "ValidationRecall",
    "distribution_strategy",
    "embed",
    "embed_frame",
    "fit",
    "make_optimizer",
    "seed_everything",
    "select_epochs",
    "training_summary",
    "steps_per_epoch",
    "train_epochs",
    "validation_split",
]
