"""A run's checkpoint directory: located, locked, checked against the config and inputs, cleaned up.

The job (``retrieval.jobs``) asks ``training_checkpoints`` for the directory
``retrieval.training.fit`` saves into; an unfinished run of the same name is
resumed only when it trained the same thing on the same input files.

Under ``train.distribute: multi_worker`` the workers share one directory
(``train.checkpoint_dir``, a path every worker reads; without it they train
without checkpoints, and say so): the chief writes and cleans it up, every
worker checks it and restores from it (``retrieval.training.checkpoints``),
each under its own lock.
"""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from retrieval.common.atomic import atomic_file
from retrieval.common.errors import RunExistsError
from retrieval.common.lock import exclusive_lock
from retrieval.config import Config
from retrieval.data.fingerprint import FileFingerprint, InputsChangedError, changed_inputs, fingerprint_inputs
from retrieval.training.loop import TrainingDiverged
from retrieval.training.runtime import cluster_task

log = logging.getLogger("retrieval")


class UnfinishedRunError(RunExistsError):
    """An unfinished run of the same name cannot be resumed (other config, or in use)."""


# Config that may change between a killed run and its resume (None = the whole section): it
# does not change what is trained (the index, evaluation and export come after training).
_RESUME_IGNORES = {
    "run": None,
    "index": None,
    "evaluation": None,
    "export": None,
    "train": {"verbose", "resume", "checkpoint_every_seconds", "checkpoint_every_steps", "checkpoint_dir"},
}


def training_checkpoints(
    config: Config, name: str, cleanup: ExitStack, inputs: dict[str, FileFingerprint | None] | None = None
) -> Path | None:
    """The checkpoint directory of run ``name``, ready for ``fit``; None when checkpoints are off.

    ``<train.checkpoint_dir or run.output_dir>/.<name>.checkpoints``. It is
    locked (``flock``) while this process runs, checked against the config
    and the input files (``retrieval.data.fingerprint``: size, mtime and
    content hash of each file or shard) an earlier, killed attempt saved there
    (a resume must train the same thing on the same data) and, through
    ``cleanup``, deleted when the job succeeds. Hashing reads every input
    once more (about a second per 0.3-1 GB); ``inputs``, the job's
    ``RunInputs.fingerprints``, saves hashing them twice (None: hashed here).
    A job that fails because its inputs changed during the run
    (``InputsChangedError``) deletes them: they hold training on other data.

    Raises:
      UnfinishedRunError: the checkpoints there were written for another
        config or other input files (set ``train.resume=false`` to start
        over), or another live process is training this run.
    """
    train = config.train
    if not train.checkpoints:
        return None
    chief, lock_name = True, "lock"
    if train.distribute == "multi_worker":
        if train.checkpoint_dir is None:
            log.warning("train.distribute=multi_worker checkpoints need train.checkpoint_dir, one directory every "
                        "worker reads (the chief writes them, every worker restores from them): training without")
            return None
        kind, index, chief = cluster_task()
        lock_name = "lock" if chief else f"lock.{kind}{index}"
    directory = Path(train.checkpoint_dir or config.run.output_dir) / f".{name}.checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    cleanup.enter_context(exclusive_lock(directory / lock_name, held=lambda: UnfinishedRunError(
        f"another process is training run {name!r} ({directory} is locked)"
    )))
    current = _resume_view(config.to_dict())
    saved = directory / "config.json"
    inputs = fingerprint_inputs(config.data) if inputs is None else inputs
    saved_inputs = directory / "inputs.json"
    if _holds_checkpoints(directory):
        if not train.resume:
            if chief:  # the chief alone writes and deletes the directory
                log.info("train.resume=false: deleting the checkpoints of an unfinished run in %s", directory)
                for path in directory.iterdir():
                    if path.is_dir():
                        shutil.rmtree(path)
                    elif not path.name.startswith("lock"):
                        path.unlink()
        else:
            before = json.loads(saved.read_text()) if saved.exists() else {}
            changed = sorted(key for key in {*before, *current} if before.get(key) != current.get(key))
            if changed:
                raise UnfinishedRunError(
                    f"{directory} holds checkpoints of an unfinished run {name!r} with another config "
                    f"(differs at {', '.join(changed[:5])}); rerun with that config to resume it, or set "
                    "train.resume=false to start over, or choose another run.name"
                )
            _check_resumed_inputs(directory, name, saved_inputs, inputs)
            log.info("found checkpoints of an unfinished run %r in %s: resuming it", name, directory)
    if not chief:  # the chief writes and deletes the shared directory
        log.info("checkpoints in %s, written by the chief worker", directory)
        return directory
    _write_json(saved, current)
    _write_json(saved_inputs, inputs)
    every = " or ".join(
        part for part in (
            f"{train.checkpoint_every_seconds:g} s" if train.checkpoint_every_seconds else "",
            f"{train.checkpoint_every_steps} steps" if train.checkpoint_every_steps else "",
        ) if part
    )
    log.info("checkpoints every %s in %s (a killed run resumes when started again with run.name=%s)",
             every, directory, name)
    cleanup.push(lambda _type, error, _traceback: _after_training_job(directory, error))
    return directory


