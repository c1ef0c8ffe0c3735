"""The ``retrieval`` console command: every entry point as a subcommand, from any directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_entry_point_errors import TF_QUIET, TINY
from test_service import world  # noqa: F401  (the module fixture: two small bundles, no training)

from retrieval import cli, serving
from retrieval.config import load_config

ROOT = Path(__file__).resolve().parents[2]

# Each subcommand's flags: those of the entry point it stands for (python -m pipelines.X, retrieval.serving).
FLAGS = {
    "train": ["--config", "--set"],
    "evaluate": ["--run", "--set", "--out"],
    "export": ["--run", "--out", "--set"],
    "tune": ["--config", "--set", "--trials", "--space", "--study-dir", "--metric", "--seed", "--keep-bundles",
             "--pruner-startup-trials", "--pruner-warmup-epochs", "--no-baseline-trial", "--timeout", "--train-best"],
    "recommend": ["--bundle", "--user-id", "--similar", "--users", "-k", "--k", "--exclude", "--include-seen", "--out",
                  "--overwrite", "--block-size"],
    "catalogue": ["--bundle", "--items", "--out", "--overwrite"],
    "serve": ["--bundle", "--host", "--port", "--no-admin", "--admin-token", "--search-threads",
              "--tensorflow-threads", "--verify", "--access-log", "--http", "--loop", "--log-level",
              "--gil-switch-interval", "--max-body-bytes"],
    "reload": ["--bundle", "--url", "--host", "--port", "--timeout", "--token"],
}
PIPELINES = ["train", "evaluate", "export", "tune"]


def _help(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    return capsys.readouterr().out


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", text)) - {"-h", "--help"}


def test_the_overview_lists_every_command_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = _help(cli.main, ["--help"], capsys)
    listed = dict(re.findall(r"^    (\w+) +(\S.*)$", text, flags=re.MULTILINE))
    assert list(listed) == list(FLAGS)
    assert all(listed[name] == cli.COMMANDS[name].summary for name in FLAGS)


@pytest.mark.parametrize("argv", [["trian"], [], ["--bundle", "x"]])
def test_a_bad_or_missing_command_is_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage: retrieval ") and len(lines) == 2
    assert lines[1].startswith("retrieval: error: ")
    if argv == ["trian"]:
        assert "invalid choice: 'trian'" in lines[1]


@pytest.mark.parametrize("name", list(FLAGS))
def test_each_command_has_a_help_naming_its_flags(name, capsys):
    text = _help(cli.main, [name, "--help"], capsys)
    assert text.startswith(f"usage: retrieval {name} ")
    assert set(FLAGS[name]) <= _flags(text)


@pytest.mark.parametrize("name", PIPELINES)
def test_python_m_pipelines_takes_the_same_flags_and_its_old_defaults(name, capsys):
    module = __import__(f"pipelines.{name}", fromlist=["main"])
    text = _help(module.main, ["--help"], capsys)
    assert _flags(text) == _flags(_help(cli.main, [name, "--help"], capsys))
    if name in ("train", "tune"):  # the module entry points read these files of the working directory
        assert "(default: configs/default.yaml)" in text
    if name == "tune":
        assert "(default: configs/tune_space.yaml)" in text


def test_without_config_train_and_tune_use_the_project_recipe():
    """The console's default is the code's defaults: what make train's configs/default.yaml loads."""
    assert cli.train_parser().parse_args([]).config is None
    assert load_config(None, []) == load_config(ROOT / "configs" / "default.yaml", [])
    tune = cli.tune_parser().parse_args(["--trials", "1"])
    assert tune.config is None and Path(tune.space) == ROOT / "configs" / "tune_space.yaml"
    assert Path(tune.space).is_file()


def _console() -> list[str]:
    """The installed console script when it is beside this Python, else its module."""
    script = Path(sys.executable).with_name("retrieval")
    return [str(script)] if script.exists() else [sys.executable, "-m", "retrieval.cli"]


@pytest.mark.slow
def test_train_runs_from_any_directory_and_writes_under_it(tmp_path):
    sets = [arg for kv in [*TINY, "run.name=tiny", "run.output_dir=runs"] for arg in ("--set", kv)]
    done = subprocess.run(
        [*_console(), "train", *sets], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, **TF_QUIET, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "tiny" / "manifest.json").is_file()  # run.output_dir is relative to the cwd
    assert "run directory: runs/tiny" in done.stdout


@pytest.mark.parametrize(
    "asked",
    [["--user-id", "user01", "--user-id", "nobody", "--exclude", "item003", "item007"], ["--similar", "item005"]],
)
def test_recommend_prints_what_python_m_retrieval_serving_prints(world, asked, capsys):  # noqa: F811
    argv = ["--bundle", str(world["bundle-a"]), "-k", "5", *asked]
    assert serving.main(argv) == 0
    expected = capsys.readouterr().out
    assert cli.main(["recommend", *argv]) == 0
    assert capsys.readouterr().out == expected
    assert len(expected.splitlines()) == asked.count("--user-id") + asked.count("--similar")


def test_reload_takes_the_port_as_serve_does_or_a_url(capsys):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    asked = []

    class Admin(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            asked.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            body = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Admin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert cli.main(["reload", "--port", str(port), "--bundle", "b1"]) == 0
        assert cli.main(["reload", "--url", f"http://127.0.0.1:{port}/", "--bundle", "b2"]) == 0
        assert cli.main(["reload", "--host", "127.0.0.1", "--port", str(port), "--bundle", "b3"]) == 0
    finally:
        server.shutdown()
    assert asked == [("/admin/reload", {"bundle": f"b{i}"}) for i in (1, 2, 3)]
    assert cli.main(["reload", "--url", f"http://127.0.0.1:{port}", "--port", str(port), "--bundle", "b"]) == 2
    assert "give the service as --url or as --host/--port, not both" in capsys.readouterr().err
