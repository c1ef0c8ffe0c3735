"""The ``retrieval`` command (``[project.scripts]`` in pyproject.toml): every entry point in one.

    retrieval train [--config F] [--set k=v ...] [--warm-start RUN]  train, evaluate, export (make train)
    retrieval evaluate --run artifacts/<run> [--out D]  re-evaluate an exported bundle
    retrieval export --run artifacts/<run> --out D --set index.factory=HNSW32   re-index a bundle
    retrieval tune --trials N [--config F] [--space S]  hyper-parameter search (make tune)
    retrieval recommend --bundle artifacts/<run> --user-id 196 [-k 10]   top-k from a shell
    retrieval recommend --bundle artifacts/<run> --users users.txt|all --k 100 --out recs.parquet [--overwrite]
    retrieval recommend --bundle artifacts/<run> --similar items.txt|all -k 10 --out similar.parquet
    retrieval catalogue add|remove|update --bundle artifacts/<run> --items items.jsonl [--out D]   edit items
    retrieval serve --bundle artifacts/<run> [--host 127.0.0.1] [--port 8000] [--admin-token T | --no-admin]
    retrieval reload --bundle artifacts/<new run> [--port 8000] [--host H | --url U] [--token T]

Each subcommand takes exactly the flags of the module entry point it stands for, from the same
parser: ``python -m pipelines.train|evaluate|export|tune`` are ``run_command`` here with their
historical defaults, ``python -m retrieval.serving`` is ``recommend`` (its parser lives in
``retrieval/serving/bundle.py``). Without ``--config``, ``retrieval train`` and ``retrieval tune`` use the
code's defaults, which are the project's recipe (``configs/default.yaml`` restates them), so they
work from any directory; ``python -m pipelines.train`` still reads ``configs/default.yaml`` from the
working directory. Relative paths (in a config, ``run.output_dir``, ``--run``) are relative to the
working directory, as always.

``serve`` runs the HTTP service of ``retrieval/serving/http/`` under uvicorn;
``reload`` asks a running service to swap to another bundle without
dropping requests (``POST /admin/reload``). Both read the admin token from
``RETRIEVAL_ADMIN_TOKEN`` when the flag is not given (a flag shows in ``ps``).
``serve`` takes one flag per ``ServiceLimits`` field (``--max-body-bytes``,
``--request-read-timeout``, ...; ``retrieval serve --help`` lists them with
their defaults).

Every ``main`` runs through ``entry_point`` (``retrieval.common.errors``): a user error (config, data,
bundle, paths, disk; a bundle ``serve`` cannot load, a non-loopback ``--host`` with admin on and no
token, a service ``reload`` cannot reach or that refuses the bundle) is one line
``error: <message>`` on stderr and exit status 2, Ctrl-C ``error: interrupted`` and 130;
``RETRIEVAL_DEBUG=1`` shows the traceback. A bad command line is argparse's usage error, status 2.
Only the chosen subcommand's parser is built, and each imports TensorFlow only when it runs:
``retrieval --help``, ``retrieval reload`` and every ``--help`` start fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from retrieval.common.errors import UserError, debugging, entry_point

# retrieval.serving.http loads TensorFlow only when a bundle is loaded: `retrieval reload` and --help start fast.
from retrieval.serving.http import ADMIN_TOKEN_ENV, ServiceLimits

# The project's own search space, beside the package in a source checkout (pip install -e .).
PROJECT_TUNE_SPACE = Path(__file__).resolve().parents[1] / "configs" / "tune_space.yaml"


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its line in ``retrieval --help``, its parser (``prog`` -> parser; some take
    defaults as keywords) and what runs on the parsed arguments (-> exit status)."""

    summary: str
    parser: Callable[..., argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int]


@entry_point
def main(argv: Sequence[str] | None = None) -> int:
    """``retrieval <command> [flags]``: the chosen command's parser reads the flags after the name."""
    overview = argparse.ArgumentParser(
        prog="retrieval",
        description="Two-tower retrieval: train, evaluate, export, tune, and serve a bundle. "
        "`retrieval <command> --help` lists a command's flags.",
        formatter_class=_OverviewFormatter,
    )
    names = overview.add_subparsers(dest="command", required=True, metavar="<command>")
    for name, command in COMMANDS.items():
        # The flags are left to the command's own parser: add_help=False passes -h on to it too.
        names.add_parser(name, help=command.summary, add_help=False)
    chosen, rest = overview.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    return run_command(chosen.command, rest, prog=f"retrieval {chosen.command}")


