"""Data flows one way: a module imports only from stages before it."""

import ast
from pathlib import Path

# Stage order (config and arrays are shared foundations).
STAGES = [
    "errors",  # UserError and run_main, the one-line errors of every entry point; the RETRIEVAL_DEBUG rule
    "request_checks",  # the rules of a serving request (ids, id lists, k, query keys): every entry point's
    "native_logs",  # TensorFlow's start-up lines filtered out of stderr: imported by retrieval/__init__.py, first
    "progress",  # count, rate and ETA of a long loop (a tqdm bar on a terminal, else log lines)
    "config",
    "config_reference",  # docs/configuration.md, generated from config only
    "arrays",
    "replicas",  # tf.distribute helpers: one global batch over several replicas
    "data",
    "features",
    "towers",
    "samplers",
    "losses",
    "model_parts",  # config names -> samplers, log-Q sources, losses, miner
    "model",
    "exact_topk",  # brute-force top-k: early stopping's validation recall and the Flat index search with it
    "training",
    "index",
    "evaluation",
    "bundle",  # the bundle format: typed manifest, its parts (index, SavedModels, seen items, user features and
    # histories, display features), the one writer, fingerprints, the atomic run directory
    # One stage: batch_recommend answers many users through serving's Bundle, and serving's command
    # line hands --out to it.
    ("serving", "batch_recommend"),
    "service",
    "checkpoint_directory",  # a run's checkpoint directory: lock, resume checks, cleanup
    "jobs",
    "bundles",  # re-evaluating (with the job's phases) and re-indexing an exported bundle
    "tuning",  # hyper-parameter search: runs the job per trial
    "api",  # the Python API: retrieval.train -> Run, run.recommend, open_run
    "cli",
]
PACKAGE = Path(__file__).resolve().parents[1] / "retrieval"
# module -> its stage's position; modules grouped in one entry share it (and may import each other).
RANK = {name: position for position, entry in enumerate(STAGES)
        for name in (entry if isinstance(entry, tuple) else (entry,))}


def _stage_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else module


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("retrieval."):
            yield node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("retrieval."):
                    yield alias.name


def test_every_module_has_a_stage():
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue
        stage = relative.parts[0].removesuffix(".py")
        assert stage in RANK, f"{relative} is in no stage; add it to STAGES in order"


def test_imports_flow_forward_only():
    problems = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue
        own = RANK[relative.parts[0].removesuffix(".py")]
        for module in _imports(path):
            other = _stage_of(module)
            if other in RANK and RANK[other] > own:
                problems.append(f"{relative} imports {module} (a later stage)")
    assert not problems, "\n".join(problems)


def test_evaluation_does_not_import_tensorflow():
    for path in (PACKAGE / "evaluation").rglob("*.py"):
        source = path.read_text()
        assert "import tensorflow" not in source, f"{path.name} imports TensorFlow"


# Inside the training stage, in the order its modules build on each other (retrieval/training/__init__.py).
TRAINING_MODULES = [
    "optimizers",
    "runtime",
    "interfaces",
    "parameter_server",
    "sources",
    "worker_input",
    "cluster",
    "checkpoints",
    "loop",
    "early_stopping",
    "fit",
    "embeddings",
    "warm_start",
]


def test_training_modules_build_on_earlier_ones_only():
    problems = []
    for path in (PACKAGE / "training").glob("*.py"):
        if path.name == "__init__.py":
            continue
        assert path.stem in TRAINING_MODULES, f"training/{path.name} is not in TRAINING_MODULES; add it in order"
        own = TRAINING_MODULES.index(path.stem)
        for module in _imports(path):
            parts = module.split(".")
            if parts[:2] == ["retrieval", "training"] and len(parts) > 2:
                if TRAINING_MODULES.index(parts[2]) >= own:
                    problems.append(f"training/{path.name} imports {module} (not an earlier module)")
    assert not problems, "\n".join(problems)
