"""Hyper-parameter search: ``python -m pipelines.tune --config F --trials N [--space S] [--study-dir D] [--set ...]``.

``retrieval tune`` (``retrieval/cli.py``) with ``--config`` and ``--space`` defaulting to
``configs/default.yaml`` and ``configs/tune_space.yaml`` in the working directory. Optuna TPE over
the config keys of the search space, trials pruned by the median rule on each epoch's validation
recall; the same command again continues the study (``--trials`` is the total). Writes trials.csv,
best.yaml (a full config for ``make train``) and best.json into the study folder. Details:
retrieval/tuning/.

Trials are scored on a validation part, never on the test part: with a temporal, random or
leave_last_k split each trial sets split.evaluate_on=validation (the training part split again the
same way; the test part is not read); with split.kind: none on the given data.test_clicks, so pass
a validation file there.
"""

from __future__ import annotations

import sys

from retrieval.cli import run_command
from retrieval.common.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    return run_command("tune", argv, prog="pipelines.tune",
                       default_config="configs/default.yaml", default_space="configs/tune_space.yaml")


if __name__ == "__main__":
    sys.exit(main())
