"""The ``train`` section: epochs, batches, optimizer, checkpoints, warm starts, the distribution
strategy, and how ``train.parameter_server`` shards the ID tables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from retrieval.config.base import Seed, _Section


class ParameterServerConfig(_Section):
    """How ``train.distribute: parameter_server`` shards the ID tables over the ``ps`` tasks of TF_CONFIG."""

    min_shard_bytes: int = Field(
        256 << 10, gt=0,
        description="Smallest shard of an ID table in bytes (MinSizePartitioner): a table of rows x dim x 4 "
        "bytes gets at most that size / min_shard_bytes shards.",
    )
    max_shards: int = Field(
        1, ge=1, description="Most shards of one ID table (at most the number of ps tasks is useful).",
    )
    input: Literal["chief", "workers"] = Field(
        "chief",
        description="Who reads the training batches. chief: the chief reads each batch and sends it with the "
        "step it schedules (one data path for every log; the chief's reading bounds the throughput). workers: "
        "the chief writes the training batches once as TFRecord files (staging_dir) and each worker reads "
        "them itself through the tf.data service (the chief runs its dispatcher on data_dispatcher_port; each "
        "worker task is started with --data-dispatcher CHIEF_HOST:PORT, as pipelines.local_cluster does); an "
        "epoch is then a number of steps of that stream, and a resumed run starts a new pass over it.",
    )
    data_dispatcher_port: int = Field(
        0, ge=0, le=65535,
        description="Port of the tf.data service dispatcher the chief runs under input: workers (required "
        "there; pipelines.local_cluster sets it).",
    )
    staging_dir: str = Field(
        "",
        description="Where the chief writes the staged batches under input: workers, in a directory of its own "
        "deleted after training; every worker must read it (on several hosts, a shared filesystem). Empty: "
        "the chief's temporary directory (one machine only).",
    )
    staged_files: int = Field(
        16, ge=1,
        description="TFRecord files the staged batches are spread over under input: workers: the tf.data "
        "service hands each file to one worker at a time, so at least a few per worker.",
    )

    @model_validator(mode="after")
    def _workers_need_the_dispatcher(self) -> ParameterServerConfig:
        if self.input == "workers" and self.data_dispatcher_port == 0:
            raise ValueError(
                "data_dispatcher_port: input: workers needs the port of the tf.data dispatcher the chief runs "
                "and the workers register with (python -m pipelines.local_cluster sets it)"
            )
        return self


# Steps a call on one device unless train.steps_per_execution says otherwise: a Gowalla epoch of the
# default model (dimension 64, batch 1,024, the log held in memory) took 6.75 s at 16 steps a call against
# 10.29 s at one, a tf.data batch and a Python dispatch a step (`python -m benchmarks.bench_steps --part
# epoch`, benchmarks/results/bench_steps_epoch.md, 2026-12-08).
STEPS_PER_CALL_ON_ONE_DEVICE = 16


class TrainConfig(_Section):
    """Optimisation."""

    epochs: int = Field(
        30, gt=0, description="Training epochs; with validation_fraction > 0 the most early stopping may run."
    )
    batch_size: int = Field(
        1024, gt=1, description="Global batch; in-batch softmax gives each query this many candidates."
    )
    optimizer: Literal["adam", "adagrad", "sgd", "lazy_adam", "rowwise_adagrad"] = Field(
        "lazy_adam",
        description="adam (and tf-keras sgd, whose momentum slot is always updated densely) touch every "
        "embedding row at every step, slow for large tables; lazy_adam, adagrad and rowwise_adagrad update "
        "only the rows a batch touches. Optimizer state per embedding table: adam and lazy_adam 2x the "
        "table, adagrad 1x, rowwise_adagrad one float per row (for tables of millions of rows).",
    )
    learning_rate: float = Field(0.01, gt=0, description="Optimiser learning rate.")
    adam_epsilon: float = Field(
        1e-7,
        gt=0,
        description="adam and lazy_adam: the epsilon added to the root of the second moment (tf-keras' "
        "default 1e-7; PyTorch's 1e-8). tf-keras adds it before the bias correction, PyTorch after: the same "
        "once 1 - beta_2^step is near 1 (after a few thousand steps at beta_2 0.999).",
    )
    use_weights: bool = Field(
        False, description="Use the log's weight column as per-example loss weights."
    )
    seed: Seed = Field(42, description="Seeds weights init, batch order and TensorFlow ops (deterministic).")
    verbose: Literal["auto", 0, 1, 2] = Field(
        "auto", description="Keras progress: bar on a terminal, a line per epoch otherwise."
    )
    validation_fraction: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Early stopping: hold out this share of the training part, carved like split.kind "
        "(temporal: the latest clicks), and stop when its recall@validation_k has not improved for "
        "early_stopping_patience epochs; `epochs` is then the maximum. 0 = train `epochs` epochs.",
    )
    validation_part: Literal["carved", "test"] = Field(
        "carved",
        description="What early stopping watches: carved, a part of the training clicks (validation_fraction, "
        "carved like the test part), the honest choice; test, the test clicks themselves (the protocol of the "
        "published records on the LightGCN splits, whose valid file is scored and selected on at once: the "
        "figures are then optimistic, not held-out estimates; every training click is trained on). test needs "
        "validation_fraction > 0 (early stopping on) and refit: false (nothing was held out to refit on).",
    )
    examples: Literal["clicks", "sequences"] = Field(
        "clicks",
        description="clicks: one training example per click, its query the user's history before it; "
        "sequences: windows of each user's training clicks in time order (sequence_windows), the query state at "
        "every position predicting the next item, all in one pass of a transformer history (needs a query tower "
        "of that history alone).",
    )
    sequence_windows: Literal["all", "latest"] = Field(
        "all",
        description="train.examples: sequences only. all: each user's training clicks cut into windows of "
        "towers.query.history.length + 1, so every click but a user's first is a next-item target once; "
        "latest: only each user's last window (SASRec's truncation: older clicks are never targets).",
    )
    validation_users: int | None = Field(
        10_000,
        gt=0,
        description="Early stopping watches the validation clicks of at most this many users, drawn with "
        "data.stream.seed (each epoch ranks them over the catalogue; a streamed log takes at most "
        "data.stream.max_test_users too); None = every validation user of a log in memory, "
        "data.stream.max_test_users of a streamed one. 10,000: on Gowalla (29,858 validation users) it chose the "
        "epoch that all of them chose, the same model in 904 s instead of 1,060; 5,000 chose an earlier one, "
        "recall@20 0.2173 against 0.2192 (benchmarks/results/bench_public_selection/).",
    )
    early_stopping_patience: int = Field(2, gt=0, description="Epochs without a better validation metric.")
    validation_k: int = Field(20, gt=0, description="k of the validation metric early stopping watches.")
    validation_metric: Literal["recall", "ndcg"] = Field(
        "recall",
        description="What early stopping watches and keeps the best epoch of: recall@validation_k over the "
        "validation clicks, or NDCG@validation_k (1 / log2(1 + rank) of each click within the top k, their "
        "mean; SASRec+'s reference watches NDCG@10). Both are logged every epoch.",
    )
    refit: bool = Field(
        True,
        description="After early stopping, train again on the whole training part (the held-out latest "
        "clicks matter on a temporal split), from where refit_from says; false keeps the best weights of "
        "the run on the reduced part.",
    )
    refit_from: Literal["initial", "best"] = Field(
        "initial",
        description="Where a refit starts: the initial weights, retrained for the best number of epochs; or "
        "the best epoch's weights, trained refit_epochs more epochs on the whole training part (the held-out "
        "part included), which costs refit_epochs instead of the best number.",
    )
    refit_epochs: int = Field(1, gt=0, description="Epochs of a refit from the best weights (refit_from: best).")
    checkpoint_every_seconds: float | None = Field(
        300.0,
        ge=0,
        description="Save the training state (weights, optimizer slots, sampler / log-Q estimator state and "
        "RNG, data position, logs) once this many seconds of training passed since the last save, and at "
        "the end of training, so a run killed mid-epoch resumes where it stopped when started again with "
        "the same run.name and config. By time, not steps: a save costs a pass over the ID tables and a "
        "step does not, so only a time interval bounds the share of training spent saving. "
        "None or 0 (and no checkpoint_every_steps) = no checkpoints.",
    )
    checkpoint_every_steps: int | None = Field(
        None,
        ge=0,
        description="Also save every this many steps (None or 0 = by time only).",
    )
    checkpoint_dir: str | None = Field(
        None,
        description="The checkpoints go to `<checkpoint_dir>/.<run.name>.checkpoints`; None = run.output_dir. "
        "They outlive a killed run and are deleted once the run directory is complete.",
    )
    resume: bool = Field(
        True,
        description="Resume from the checkpoints of an unfinished run of the same run.name (the config must "
        "be the same); false deletes them and starts over.",
    )
    distribute: Literal["none", "mirrored", "multi_worker", "parameter_server"] = Field(
        "none",
        description="tf.distribute strategy: none (one device), mirrored (MirroredStrategy over every local "
        "GPU, or the CPU), multi_worker (MultiWorkerMirroredStrategy; the cluster comes from the TF_CONFIG "
        "environment variable). batch_size is the global batch, split over the replicas, and in-batch "
        "negatives are gathered across replicas, so every query still sees batch_size candidates. "
        "parameter_server: ParameterServerStrategy over the TF_CONFIG cluster (one chief running the job, "
        "worker and ps tasks running python -m retrieval.training.cluster; python -m pipelines.local_cluster "
        "starts one on this machine): the ID tables sharded by rows over the ps tasks, each batch read by the "
        "chief and its step run on a worker, asynchronously (a step's in-batch negatives are its own batch).",
    )
    parameter_server: ParameterServerConfig = Field(
        default_factory=ParameterServerConfig,
        description="Sharding of the ID tables under distribute: parameter_server.",
    )
    steps_per_execution: int | None = Field(
        None,
        gt=0,
        description="Training steps run inside one tf.function call (a graph loop over the batches), so "
        "Python dispatches once per this many steps; a log held in memory is then cut into batches inside "
        "the loop, with no tf.data pipeline. The steps, their order and their logged values are "
        "those of one step a call; a call ends early at the epoch's end and at a step that "
        "checkpoint_every_steps names, and a save by time waits for the call's end. One device only "
        f"(distribute: none). None: {STEPS_PER_CALL_ON_ONE_DEVICE} with distribute: none, else 1.",
    )

    warm_start: str | None = Field(
        None,
        description="A finished run (its run directory, which is its bundle) to train on from: the towers start "
        "from its trained weights, the id and categorical vocabularies grow to the parent's ids plus the new "
        "log's (known ids keep their trained rows; new ids get the model's fresh initialisation), the streaming "
        "log-Q estimate continues and a static one counts the parent's clicks plus the new ones, the bundle's "
        "seen items are the parent's plus the new clicks and its index holds the parent's catalogue plus the new "
        "items; the manifest records the parent. The parent must have the same tower shape and loss (the model "
        "and towers keys warm_start_conflicts lists). None = train from scratch. `retrieval train --warm-start`.",
    )
    warm_start_optimizer: Literal["carry", "reset"] = Field(
        "carry",
        description="train.warm_start: carry the parent's optimizer state (moments / accumulators, rows "
        "remapped by id like the weights, new rows at zero; needs the same train.optimizer) or reset it "
        "(a new optimizer, whose first steps are as large as from scratch). carry: recall@20 0.481 against "
        "reset's 0.468 on a small time-split case, mean of 3 seeds (benchmarks/results/bench_warm_start.json).",
    )
    replay_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="train.warm_start: mix a sample of the parent's training clicks (its bundle's seen "
        "items, one (user, item) pair per click kept there) into the new training clicks, this share of "
        "the training clicks after mixing, drawn with train.seed; 0 = the new clicks only.",
    )

    @model_validator(mode="after")
    def _warm_start_settings_need_a_parent(self) -> TrainConfig:
        if self.warm_start is None and self.replay_fraction > 0:
            raise ValueError(
                f"train.replay_fraction={self.replay_fraction} replays a parent's clicks; it needs train.warm_start"
            )
        if self.warm_start is not None and self.distribute == "parameter_server":
            raise ValueError(
                "train.warm_start is not yet supported with train.distribute: parameter_server "
                "(its tables are sharded over the ps tasks)"
            )
        return self

    @model_validator(mode="after")
    def _test_validation_part_has_nothing_to_refit(self) -> TrainConfig:
        if self.validation_part == "test" and (self.validation_fraction == 0 or self.refit):
            raise ValueError(
                "train.validation_part='test' selects the epoch on the test clicks and trains on every training "
                f"click: it needs train.validation_fraction > 0 (early stopping on; now {self.validation_fraction}) "
                f"and train.refit=false (now {self.refit})"
            )
        return self

    @model_validator(mode="after")
    def _steps_per_execution_on_one_device(self) -> TrainConfig:
        if self.steps_per_execution is not None and self.steps_per_execution > 1 and self.distribute != "none":
            raise ValueError(
                f"train.steps_per_execution={self.steps_per_execution} runs several steps in one call on one "
                f"device; train.distribute={self.distribute!r} runs one step a call: set "
                "train.steps_per_execution=1 (or leave it unset) or train.distribute=none"
            )
        return self

    @property
    def steps_per_call(self) -> int:
        """The training steps a call runs: ``steps_per_execution``, or where it is None
        ``STEPS_PER_CALL_ON_ONE_DEVICE`` on one device and 1 under a strategy."""
        if self.steps_per_execution is not None:
            return self.steps_per_execution
        return STEPS_PER_CALL_ON_ONE_DEVICE if self.distribute == "none" else 1

    @property
    def checkpoints(self) -> bool:
        """Whether training is checkpointed (by time, by steps or both)."""
        return bool(self.checkpoint_every_seconds) or bool(self.checkpoint_every_steps)
