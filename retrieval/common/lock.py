"""The one file lock: an exclusive, non-blocking ``flock`` held for a block.

A run's name (``retrieval.bundle.run_directory``), its checkpoint directory
(``retrieval.training.checkpoint_directory``) and a tuning study (``retrieval.tuning.study``)
are each held by one process at a time: a second one fails at once with its
caller's error instead of waiting or writing over the first one's work. The
kernel releases a ``flock`` when its process dies, so a killed job leaves no
stale lock behind (at most the empty lock file).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive_lock(
    path: str | Path, *, held: Callable[[], BaseException], remove_on_release: bool = False
) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (created if absent) for the block.

    Args:
      path: the lock file; its directory must exist.
      held: builds the error raised (``from None``) when another process holds the lock, so
        that it names what is busy in the caller's words.
      remove_on_release: delete the lock file when the block ends. It is unlinked while still
        locked, so a process that opened it meanwhile finds, once it holds the lock, that the
        path names another file (or none) and retries on a fresh one: only one process ever
        holds the name.

    Raises:
      BaseException: ``held()``, when another process holds the lock.
    """
    path = Path(path)
    while True:
        handle = open(path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise held() from None
        try:
            same_file = os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        handle.close()  # the holder released and removed it between our open and flock: retry
    try:
        yield
    finally:
        if remove_on_release:
            path.unlink(missing_ok=True)
        handle.close()
