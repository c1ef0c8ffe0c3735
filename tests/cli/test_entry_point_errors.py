"""Entry points: a user error is one line ``error: ...`` and exit status 2, never a traceback."""

import errno
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

import retrieval  # noqa: F401
from retrieval.common.errors import DEBUG_ENV, run_main, user_message
from retrieval.config import ConfigError
from retrieval.index import check_index_fits
from retrieval.training import TrainingDiverged

ROOT = Path(__file__).resolve().parents[2]
# TensorFlow's C++ start-up log and the job's own log records (HH:MM:SS name: ...) are not ours.
NOT_OURS = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|[IWE]\d{4} [\d:.]+ |\d\d:\d\d:\d\d )")


def _raising(error):
    def main(argv):
        raise error

    return main


@pytest.mark.parametrize(
    "error, expected",
    [
        (ConfigError("x.yaml: invalid configuration\n  data.bogus: unknown key"),
         "error: x.yaml: invalid configuration: data.bogus: unknown key"),
        (PermissionError(errno.EACCES, "Permission denied", "/ro/x"),
         "error: /ro/x: Permission denied: check its permissions or choose another path"),
        (OSError(errno.ENOSPC, "No space left on device"),
         "error: No space left on device: free space on that disk or write elsewhere"),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "c.yaml"),
         "error: c.yaml: Is a directory: a directory is where a file is expected: give a file"),
        (FileNotFoundError("run is not a bundle: manifest.json is missing"),
         "error: run is not a bundle: manifest.json is missing"),
        (TrainingDiverged("training diverged at step 3: loss nan; lower train.learning_rate"),
         "error: training diverged at step 3: loss nan; lower train.learning_rate"),
    ],
)
def test_a_user_error_is_one_line_and_status_2(error, expected, capsys):
    assert run_main(_raising(error)) == 2
    assert capsys.readouterr().err == expected + "\n"


