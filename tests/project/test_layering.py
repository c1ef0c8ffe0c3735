"""Data flows one way: a module imports only from stages before it."""

import ast
from pathlib import Path

# Stage order (common and config are shared foundations).
STAGES = [
    "common",  # errors (UserError, run_main), native_logs (imported by retrieval/__init__.py, first), progress,
    # arrays, replicas (tf.distribute helpers), the one file lock and the atomic file writes
    "config",  # typed sections, YAML loading and overrides (sections); docs/configuration.md generated from them
    # (reference)
    "data",
    "features",
    "index",  # FAISS index over the catalogue and exact top-k (exact_topk): needs only common and config
    "towers",
    "samplers",
    "losses",
    "model",  # config names -> samplers, log-Q sources, losses, miner (parts); TwoTowerModel wires them (two_tower)
    "training",
    "evaluation",
    "bundle",  # the bundle format: typed manifest, its parts (index, SavedModels, seen items, user features and
    # histories, display features), the one writer, fingerprints, the atomic run directory
    "serving",  # Bundle (bundle: load, recommend, similar items, python -m retrieval.serving), many users into
    # one Parquet file (batch), the rules of a request every entry point applies (request_checks), the HTTP
    # service and its page (http)
    "jobs",  # the main job (train); re-evaluating (with the job's phases) and re-indexing a bundle (reevaluate_reindex)
    "tuning",  # hyper-parameter search: runs the job per trial
    "api",  # the Python API: retrieval.train -> Run, run.recommend, open_run
    "cli",
]
PACKAGE = Path(__file__).resolve().parents[2] / "retrieval"
TESTS = PACKAGE.parent / "tests"
# tests/ folders that are no stage: the repository's own checks, and the benchmarks' tests.
OTHER_TEST_FOLDERS = ["project", "bench"]
# stage -> its position; modules of one stage may import each other.
RANK = {name: position for position, name in enumerate(STAGES)}


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
    "checkpoint_directory",  # a run's checkpoint directory for fit: lock, resume checks, cleanup
    "warm_start",  # a run trained on from a finished run's weights
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


def test_the_architecture_diagram_lists_the_stages_in_order():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    diagram = next(line for line in text.splitlines() if "─►" in line)
    expected = " ─► ".join(STAGES)
    assert diagram == expected, "docs/architecture.md's diagram disagrees with STAGES in tests/project/test_layering.py"


def _public_names(path: Path) -> set[str]:
    """The public names a module defines at its top level (classes, functions, assignments)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


def test_the_config_package_re_exports_every_public_name_of_its_sections():
    import retrieval.config

    missing = _public_names(PACKAGE / "config" / "sections.py") - set(retrieval.config.__all__)
    assert not missing, f"retrieval/config/__init__.py does not re-export {sorted(missing)}; add them"
    assert all(hasattr(retrieval.config, name) for name in retrieval.config.__all__)


def test_the_test_folders_are_stages_all_on_the_path_with_unique_file_names(pytestconfig):
    folders = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    strays = sorted(set(folders) - set(STAGES) - set(OTHER_TEST_FOLDERS))
    assert not strays, f"tests/ folders that are no stage: {strays}; name them after a stage in STAGES"
    assert not list(TESTS.glob("test_*.py")), "a test file belongs in the folder of its stage, not at the top of tests/"
    # Test files import each other by module name (pyproject.toml's pytest pythonpath), so a name is used once.
    path = {str(Path(p).resolve().relative_to(PACKAGE.parent)) for p in pytestconfig.getini("pythonpath")}
    assert path == {"tests", *(f"tests/{folder}" for folder in folders)}, "pyproject.toml's pytest pythonpath"
    names = [p.name for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts]
    assert len(names) == len(set(names)), sorted({name for name in names if names.count(name) > 1})
