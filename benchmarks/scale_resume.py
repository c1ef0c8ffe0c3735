"""SIGKILL mid-epoch at scale (``bench_scale.py --resume-check N``): the job killed, restarted, and equal
to an uninterrupted run.

``tests/training/test_resume.py`` proves exact resume on a tiny log; this runs the
benchmark's own job (the 20M-click log streamed from its shards, the config
and overrides of the benchmark run) as ``python -m pipelines.train``
subprocesses, training capped at N batches an epoch so the check costs two
short jobs, not two long ones:

1. an uninterrupted run (the reference);
2. the same command killed by SIGKILL at its first checkpoint (every
   ``--resume-check-seconds`` of training), then started again: it must log
   "resuming from step S (epoch e/E, batch b/B)" and end with the reference's
   metrics (every figure, exactly), ``train_log.csv`` (byte for byte) and
   weights (every variable of both SavedModels, exactly).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_CHECKPOINT = re.compile(r'^model_checkpoint_path: "ckpt-(\d+)"', re.M)
_RESUMED = re.compile(r"resuming from step (\d+) \(epoch (\d+)/(\d+), batch (\d+)/(\d+)\)"
                      r"|early-stopping selection resumed \([^)]*\)")


def _latest_step(checkpoints: Path) -> int | None:
    """Newest checkpoint step in the run's checkpoint directory (its selection part included)."""
    steps = []
    for index in (checkpoints / "checkpoint", checkpoints / "selection" / "checkpoint"):
        if index.exists() and (match := _CHECKPOINT.search(index.read_text())):
            steps.append(int(match.group(1)))
    return max(steps) if steps else None


def _variables(saved_model: Path) -> dict[str, np.ndarray]:
    """Every variable a SavedModel stores, read from its variables checkpoint."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(saved_model / "variables" / "variables"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _max_difference(a: Path, b: Path) -> float:
    left, right = _variables(a), _variables(b)
    if left.keys() != right.keys():
        return float("inf")
    return max(_difference(left[k], right[k]) for k in left)


def _difference(a, b) -> float:
    """Largest absolute difference of two stored values; strings and bytes: 0 when equal, else inf."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return float("inf")
    if a.dtype.kind in "fiub" and b.dtype.kind in "fiub":
        return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
    return 0.0 if np.array_equal(a, b) else float("inf")