def test_ctrl_c_is_one_line_and_status_130(capsys):
    assert run_main(_raising(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "error: interrupted\n"


@pytest.mark.parametrize("error", [TypeError("bug"), AttributeError("bug"), ValueError("deep in TensorFlow"),
                                   OSError(errno.EIO, "I/O error")])
def test_a_programming_error_keeps_its_traceback(error):
    assert user_message(error) is None
    with pytest.raises(type(error)):
        run_main(_raising(error))


def test_retrieval_debug_re_raises_user_errors(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ConfigError):
        run_main(_raising(ConfigError("bad key")))
    with pytest.raises(KeyboardInterrupt):
        run_main(_raising(KeyboardInterrupt()))


def test_a_bug_in_a_decorated_main_is_a_traceback_and_status_1():
    script = ("import sys\nfrom retrieval.common.errors import entry_point\n"
              "@entry_point\ndef main(argv=None):\n    return len(None)\nsys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "TypeError" in done.stderr and "error: " not in done.stderr


def test_a_tensorflow_disk_full_error_is_a_user_error():
    import tensorflow as tf

    error = tf.errors.ResourceExhaustedError(None, None, "/out/ckpt-3_temp/part-0; No space left on device")
    assert user_message(error) == ("/out/ckpt-3_temp/part-0; No space left on device: "
                                   "free space on that disk or write elsewhere")
    assert user_message(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")) is None


# (factory, centroids FAISS needs to train it): at centroids - 1 vectors it refuses, at centroids it trains.
FACTORIES = [("IVF8,Flat", 8), ("IVF8_HNSW8,Flat", 8), ("PQ4", 256), ("PQ4x4", 16), ("IVF8,PQ4x6", 64),
             ("OPQ4,IVF8,PQ4x4", 256), ("HNSW8,PQ4x5", 32), ("RQ2x5", 32), ("PQ4x4fs", 16), ("IVF16,SQ8", 16)]


@pytest.mark.parametrize("factory, centroids", FACTORIES)
def test_index_fits_check_agrees_with_faiss(factory, centroids):
    rng = np.random.default_rng(0)
    for n, trains in ((centroids - 1, False), (centroids, True)):
        index = faiss.index_factory(16, factory, faiss.METRIC_INNER_PRODUCT)
        try:
            index.train(rng.standard_normal((n, 16)).astype(np.float32))
            trained = True
        except RuntimeError:
            trained = False
        assert trained == trains, (factory, n)
        if trains:
            check_index_fits(factory, n)
        else:
            with pytest.raises(ConfigError, match=f"index.factory {re.escape(factory)} needs at least {centroids}"):
                check_index_fits(factory, n)


def test_index_fits_check_messages():
    with pytest.raises(ConfigError) as info:
        check_index_fits("IVF200,Flat", 100)
    assert str(info.value) == ("index.factory IVF200,Flat needs at least 200 catalogue items to train its 200 lists "
                               "(FAISS wants ~39 per list); the catalogue has 100: use Flat or IVF<=2")
    with pytest.raises(ConfigError, match=r"index.train_sample_size=150 .*set index.train_sample_size >= 200"):
        check_index_fits("IVF200,Flat", 1000, 150)
    for fits in ("Flat", "HNSW32", "SQ8", "IVF200,Flat"):
        check_index_fits(fits, 200)


def test_a_checkpoint_save_on_a_full_disk_leaves_the_previous_checkpoint_and_no_temp(tmp_path, monkeypatch):
    import tensorflow as tf
    from tensorflow.python.checkpoint import functional_saver

    from retrieval.training.checkpoints import TrainingCheckpoint, TrainingState

    model, optimizer = tf.Module(), tf.Module()
    model.v, optimizer.w = tf.Variable([1.0, 2.0]), tf.Variable(3.0)
    checkpoint = TrainingCheckpoint(tmp_path, model, optimizer, every_steps=1)
    checkpoint.save(TrainingState(steps=1))
    before = sorted(p.name for p in tmp_path.iterdir())

    def disk_full(*args, **kwargs):  # the shards are in ckpt-2_temp/ by now; merging them fails
        assert (tmp_path / "ckpt-2_temp").is_dir()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(functional_saver.gen_io_ops, "merge_v2_checkpoints", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(TrainingState(steps=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert Path(checkpoint.latest).name == "ckpt-1"


TF_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def _run(module, args, patch=""):
    """``python -m module args`` (after ``patch``, Python run first in the same process): (result, our lines)."""
    script = f"import runpy, sys\n{patch}\nsys.argv = [{module!r}, *{args!r}]\n" \
             f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **TF_QUIET, "PYTHONPATH": str(ROOT)})
    ours = [line for line in done.stderr.splitlines() if line.strip() and not NOT_OURS.match(line)]
    return done, ours


def _sets(*overrides):
    return [a for kv in overrides for a in ("--set", kv)]


TINY = ["data.synthetic.n_users=120", "data.synthetic.n_items=100", "data.synthetic.mean_clicks_per_user=10",
        "train.epochs=1", "train.verbose=0", "model.embedding_dim=16", "evaluation.plots=false",
        "evaluation.baselines.rankers=[popularity]", "export.topk_model=false"]

# A write that fails as on a full disk: the bundle's manifest (export), the merge of a checkpoint's shards (the
# second save: the first one stays the checkpoint to resume from).
DISK_FULL_EXPORT = """
import errno, os
import retrieval.bundle.writer
def disk_full(directory, manifest):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(directory, "manifest.json"))
retrieval.bundle.writer.write_manifest = disk_full
"""
# The FAISS index of a re-indexed bundle written to a full disk (/dev/full: every write fails with ENOSPC).
DISK_FULL_INDEX = """
import builtins
import retrieval.common.arrays
def full_disk_for_the_index(path, mode="r", *args, **kwargs):
    if str(path).endswith("index.faiss") and "w" in mode:
        return builtins.open("/dev/full", mode, *args, **kwargs)
    return builtins.open(path, mode, *args, **kwargs)
retrieval.common.arrays.open = full_disk_for_the_index
"""
DISK_FULL_CHECKPOINT = """
import errno, os
import retrieval
from tensorflow.python.checkpoint import functional_saver
real, saves = functional_saver.gen_io_ops.merge_v2_checkpoints, []
def merge(checkpoint_prefixes, destination_prefix, *args, **kwargs):
    saves.append(1)
    if len(saves) == 1:
        return real(checkpoint_prefixes, destination_prefix, *args, **kwargs)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), destination_prefix.numpy().decode())
functional_saver.gen_io_ops.merge_v2_checkpoints = merge
"""


@pytest.fixture
def read_only(tmp_path):
    """A directory nothing can be created in, also by root (``chattr +i``; mode 0o555 alone does not stop root)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    if os.geteuid() == 0 and not immutable:
        pytest.skip("running as root without chattr: no directory is read-only")
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A tiny bundle trained on a clicks file (``clicks.parquet`` beside it) for the cases that read one."""
    from retrieval.config import SyntheticConfig
    from retrieval.data import generate_clicks

    out = tmp_path_factory.mktemp("bundle")
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=120, n_items=100, mean_clicks_per_user=10))
    clicks.to_parquet(out / "clicks.parquet", index=False)
    done, ours = _run("pipelines.train", _sets(*TINY, "data.source=files", f"data.clicks.path={out}/clicks.parquet",
                                               "run.name=tiny", f"run.output_dir={out}"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "tiny"


@pytest.fixture(scope="module")
def newer(bundle):
    """The bundle's log plus later clicks of its users on 5 items the bundle has never seen (all in the test split)."""
    import pandas as pd

    clicks = pd.read_parquet(bundle.parent / "clicks.parquet")
    users = clicks["user_id"].drop_duplicates().head(10).tolist()
    later = pd.DataFrame({"user_id": users, "item_id": [f"new{i % 5}" for i in range(10)],
                          "timestamp": clicks["timestamp"].max() + 1 + np.arange(10), "weight": np.float32(1.0)})
    path = bundle.parent / "newer.parquet"
    pd.concat([clicks, later], ignore_index=True).to_parquet(path, index=False)
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The out-of-core job's input: a small log (40 items) as Parquet shards."""
    from test_inputs_during_run import _clicks
    from test_out_of_core import _write

    folder = tmp_path_factory.mktemp("shards") / "clicks"
    _write(_clicks(), folder, "parquet", shards=2)
    return folder


# (module, arguments, Python run first, what the error line must contain); {tmp}, {ro}, {bundle}, {newer}, {shards}
# are filled in per test. The cases that train (or read the trained bundle) are marked slow.
CASES = {
    "missing config": ("pipelines.train", ["--config", "{tmp}/missing.yaml"], "",
                       "config file not found: {tmp}/missing.yaml"),
    "config is a directory": ("pipelines.train", ["--config", "{tmp}"], "", "{tmp}: Is a directory"),
    "bad yaml": ("pipelines.train", ["--config", "{tmp}/bad.yaml"], "",
                 "{tmp}/bad.yaml: not valid YAML: line 2, column 1"),
    "unknown --set key": ("pipelines.train", ["--set", "train.nope=1"], "", "train.nope: unknown key"),
    "bad --set value": ("pipelines.train", ["--set", "train.epochs=true"], "",
                        "train.epochs: expected an integer, got a boolean"),
    "output dir under a file": ("pipelines.train", ["--set", "run.output_dir={tmp}/bad.yaml/x"], "",
                                "{tmp}/bad.yaml/x: Not a directory"),
    "read-only output dir": ("pipelines.train", _sets(*TINY, "run.output_dir={ro}/runs"), "", "{ro}/runs: "),
    "tune space is a directory": ("pipelines.tune", ["--trials", "1", "--space", "{tmp}"], "", "{tmp}: Is a directory"),
    "serving -k 0": ("retrieval.serving", ["--bundle", "{tmp}", "--user-id", "u", "-k", "0"], "",
                     "-k must be at least 1, got 0"),
    "serving missing bundle": ("retrieval.serving", ["--bundle", "{tmp}/nothing", "--user-id", "u"], "",
                               "{tmp}/nothing"),
    "evaluate missing bundle": ("pipelines.evaluate", ["--run", "{tmp}"], "", "{tmp}: manifest.json cannot be loaded"),
    "export missing bundle": ("pipelines.export", ["--run", "{tmp}", "--out", "{tmp}/x"], "", "{tmp} is not a bundle"),
    "reload bad url": ("retrieval.cli", ["reload", "--bundle", "{tmp}", "--url", "nota-url"], "",
                       "--url 'nota-url' is not an http"),
    "serve missing bundle": ("retrieval.cli", ["serve", "--bundle", "{tmp}/nothing"], "", "{tmp}/nothing"),
    "IVF too large": ("pipelines.train",
                      _sets(*TINY, "index.factory=IVF200,Flat", "run.output_dir={tmp}/out", "run.name=ivf",
                            "train.checkpoint_every_steps=1"),
                      "", "index.factory IVF200,Flat needs at least 200 catalogue items to train its 200 lists "
                          "(FAISS wants ~39 per list); the catalogue has 100: use Flat or IVF<=2"),
    "IVF too large out of core": ("pipelines.train",
                                  _sets(*TINY, "data.source=files", "data.clicks.path={shards}",
                                        "data.out_of_core=true", "index.factory=IVF200,Flat",
                                        "run.output_dir={tmp}/out", "run.name=ivf",
                                        "train.checkpoint_every_steps=1"),
                                  "", "index.factory IVF200,Flat needs at least 200 catalogue items"),
    "run dir exists": ("pipelines.train", _sets(*TINY, "run.output_dir={bundle}/..", "run.name=tiny"), "",
                       "{bundle}"),
    "checkpoint on a full disk": ("pipelines.train",
                                  _sets(*TINY, "run.output_dir={tmp}/out", "run.name=full", "train.epochs=2",
                                        "train.checkpoint_every_steps=1"),
                                  DISK_FULL_CHECKPOINT, "No space left on device: free space on that disk"),
    "evaluate on new items": ("pipelines.evaluate",
                              ["--run", "{bundle}", "--out", "{tmp}/eval", *_sets("data.clicks.path={newer}")], "",
                              "10 test clicks name items missing from the catalogue (e.g. 'new0'), none with "
                              "training clicks: set evaluation.unseen_items=drop"),
    "evaluate on other data": ("pipelines.evaluate",
                               ["--run", "{bundle}", "--out", "{tmp}/eval",
                                *_sets("data.source=synthetic", "data.clicks=null", "data.synthetic.n_items=140")], "",
                               "some with training clicks: the catalogue (a re-evaluated bundle's index) must hold"),
    "reindex IVF too large": ("pipelines.export",
                              ["--run", "{bundle}", "--out", "{tmp}/x", *_sets("index.factory=IVF200,Flat")], "",
                              "index.factory IVF200,Flat needs at least 200 catalogue items"),
    "export to read-only out": ("pipelines.export", ["--run", "{bundle}", "--out", "{ro}/x"], "", "{ro}"),
    "export on a full disk": ("pipelines.export", ["--run", "{bundle}", "--out", "{tmp}/x"], DISK_FULL_EXPORT,
                              "manifest.json: No space left on device: free space on that disk"),
    "index on a full disk": ("pipelines.export", ["--run", "{bundle}", "--out", "{tmp}/x"], DISK_FULL_INDEX,
                             "index.faiss: No space left on device: free space on that disk"),
}
TRAINS = {"read-only output dir", "IVF too large", "IVF too large out of core", "run dir exists",
          "checkpoint on a full disk", "evaluate on new items",
          "evaluate on other data", "reindex IVF too large", "export to read-only out",
          "export on a full disk", "index on a full disk"}


@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=[pytest.mark.slow] if name in TRAINS else []) for name in CASES]
)
def test_entry_points_print_one_line_and_exit_2(case, tmp_path, request):
    module, args, patch, expected = CASES[case]
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    text = " ".join(args) + expected
    names = {"tmp": tmp_path}
    for name in ("ro", "bundle", "newer", "shards"):
        if "{" + name + "}" in text:
            names[name] = request.getfixturevalue({"ro": "read_only"}.get(name, name))
    done, ours = _run(module, [arg.format(**names) for arg in args], patch)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith("error: "), done.stderr[-3000:]
    assert expected.format(**names) in ours[0], ours
    if case.startswith("IVF"):  # the index check fires before training: no training log, no checkpoint
        assert "retrieval.jobs: training:" not in done.stderr, done.stderr[-3000:]
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob(".ivf.checkpoints*"))
    if "full disk" in case:  # a failed write leaves no half-written checkpoint or bundle behind
        assert not list(tmp_path.rglob("*_temp*")) and not (tmp_path / "x").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full") or not stat.S_ISCHR(os.stat("/dev/full").st_mode),
                    reason="needs the /dev/full device (Linux), whose writes fail with ENOSPC")
