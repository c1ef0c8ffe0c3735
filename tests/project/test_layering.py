"""Data flows one way: a module imports only from stages before it."""

import ast
from pathlib import Path

# Stage order (common and config are shared foundations).
STAGES = [
    "common",  # errors (UserError, run_main), native_logs (imported by retrieval/__init__.py, first), progress,
    # arrays, replicas (tf.distribute helpers), the one file lock and the atomic file writes
    "config",  # a module per section on a strict base (base), Config and its cross-section checks (run), warm starts
    # (warm_start), YAML loading and overrides (loading); docs/configuration.md generated from them (reference)
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


def test_the_config_package_re_exports_every_public_name_of_its_modules():
    import retrieval.config

    modules = sorted(path for path in (PACKAGE / "config").glob("*.py") if path.stem not in ("__init__", "reference"))
    assert len(modules) > 1 and any(path.stem == "run" for path in modules)  # the glob sees the section modules
    names = {f"{path.stem}.{name}": name for path in modules for name in _public_names(path)}
    missing = sorted(where for where, name in names.items() if name not in retrieval.config.__all__)
    assert not missing, f"retrieval/config/__init__.py does not re-export {missing}; add them"
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_time_statements(body: list[ast.stmt]):
    """The statements a module runs when it is imported: its top level, into if/try/with blocks, but not
    into functions or classes' methods (a lazy import there runs on a call), nor ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_time_statements(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _import_time_statements([n for n in inner if isinstance(n, ast.stmt)] + [
                    s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])


def _import_graph() -> dict[str, set[str]]:
    """Module -> the retrieval modules it imports when imported. ``from retrieval.a import b`` is an edge to
    ``retrieval.a.b`` when that is a module, else to ``retrieval.a``; a package's __init__ is its own node
    (importing retrieval.a.b also runs retrieval/a/__init__.py, but Python then finds retrieval.a in
    sys.modules already being imported: that is no cycle of code)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        edges = graph.setdefault(module, set())
        for node in _import_time_statements(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in paths)
            elif isinstance(node, ast.ImportFrom) and node.module in paths and node.level == 0:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(paths)
                edges.update(submodules or {node.module})
        edges.discard(module)
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], found by depth-first search (a node met again while it is
    still on the path closes one); None when the graph has none."""
    on_path: list[str] = []
    state: dict[str, str] = {}  # "open" while on the path, "done" once every node after it is searched

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        on_path.append(node)
        for other in sorted(graph.get(node, ())):
            if state.get(other) == "open":
                return on_path[on_path.index(other):] + [other]
            if other not in state and (cycle := visit(other)) is not None:
                return cycle
        on_path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_search_finds_a_cycle_and_only_a_cycle():
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no cycle
    graph = _import_graph()
    assert "retrieval.config.loading" in graph["retrieval.config"]  # the graph sees the package's imports
    assert "retrieval.config.run" in graph["retrieval.config.loading"]


# Known cycles, each as the edge that closes it, to be removed (none today).
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def test_no_import_cycle_among_the_modules():
    """Imports that run when a module is imported form no cycle, inside a stage or across stages (across
    stages test_imports_flow_forward_only already forbids one). Lazy imports inside functions are left
    out: they run on a call, after every module involved is loaded, which is how a module may reach a
    later one (see test_imports_flow_forward_only, which does count them)."""
    graph = _import_graph()
    stale = sorted(edge for edge in KNOWN_CYCLE_EDGES if edge[1] not in graph.get(edge[0], set()))
    assert not stale, f"KNOWN_CYCLE_EDGES lists imports that are gone: {stale}; remove them"
    for module, imported in KNOWN_CYCLE_EDGES:
        graph[module] = graph[module] - {imported}
    cycle = _a_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