def _run(command: list[str], log_path: Path, kill_when=None, timeout: float = 3600) -> tuple[int, bool]:
    """Run ``command`` (stdout and stderr to ``log_path``); SIGKILL it once ``kill_when()`` is true.
    Returns (exit code, killed)."""
    with open(log_path, "a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        started = time.monotonic()
        while process.poll() is None:
            if kill_when is not None and kill_when():
                process.send_signal(signal.SIGKILL)
                process.wait()
                return process.returncode, True
            if time.monotonic() - started > timeout:
                process.kill()
                raise TimeoutError(f"{command} ran past {timeout} s (log: {log_path})")
            time.sleep(0.5)
    return process.returncode, False


def resume_check(config: str, overrides: list[str], output_dir: Path, name: str, *, batches: int,
                 checkpoint_seconds: int, log=print) -> dict:
    """The kill-and-resume check; the dict goes into the benchmark's JSON under ``resume_check``.

    Args:
      config, overrides: the benchmark run's config file and ``--set`` overrides (``run.name`` and
        ``run.output_dir`` are replaced).
      batches: training batches an epoch (``data.stream.max_train_batches``) of both runs.
      checkpoint_seconds: ``train.checkpoint_every_seconds`` of both runs.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    replaced = ("run.name=", "run.output_dir=", "data.stream.max_train_batches=")
    kept = [o for o in overrides if not o.startswith(replaced)]
    base = [*kept, f"run.output_dir={output_dir}", f"data.stream.max_train_batches={batches}",
            f"train.checkpoint_every_seconds={checkpoint_seconds}", "run.overwrite=true"]

    def command(run_name: str) -> list[str]:
        sets = [arg for o in [*base, f"run.name={run_name}"] for arg in ("--set", o)]
        return [sys.executable, "-m", "pipelines.train", "--config", config, *sets]

    result: dict = {"command_overrides": base, "max_train_batches": batches,
                    "checkpoint_every_seconds": checkpoint_seconds}
    clock = time.perf_counter()
    reference_log = output_dir / f"{name}-reference.log"
    reference_log.unlink(missing_ok=True)
    code, _ = _run(command(f"{name}-reference"), reference_log)
    if code != 0:
        raise RuntimeError(f"the reference run failed (rc {code}); see {reference_log}")
    result["reference_seconds"] = round(time.perf_counter() - clock, 1)
    log(f"resume check: reference run done in {result['reference_seconds']} s")

    killed_name = f"{name}-killed"
    killed_log = output_dir / f"{killed_name}.log"
    killed_log.unlink(missing_ok=True)
    checkpoints = output_dir / f".{killed_name}.checkpoints"
    clock = time.perf_counter()
    code, killed = _run(command(killed_name), killed_log, kill_when=lambda: (_latest_step(checkpoints) or 0) > 0)
    if not killed:
        raise RuntimeError(f"the run ended (rc {code}) before its first checkpoint; see {killed_log}")
    result["killed_at_checkpoint_step"] = _latest_step(checkpoints)
    result["killed_after_seconds"] = round(time.perf_counter() - clock, 1)
    log(f"resume check: killed at checkpoint step {result['killed_at_checkpoint_step']} "
        f"after {result['killed_after_seconds']} s")
    clock = time.perf_counter()
    code, _ = _run(command(killed_name), killed_log)
    if code != 0:
        raise RuntimeError(f"the resumed run failed (rc {code}); see {killed_log}")
    result["resumed_seconds"] = round(time.perf_counter() - clock, 1)
    return compare(output_dir / f"{name}-reference", output_dir / killed_name, killed_log, result, log)


def compare(reference: Path, again: Path, killed_log: Path, result: dict, log=print) -> dict:
    """The verdict: the resumed run (``again``) against the uninterrupted one (``reference``).

    ``result`` holds ``killed_at_checkpoint_step`` and ``max_train_batches``; the resume is mid-epoch
    when that step is not a multiple of the batches an epoch (an early-stopping selection resumed
    logs no batch position of its own).
    """
    resumed = _RESUMED.search(killed_log.read_text())
    result["resumed_line"] = resumed.group(0) if resumed else None
    step, batches = result["killed_at_checkpoint_step"], result["max_train_batches"]
    result["resumed_mid_epoch"] = bool(resumed) and step is not None and step % batches != 0
    ref_metrics = json.loads((reference / "metrics.json").read_text())
    new_metrics = json.loads((again / "metrics.json").read_text())
    result["metrics_equal"] = all(ref_metrics.get(r) == new_metrics.get(r) for r in ("model", "popularity"))
    result["model_recall@20"] = [ref_metrics["model"].get("recall@20"), new_metrics["model"].get("recall@20")]
    result["train_log_equal"] = (reference / "train_log.csv").read_bytes() == (again / "train_log.csv").read_bytes()
    from retrieval.bundle.saved_models import model_path  # imports TensorFlow, like _variables

    result["max_weight_difference"] = max(_max_difference(model_path(reference, part), model_path(again, part))
                                          for part in ("query_model", "doc_model"))
    result["exact"] = bool(result["metrics_equal"] and result["train_log_equal"]
                           and result["max_weight_difference"] == 0.0 and result["resumed_mid_epoch"])
    log(f"resume check: {json.dumps(result)}")
    return result


def markdown_row(check: dict) -> str:
    """One row of bench_scale's step table."""
    verdict = "exact" if check["exact"] else "NOT exact"
    return (
        f"| SIGKILL mid-epoch, resumed (training capped at {check['max_train_batches']} batches an epoch; "
        f"`--resume-check`) | killed at checkpoint step {check['killed_at_checkpoint_step']}; "
        f"{check['resumed_line']}; metrics equal: {check['metrics_equal']}, train_log.csv equal: "
        f"{check['train_log_equal']}, max weight difference {check['max_weight_difference']:g}: **{verdict}** |"
    )