def _check_resumed_inputs(
    directory: Path, name: str, saved: Path, inputs: dict[str, FileFingerprint | None]
) -> None:
    """Raise ``UnfinishedRunError`` naming each input file that differs from the one the checkpoints saw."""
    if not saved.exists():  # written before inputs were recorded: refuse rather than guess
        changes = [f"{saved.name} is missing: the inputs of the unfinished run are unknown"]
    else:
        changes = changed_inputs(json.loads(saved.read_text()), inputs)
    if changes:
        listed = "".join(f"\n  {change}" for change in changes[:10])
        more = f"\n  ... and {len(changes) - 10} more" if len(changes) > 10 else ""
        raise UnfinishedRunError(
            f"{directory} holds checkpoints of an unfinished run {name!r} trained on other input files:"
            f"{listed}{more}\nrestore the file(s) to resume it, or set train.resume=false to start over, "
            "or choose another run.name"
        )


def _write_json(path: Path, value: Any) -> None:
    """``path`` holds ``value`` as JSON, written whole or not at all (a kill mid-write leaves the old file)."""
    with atomic_file(path) as partial:
        partial.write_text(json.dumps(value, sort_keys=True))


def _holds_checkpoints(directory: Path) -> bool:
    """A checkpoint was written: the final run's or the early-stopping selection's (a subdirectory).

    ``checkpoint`` is tf.train.CheckpointManager's index file.
    """
    return (directory / "checkpoint").exists() or any(directory.glob("*/checkpoint"))


def _after_training_job(checkpoint_dir: Path, error: BaseException | None) -> None:
    """Delete the checkpoints when the job succeeded or when there is nothing to resume from.

    A run whose loss diverged has nothing to resume: the same config trains to the same NaN
    (``TrainingDiverged``), and a changed one does not resume these checkpoints. A run whose
    inputs changed under it (``InputsChangedError``) trained on mixed data: resuming it would too.
    """
    if isinstance(error, TrainingDiverged):
        log.error("the loss diverged: the run's checkpoints in %s are deleted (a resume would diverge again)",
                  checkpoint_dir)
    elif isinstance(error, InputsChangedError):
        log.error("the inputs changed during the run: its checkpoints in %s are deleted (a resume would "
                  "train on mixed data)", checkpoint_dir)
    elif error is not None and _holds_checkpoints(checkpoint_dir):
        log.error(
            "the run failed; its checkpoints are kept in %s: run the same command again to resume, "
            "or set train.resume=false to start over", checkpoint_dir,
        )
        return
    shutil.rmtree(checkpoint_dir, ignore_errors=True)


def _resume_view(config: dict[str, Any]) -> dict[str, Any]:
    """The config flattened to ``section.key`` -> value, less the keys a resume may change."""
    flat = {}
    for section, values in config.items():
        ignored = _RESUME_IGNORES.get(section, set())
        if ignored is None:
            continue
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            if key not in ignored:
                flat[f"{section}.{key}"] = json.loads(json.dumps(value))
    return flat
