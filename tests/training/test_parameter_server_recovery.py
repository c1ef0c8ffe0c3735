"""train.distribute: parameter_server: a ps task killed mid-run stops the chief with a clear error,
and the job started again with the same run.name, on a cluster of another number of ps tasks,
resumes from the chief's last checkpoint.

A real localhost cluster (``pipelines.local_cluster.LocalCluster``: 2 workers, 2 ps tasks as
subprocesses); the chief is ``python -m pipelines.train`` with its TF_CONFIG.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from pipelines.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


NOISE = ("E0000", "W0000", "I0000", "Additional GRPC", ":UNKNOWN:", "This could happen")


def _readable(log: str) -> str:
    """The chief's output without gRPC's lines about the killed task (one for every remote call)."""
    return "\n".join(line for line in log.splitlines() if not line.startswith(NOISE))[-4000:]


def _chief(cluster: LocalCluster, out: Path) -> subprocess.Popen:
    flags = ["data.synthetic.n_users=600", "data.synthetic.n_items=300", "data.synthetic.mean_clicks_per_user=30",
             "train.epochs=3", "train.batch_size=256", "train.validation_fraction=0", "train.verbose=2",
             "train.checkpoint_every_steps=20", f"run.output_dir={out}", "run.name=resumed",
             "train.distribute=parameter_server", "train.parameter_server.max_shards=2",
             "train.parameter_server.min_shard_bytes=1024"]
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.train", "--config", str(ROOT / "configs" / "default.yaml"),
         *(f"--set={kv}" for kv in flags)],
        cwd=ROOT, env=cluster.environment("chief"), stderr=subprocess.PIPE, text=True,
    )


def test_a_killed_ps_task_stops_the_chief_and_the_job_resumes_on_another_cluster(tmp_path):
    out = tmp_path / "artifacts"
    checkpoints = out / ".resumed.checkpoints"
    with LocalCluster(workers=2, ps=2, log_dir=tmp_path / "tasks") as cluster:
        chief = _chief(cluster, out)
        deadline = time.monotonic() + 300
        # CheckpointManager's index file: a checkpoint (step 20) is completely written.
        while not (checkpoints / "checkpoint").exists():
            assert chief.poll() is None, _readable(chief.stderr.read() if chief.stderr else "")
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        cluster.kill("ps", 1)
        _, log = chief.communicate(timeout=300)
        assert chief.returncode == 2, _readable(log)
        assert "error: the parameter-server cluster failed by step" in log, _readable(log)
        assert "re-run the job with the same run.name" in log
        latest = tf.train.latest_checkpoint(str(checkpoints))  # the newest complete one
        assert latest is not None
        step = int(latest.rsplit("-", 1)[1])
        assert step % 20 == 0 and (checkpoints / f"state-{step}.json").exists()

    # Resumed on a new cluster with three ps tasks: the checkpoint holds each table whole, whatever
    # the tasks that held its shards.
    with LocalCluster(workers=2, ps=3, log_dir=tmp_path / "tasks-again") as cluster:
        again = _chief(cluster, out)
        _, log = again.communicate(timeout=400)
    assert again.returncode == 0, _readable(log)
    assert f"resuming from step {step}" in log, _readable(log)
    metrics = json.loads((out / "resumed" / "metrics.json").read_text())
    assert metrics["training"]["epochs"] == 3
    assert metrics["model"]["recall@20"] > 2 * metrics["popularity"]["recall@20"]
    assert not checkpoints.exists()  # deleted once the run directory is complete
