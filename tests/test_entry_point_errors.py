"""Entry points: a user error is one line ``error: ...`` and exit status 2, never a traceback."""

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

import retrieval  # noqa: F401
from retrieval.config import ConfigError
from retrieval.errors import DEBUG_ENV, run_main, user_message
from retrieval.index import check_index_fits

ROOT = Path(__file__).resolve().parents[1]
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


def _run(*args):
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    ours = [line for line in done.stderr.splitlines() if line.strip() and not NOT_OURS.match(line)]
    return done, ours


TINY = ["data.synthetic.n_users=120", "data.synthetic.n_items=60", "data.synthetic.mean_clicks_per_user=10",
        "train.epochs=1", "train.verbose=0", "model.embedding_dim=16"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        (["pipelines.train", "--config", "{tmp}/missing.yaml"], "config file not found: {tmp}/missing.yaml"),
        (["pipelines.train", "--config", "{tmp}"], "{tmp}: Is a directory"),
        (["pipelines.train", "--config", "{tmp}/bad.yaml"], "{tmp}/bad.yaml: not valid YAML: line 2, column 1"),
        (["pipelines.train", "--set", "train.nope=1"], "train.nope: unknown key"),
        (["pipelines.train", "--set", "run.output_dir={tmp}/bad.yaml/x"], "{tmp}/bad.yaml/x: Not a directory"),
        (["pipelines.tune", "--trials", "1", "--space", "{tmp}"], "{tmp}: Is a directory"),
        (["retrieval.serving", "--bundle", "{tmp}", "--user-id", "u", "-k", "0"], "-k must be a positive"),
        (["retrieval.serving", "--bundle", "{tmp}", "--user-id", "u"], "{tmp}: manifest.json cannot be loaded"),
        (["pipelines.evaluate", "--run", "{tmp}"], "{tmp}: manifest.json cannot be loaded"),
        (["pipelines.export", "--run", "{tmp}", "--out", "{tmp}/x"], "{tmp} is not a bundle"),
        (["retrieval.cli", "reload", "--bundle", "{tmp}", "--url", "nota-url"], "--url 'nota-url' is not an http"),
        (["pipelines.train", *(a for kv in [*TINY, "index.factory=IVF200,Flat", "run.output_dir={tmp}/out"]
                               for a in ("--set", kv))],
         "index.factory IVF200,Flat needs at least 200 catalogue items"),
    ],
)
def test_entry_points_print_one_line_and_exit_2(tmp_path, args, expected):
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    done, ours = _run(*(arg.format(tmp=tmp_path) for arg in args))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert len(ours) == 1 and ours[0].startswith("error: "), done.stderr
    assert expected.format(tmp=tmp_path) in ours[0], ours
    assert "retrieval: training:" not in done.stderr  # the index check fires before training