class _OverviewFormatter(argparse.HelpFormatter):
    """Each command and its summary on one line (80 columns): argparse would put the summary of
    ``recommend``, the longest name, on a line of its own (its column follows ``-h, --help``)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=15)
        self._action_max_length = 13  # "    recommend": the summaries start in column 15


def run_command(name: str, argv: Sequence[str] | None, prog: str | None = None, **defaults: Any) -> int:
    """Parse ``argv`` with command ``name``'s parser (``defaults``: e.g. ``default_config``) and run it."""
    command = COMMANDS[name]
    return command.run(command.parser(prog, **defaults).parse_args(argv))


def config_arguments(parser: argparse.ArgumentParser, *, default_config: str | None) -> None:
    """``--config`` (default: ``default_config``; None = the code's defaults) and repeatable ``--set``."""
    shown = "%(default)s" if default_config else "the code's defaults, the project's recipe"
    parser.add_argument("--config", default=default_config, help=f"YAML config file (default: {shown})")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.epochs=3 (repeatable; values are YAML)",
    )


def setup_logging() -> None:
    """The project's INFO progress lines on stderr; the libraries' own INFO lines only with RETRIEVAL_DEBUG=1.

    (TensorFlow's native start-up lines are filtered when it is imported: ``retrieval.common.native_logs``.)
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if debugging():
        return
    # faiss's loader says at INFO, over two lines ending in a ModuleNotFoundError, that it fell back
    # from its AVX2 build: not a problem, but it reads like one beside a real error line.
    # TensorFlow's Python side says at INFO where each SavedModel's assets went ("tensorflow") and which
    # signature inputs it renamed ("absl"): nothing for a user to do. Their warnings still show.
    for name in ("faiss.loader", "tensorflow", "absl"):
        logging.getLogger(name).setLevel(logging.WARNING)


def check_inputs_before_tensorflow(config: Any) -> None:
    """The data files' headers against the config (``retrieval.features.inputs``): a missing file or
    column stops the command in a second or two, before TensorFlow's start-up."""
    from retrieval.features.inputs import check_inputs

    check_inputs(config)


def _config_name(path: str | None) -> str:
    """The name a run or study takes from its config file; ``default`` for the code's defaults."""
    return Path(path).stem if path else "default"


# --- train ---------------------------------------------------------------------------------------


def train_parser(prog: str | None = None, *, default_config: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train, evaluate and export: the whole job into <run.output_dir>/<run>, a complete bundle.",
    )
    config_arguments(parser, default_config=default_config)
    parser.add_argument(
        "--warm-start", metavar="RUN",
        help="train on from a finished run directory's weights: the config key train.warm_start",
    )
    return parser


def _train(args: argparse.Namespace) -> int:
    from retrieval.config import load_config

    warm = [] if args.warm_start is None else [f"train.warm_start={json.dumps(args.warm_start)}"]
    config = load_config(args.config, [*args.overrides, *warm])
    setup_logging()
    check_inputs_before_tensorflow(config)

    from retrieval.evaluation import format_table
    from retrieval.jobs import train_evaluate_export

    result = train_evaluate_export(config, config_name=_config_name(args.config))
    print()
    print(format_table(result.metrics))
    print(json.dumps({"counts": result.metrics["counts"]}))
    print(f"\nrun directory: {result.directory}  ({result.seconds:.0f} s)")
    return 0


# --- evaluate ------------------------------------------------------------------------------------


def evaluate_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="""Re-evaluate an exported bundle: --run artifacts/<run>.

Uses the bundle's SavedModel and FAISS index (what would be served) on the
data and split its saved config names; --set overrides any config key,
e.g. --set evaluation.ks=[5,10]. Metrics are printed; metrics.json,
report.md and the plots are written to --out (default <run>/reevaluated),
so the run's own report is never overwritten.""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run", required=True, help="bundle directory, e.g. artifacts/<run>")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="where to write metrics.json, report.md and plots (default: <run>/reevaluated)")
    return parser


def _evaluate(args: argparse.Namespace) -> int:
    setup_logging()

    from retrieval.evaluation import format_table
    from retrieval.jobs import evaluate_bundle

    out = Path(args.out) if args.out else Path(args.run) / "reevaluated"
    metrics = evaluate_bundle(args.run, args.overrides, out=out)
    print(format_table(metrics))
    print(f"written to {out}")
    print(json.dumps({"counts": metrics["counts"]}))
    return 0


# --- export --------------------------------------------------------------------------------------


def export_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="""Re-export a bundle with another FAISS index:
--run artifacts/<run> --out artifacts/<run>-ivf --set index.factory=IVF64,Flat.

