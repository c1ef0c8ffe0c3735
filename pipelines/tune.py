"""Hyper-parameter search: ``python -m pipelines.tune --config F --trials N [--space S] [--study-dir D] [--set ...]``.

Optuna TPE over the config keys of a search space file (configs/tune_space.yaml), trials pruned by
the median rule on each epoch's validation recall; the same command again continues the study
(``--trials`` is the total). Writes trials.csv, best.yaml (a full config for ``make train``) and
best.json into the study folder. Details: retrieval/tuning/.

Trials are scored on a validation part, never on the test part: with a temporal, random or
leave_last_k split each trial sets split.evaluate_on=validation (the training part split again the
same way; the test part is not read); with split.kind: none on the given data.test_clicks, so pass
a validation file there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipelines.common import config_arguments, setup_logging
from retrieval.config import load_config
from retrieval.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Trials are scored on a validation part, never on the test part: with split.kind temporal, random "
        "or leave_last_k each trial sets split.evaluate_on=validation (the training part split again the same "
        "way, the test part not read); with split.kind none on the given data.test_clicks, so pass a validation "
        "file there. best.yaml keeps the base config's split.evaluate_on.",
    )
    config_arguments(parser, default_config="configs/default.yaml")
    parser.add_argument("--trials", type=int, required=True, help="finished trials wanted in the study, in total")
    parser.add_argument("--space", default="configs/tune_space.yaml", help="search space YAML (default: %(default)s)")
    parser.add_argument(
        "--study-dir", type=Path, help="study folder (default: artifacts/tune/<config name>); reused to resume"
    )
    parser.add_argument(
        "--metric", default="recall@20", help="the job's model metric to maximise (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the TPE sampler (default: %(default)s)")
    parser.add_argument("--keep-bundles", action="store_true", help="keep each trial's run directory under runs/")
    parser.add_argument(
        "--pruner-startup-trials", type=int, default=3,
        help="finished trials before any is pruned (default: %(default)s)",
    )
    parser.add_argument(
        "--pruner-warmup-epochs", type=int, default=1, help="epochs before a trial can be pruned (default: %(default)s)"
    )
    parser.add_argument(
        "--no-baseline-trial", action="store_true",
        help="do not make a new study's first trial the base config's own values",
    )
    parser.add_argument("--timeout", type=float, help="stop starting new trials after this many seconds")
    args = parser.parse_args(argv)
    base = load_config(args.config, args.overrides)
    setup_logging()

    from retrieval.tuning import TuneSettings, load_space, run_study

    space = load_space(args.space, base)
    name = Path(args.config).stem if args.config else "default"
    study_dir = args.study_dir or Path(base.run.output_dir) / "tune" / name
    settings = TuneSettings(
        metric=args.metric,
        seed=args.seed,
        keep_bundles=args.keep_bundles,
        pruner_startup_trials=args.pruner_startup_trials,
        pruner_warmup_epochs=args.pruner_warmup_epochs,
        baseline_trial=not args.no_baseline_trial,
        timeout=args.timeout,
    )
    run_study(base, space, study_dir, args.trials, settings)
    print()
    print((study_dir / "trials.csv").read_text())
    best = study_dir / "best.json"
    if best.exists():
        print(json.dumps(json.loads(best.read_text()), indent=2))
        print(f"\nbest config: {study_dir / 'best.yaml'}  (make train CONFIG={study_dir / 'best.yaml'})")
    else:
        print("no trial completed: no best config")
    return 0


if __name__ == "__main__":
    sys.exit(main())