def test_a_faiss_index_written_to_a_full_disk_is_an_oserror_naming_the_file(tmp_path):
    """faiss.write_index reports a small index's failed flush only on stderr and returns; the write
    through Python's file layer raises ENOSPC, which an entry point prints as one line."""
    from retrieval.common.arrays import write_faiss_index

    index = faiss.IndexFlatIP(8)
    index.add(np.arange(80, dtype=np.float32).reshape(10, 8))
    with pytest.raises(OSError) as raised:
        write_faiss_index(index, "/dev/full")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == "/dev/full"
    assert user_message(raised.value) == ("/dev/full: No space left on device: "
                                          "free space on that disk or write elsewhere")
    write_faiss_index(index, tmp_path / "index.faiss")
    assert faiss.serialize_index(faiss.read_index(str(tmp_path / "index.faiss"))).tobytes() == \
        faiss.serialize_index(index).tobytes()


@pytest.mark.skipif(not os.path.exists("/dev/full") or not stat.S_ISCHR(os.stat("/dev/full").st_mode),
                    reason="needs the /dev/full device (Linux), whose writes fail with ENOSPC")
@pytest.mark.parametrize("name", ["index.faiss", "item_ids.parquet"])
def test_an_index_saved_onto_a_full_disk_names_the_file_it_could_not_write(tmp_path, monkeypatch, name):
    """Both files of an index go through Python's file layer: a full disk is ENOSPC naming the file, also for
    a small Parquet file, whose last flush error Arrow's own sink would drop (a truncated file, no error)."""
    import builtins

    from retrieval.common import arrays
    from retrieval.index import ItemIndex

    def full_disk(path, mode="r", *args, **kwargs):
        return builtins.open("/dev/full" if str(path).endswith(name) and "w" in mode else path, mode, *args, **kwargs)

    index = faiss.IndexFlatIP(4)
    index.add(np.eye(4, dtype=np.float32))
    monkeypatch.setattr(arrays, "open", full_disk, raising=False)
    with pytest.raises(OSError) as raised:
        ItemIndex(index, ["a", "b", "c", "d"], "Flat").save(tmp_path)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / name)
    monkeypatch.undo()
    ItemIndex(index, ["a", "b", "c", "d"], "Flat").save(tmp_path)
    assert list(ItemIndex.load(tmp_path).item_ids) == ["a", "b", "c", "d"]