Training already writes a complete bundle; this rebuilds only the index
(from the bundle's own doc model over its catalogue), atomically, into a
new directory.""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run", required=True, help="source bundle directory")
    parser.add_argument("--out", required=True, help="new bundle directory (must not exist unless run.overwrite)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser


def _export(args: argparse.Namespace) -> int:
    setup_logging()

    from retrieval.bundle.manifest import read_manifest
    from retrieval.config import Config, apply_overrides
    from retrieval.jobs import reindex_bundle

    manifest = read_manifest(args.run)
    config = Config.from_dict(apply_overrides(manifest.config or {}, args.overrides), source="--set")
    out = reindex_bundle(args.run, args.out, config.index, overwrite=config.run.overwrite)
    print(f"bundle with index {config.index.factory!r}: {out}")
    return 0


# --- tune ----------------------------------------------------------------------------------------


def tune_parser(
    prog: str | None = None, *, default_config: str | None = None, default_space: str | Path = PROJECT_TUNE_SPACE
) -> argparse.ArgumentParser:
    """Optuna TPE over the config keys of a search space file, trials pruned by the median rule on each
    epoch's validation recall; the same command again continues the study (``--trials`` is the total).
    Writes trials.csv, best.yaml (a full config for training) and best.json into the study folder
    (``retrieval/tuning/``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Hyper-parameter search: Optuna TPE over a search space of config keys, resumable.",
        epilog="Trials are scored on a validation part, never on the test part: with split.kind temporal, random "
        "or leave_last_k each trial sets split.evaluate_on=validation (the training part split again the same "
        "way, the test part not read); with split.kind none on the given data.test_clicks, so pass a validation "
        "file there. best.yaml keeps the base config's split.evaluate_on.",
    )
    config_arguments(parser, default_config=default_config)
    parser.add_argument("--trials", type=int, required=True, help="finished trials wanted in the study, in total")
    parser.add_argument("--space", default=str(default_space), help="search space YAML (default: %(default)s)")
    parser.add_argument(
        "--study-dir", type=Path, help="study folder (default: artifacts/tune/<config name>); reused to resume"
    )
    parser.add_argument(
        "--metric", default="recall@20", help="the job's model metric to maximise (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the TPE sampler (default: %(default)s)")
    parser.add_argument("--keep-bundles", action="store_true", help="keep each trial's run directory under runs/")
    parser.add_argument(
        "--pruner-startup-trials", type=int, default=1,
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
    parser.add_argument(
        "--train-best", action="store_true",
        help="once the study ends, train best.yaml (its refit included) into a bundle under run.output_dir",
    )
    return parser


def _tune(args: argparse.Namespace) -> int:
    from retrieval.config import load_config

    base = load_config(args.config, args.overrides)
    setup_logging()
    check_inputs_before_tensorflow(base)

    from retrieval.tuning import TuneSettings, load_space, run_study

    space = load_space(args.space, base)
    study_dir = args.study_dir or Path(base.run.output_dir) / "tune" / _config_name(args.config)
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
        print(f"\nbest config: {study_dir / 'best.yaml'}  (retrieval train --config {study_dir / 'best.yaml'})")
        if args.train_best:  # the one refit of the study: trials skip theirs (TRIAL_SETTINGS)
            from retrieval.evaluation import format_table
            from retrieval.jobs import train_evaluate_export

            result = train_evaluate_export(load_config(study_dir / "best.yaml"), config_name="tune-best")
            print()
            print(format_table(result.metrics))
            print(f"\nbest config trained: {result.directory}  ({result.seconds:.0f} s)")
    else:
        print("no trial completed: no best config")
    return 0


# --- recommend (python -m retrieval.serving) -----------------------------------------------------


def _recommend_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from retrieval.serving import recommend_parser  # loads TensorFlow: only when this command is chosen

    return recommend_parser(prog)


def _recommend(args: argparse.Namespace) -> int:
    from retrieval.serving import recommend

    return recommend(args)


# --- catalogue -----------------------------------------------------------------------------------


def catalogue_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Add, remove or update catalogue items of a bundle without retraining "
        "(retrieval.bundle.catalogue). add embeds each new item from its raw doc features through the "
        "bundle's doc model and appends it to the index; an ID-only doc model cannot embed an id it "
        "never saw, so it takes new items only with an 'embedding' column. remove keeps the items' "
        "rows and never serves them again. update changes display features (and, given every doc "
        "input, re-embeds). Without --out the edit is the bundle's next version, "
        "<bundle>.catalogue/<name>.v<n>, and <bundle>.catalogue/current points at it: `retrieval "
        "serve --bundle <bundle>` serves it (after a restart or `retrieval reload`). An edited bundle "
        "has no topk SavedModel.",
    )
    parser.add_argument("change", choices=["add", "remove", "update"], help="what to do with the items")
    parser.add_argument("--bundle", required=True, help="bundle directory, e.g. artifacts/<run> (its newest "
                        "catalogue version is edited)")
    parser.add_argument(
        "--items", required=True, metavar="FILE",
        help="the items: .csv, .parquet or .jsonl (one JSON object a line; list inputs need .jsonl or "
        ".parquet), an item_id column and, for add and update, columns named as the doc model's inputs "
        "(manifest.json doc_features) and display features; remove reads item_id only",
    )
    parser.add_argument("--out", help="write the edited bundle to this new directory instead of the next version")
    parser.add_argument("--overwrite", action="store_true", help="with --out: replace a bundle there")
    return parser


def _catalogue(args: argparse.Namespace) -> int:
    import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow loads)
    from retrieval.bundle.catalogue import current_version, edit_catalogue, publish_edit, read_items

    if args.overwrite and args.out is None:
        raise UserError("--overwrite applies to --out, which this command was not given")
    if not Path(args.bundle).is_dir():
        raise UserError(f"--bundle {args.bundle}: no such bundle directory")
    items = read_items(args.items)
    if args.out is not None:
        edit_catalogue(current_version(args.bundle), args.change, items, args.out, overwrite=args.overwrite)
        written = Path(args.out)
    else:
        written = publish_edit(args.bundle, args.change, items)
    manifest = json.loads((written / "manifest.json").read_text())
    disabled = len(manifest.get("disabled_item_ids") or ())
    print(json.dumps({"bundle": str(written), "change": args.change, "items": len(items),
                      "num_items": manifest["num_items"] - disabled, "disabled_items": disabled}))
    return 0


# --- serve, reload -------------------------------------------------------------------------------


def serve_parser(prog: str | None = None) -> argparse.ArgumentParser:
    serve = argparse.ArgumentParser(
        prog=prog, description="HTTP JSON service over a bundle (uvicorn), with a web page at / to look at its answers."
    )
    serve.add_argument("--bundle", required=True, help="bundle directory, e.g. artifacts/<run>")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--no-admin", action="store_true", help="disable POST /admin/reload")
    serve.add_argument(
        "--admin-token",
        help=f"require 'Authorization: Bearer <token>' on /admin/reload (default: ${ADMIN_TOKEN_ENV}); "
        "needed when --host is not loopback and admin is on",
    )
    serve.add_argument(
        "--search-threads", type=int, default=1, help="FAISS threads per request; 0 = every core (default: %(default)s)"
    )
    serve.add_argument(
        "--tensorflow-threads", type=int, default=1,
        help="threads one query-tower op may use (TensorFlow's intra-op pool); 0 = every core. 1 suits "
        "single-query traffic, as --search-threads 1 does: concurrent requests take the other cores, and "
        "independent ops (an ensemble's members) still run side by side (default: %(default)s)",
    )
    serve.add_argument(
        "--verify", default="quick", choices=["quick", "full"],
        help="check the bundle's files (at start and every reload) against its manifest's fingerprints: "
        "quick hashes files over 64 MiB by size and both ends, full hashes every file whole (default: %(default)s)",
    )
    serve.add_argument("--access-log", action="store_true", help="log every request (costs latency)")
    serve.add_argument(
        "--http", default="auto", choices=["auto", "httptools", "h11"],
        help="HTTP parser; auto = httptools when installed (default: %(default)s)",
    )
    serve.add_argument(
        "--loop", default="auto", choices=["auto", "uvloop", "asyncio"],
        help="event loop; auto = uvloop when installed (default: %(default)s)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--gil-switch-interval", type=float, default=0.0005,
        help="seconds a Python thread may hold the interpreter while others wait (sys.setswitchinterval; "
        "Python's default 0.005 lets a large batch delay small requests by that much per hand-over; "
        "default: %(default)s)",
    )
    _add_limit_flags(serve)
    return serve


def reload_parser(prog: str | None = None) -> argparse.ArgumentParser:
    reload = argparse.ArgumentParser(prog=prog, description="Make a running service serve another bundle.")
    reload.add_argument("--bundle", required=True, help="new bundle directory, as the server sees it")
    reload.add_argument(
        "--url", help="service base URL (default: http://<--host>:<--port>, i.e. http://127.0.0.1:8000)"
    )
    reload.add_argument("--host", help="the service's --host (default: 127.0.0.1); or give --url")
    reload.add_argument("--port", type=int, help="the service's --port, as serve takes it (default: 8000); or --url")
    reload.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the load")
    reload.add_argument("--token", help=f"the server's admin token (default: ${ADMIN_TOKEN_ENV})")
    return reload


def _add_limit_flags(serve: argparse.ArgumentParser) -> None:
    """One flag per ServiceLimits field, e.g. --request-read-timeout for request_read_timeout."""
    for field in dataclasses.fields(ServiceLimits):
        kind = int if field.type == "int" else float
        serve.add_argument(
            "--" + field.name.replace("_", "-"), type=kind, default=field.default,
            help=f"{field.metadata['help']} (default: %(default)s)",
        )


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow loads)
    from retrieval.serving.http import check_admin_exposure, create_app, server_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a TCP port (0 to 65535)")
    if args.tensorflow_threads < 0:
        raise UserError(f"--tensorflow-threads {args.tensorflow_threads} must be 0 (every core) or more")
    if args.tensorflow_threads:
        _limit_tensorflow_threads(args.tensorflow_threads)
    try:  # both check the flags' values: their ValueError is a bad command line
        limits = ServiceLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServiceLimits)})
        check_admin_exposure(args.host, not args.no_admin, token)
    except ValueError as error:
        raise UserError(str(error)) from error
    app = create_app(
        args.bundle, admin=not args.no_admin, admin_token=token, host=args.host, limits=limits,
        search_threads=args.search_threads or None, verify=args.verify,
    )
    if not args.no_admin:  # the doc model a catalogue edit embeds with, loaded now so no edit waits for it
        threading.Thread(target=app.state.holder.doc_model, name="load-doc-model", daemon=True).start()
    sys.setswitchinterval(args.gil_switch_interval)
    config = server_config(
        app, limits, http=args.http, host=args.host, port=args.port, access_log=args.access_log,
        log_level=args.log_level, loop=args.loop,
    )
    uvicorn.Server(config).run()
    return 0


def _limit_tensorflow_threads(threads: int) -> None:
    """TensorFlow's intra-op pool at ``threads``, which only holds before TensorFlow first runs an op:
    a process that already did (``serve`` called from Python after other work) keeps its pool."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:
        logging.getLogger(__name__).warning(
            "--tensorflow-threads %d ignored: TensorFlow already runs in this process with %s intra-op threads",
            threads, tf.config.threading.get_intra_op_parallelism_threads() or "its default",
        )


def _reload(args: argparse.Namespace) -> int:
    if args.url is not None and (args.host is not None or args.port is not None):
        raise UserError("give the service as --url or as --host/--port, not both")
    if args.port is not None and not 0 < args.port <= 65535:
        raise UserError(f"--port {args.port} is not a TCP port (1 to 65535)")
    if args.url is None:  # serve's own flags and defaults
        host = args.host or "127.0.0.1"
        args.url = f"http://{f'[{host}]' if ':' in host else host}:{8000 if args.port is None else args.port}"
    if not args.url.startswith(("http://", "https://")):
        raise UserError(f"--url {args.url!r} is not an http:// or https:// URL")
    headers = {"Content-Type": "application/json"}
    token = args.token or os.environ.get(ADMIN_TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        args.url.rstrip("/") + "/admin/reload",
        data=json.dumps({"bundle": args.bundle}).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            print(response.read().decode())
    except urllib.error.HTTPError as error:
        raise UserError(f"{args.url} refused the reload: {error.code} {error.read().decode()}") from None
    except urllib.error.URLError as error:
        raise UserError(f"cannot reach {args.url}: {error.reason}") from None
    except TimeoutError:
        raise UserError(f"{args.url} did not answer within --timeout {args.timeout:g} s") from None
    return 0


# In `retrieval --help` order: the pipeline's steps, then serving.
COMMANDS: dict[str, Command] = {
    "train": Command("train, evaluate and export a model into a run directory", train_parser, _train),
    "evaluate": Command("re-evaluate an exported bundle (what would be served)", evaluate_parser, _evaluate),
    "export": Command("re-index a bundle with another FAISS index", export_parser, _export),
    "tune": Command("hyper-parameter search over config keys (resumable)", tune_parser, _tune),
    "recommend": Command("top-k items for user ids, or items similar to items", _recommend_parser, _recommend),
    "catalogue": Command("add, remove or update items of a bundle without retraining", catalogue_parser,
                         _catalogue),
    "serve": Command("HTTP JSON service over a bundle (uvicorn)", serve_parser, _serve),
    "reload": Command("make a running service serve another bundle", reload_parser, _reload),
}


if __name__ == "__main__":
    sys.exit(main())
