"""A run directory written atomically: a scratch directory renamed into place, its name locked.

Everything is written under a hidden ``.<run>.partial-<pid>`` directory next
to the final one and renamed into place at the end, so a crash never leaves a
half bundle under the final name; ``.<run>.lock`` holds the name meanwhile.
The manifest is written last, so a scratch directory holding one (whose
fingerprints check) is a complete bundle: ``atomic_directory`` puts it back
under the final name when an overwrite was interrupted between its renames.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from retrieval.bundle.fingerprints import check_fingerprints
from retrieval.bundle.manifest import MANIFEST_FILE
from retrieval.common.errors import RunExistsError
from retrieval.common.lock import exclusive_lock

log = logging.getLogger("retrieval.bundle")


@contextmanager
def atomic_directory(final: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a scratch directory that becomes ``final`` only if the block succeeds.

    The name is locked (``flock`` on ``.<name>.lock`` beside it) for the whole
    block, so two jobs writing the same run cannot both finish: the second one
    fails at once instead of silently replacing the first one's result.
    ``overwrite`` replaces only an existing bundle (a directory holding
    ``manifest.json``); anything else at ``final`` is never deleted.

    On an exception the scratch directory is deleted (a failed run cannot be
    resumed from it: resuming uses the checkpoints) and ``final`` is
    untouched. Scratch directories of ``final`` left by processes that no
    longer run (killed with SIGKILL, so nothing cleaned up) are deleted, but
    first, when ``final`` is absent and some of them hold a complete bundle
    (an overwrite killed between moving the old bundle aside and moving the
    new one in), the newest of those (by its manifest's ``created_at``) is
    put back under ``final`` (``_recover_interrupted_swap``).

    Raises:
      RunExistsError: ``final`` exists and ``overwrite`` is false, or it
        exists and is not a bundle, or another process holds the name.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _name_lock(final):
        _recover_interrupted_swap(final)
        _check_replaceable(final, overwrite)
        for stale in _dead_scratch(final):
            shutil.rmtree(stale, ignore_errors=True)
        scratch = final.parent / f".{final.name}.partial-{os.getpid()}"
        if scratch.exists():
            shutil.rmtree(scratch)
        scratch.mkdir()
        try:
            yield scratch
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        # Again before deleting anything: the lock binds jobs, not a person or tool that created it meanwhile.
        _check_replaceable(final, overwrite)
        if final.exists():
            # Swap: move the old one aside first so a crash here still leaves one
            # complete bundle under some name.
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            final.rename(old)
            scratch.rename(final)
            shutil.rmtree(old)
        else:
            scratch.rename(final)


def _dead_scratch(final: Path) -> list[Path]:
    """``.<name>.partial-<pid>`` and ``.<name>.old-<pid>`` beside ``final`` whose process no longer runs."""
    dead = []
    for stale in [*final.parent.glob(f".{final.name}.partial-*"), *final.parent.glob(f".{final.name}.old-*")]:
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
            dead.append(stale)
    return dead


def _recover_interrupted_swap(final: Path) -> None:
    """Put the newest complete bundle left by dead processes back under ``final`` when ``final`` is absent.

    The overwrite swap renames ``final -> .<name>.old-<pid>`` and then ``scratch -> final``: a
    process killed between the two leaves no ``final`` and two complete bundles beside it.
    """
    if final.exists() or final.is_symlink():
        return
    complete = []
    for stale in _dead_scratch(final):
        manifest = _complete_bundle_manifest(stale)
        if manifest is not None:
            created = str(manifest.get("created_at", ""))
            complete.append((created, (stale / MANIFEST_FILE).stat().st_mtime, stale.name, stale))
    if complete:
        chosen = max(complete)[-1]
        chosen.rename(final)
        log.warning(
            "%s was missing and %s held a complete bundle (an overwrite was interrupted between its two renames): "
            "moved it back to %s", final, chosen.name, final.name,
        )


def _complete_bundle_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of ``directory`` if it is a complete bundle, else None.

    The manifest is written last, so one that parses says the rest was written; with
    fingerprints (format 2) the files are checked against them too (quick mode).
    """
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        if not isinstance(manifest, dict):
            return None
        if "fingerprints" in manifest:
            check_fingerprints(directory, manifest)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def _check_replaceable(final: Path, overwrite: bool) -> None:
    if not (final.exists() or final.is_symlink()):
        return
    if not overwrite:
        raise RunExistsError(f"{final} already exists; choose another run.name or set run.overwrite=true")
    if final.is_symlink() or not (final / MANIFEST_FILE).is_file():
        raise RunExistsError(
            f"{final} exists and is not a run bundle (no {MANIFEST_FILE}); run.overwrite replaces only a "
            "bundle, so nothing was deleted: choose another run.name or move it away"
        )


def _name_lock(final: Path) -> AbstractContextManager[None]:
    """Hold ``.<name>.lock`` beside ``final`` (``exclusive_lock``); the file is removed on release."""
    path = final.parent / f".{final.name}.lock"
    return exclusive_lock(path, remove_on_release=True, held=lambda: RunExistsError(
        f"another process is writing run {final.name!r} in {final.parent} ({path} is locked); "
        "wait for it or choose another run.name"
    ))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True
