"""Errors a user fixes, and the one wrapper every entry point runs its main through.

Every entry point (``python -m pipelines.train|evaluate|export|tune``, the
``retrieval`` console script, ``python -m retrieval.serving``) runs its main
through ``run_main``:

* an error the user can fix is one line on stderr, ``error: <message>``, and
  exit status 2: a ``UserError`` (``ConfigError``, ``DataError``,
  ``BundleError``, ``RunExistsError``, ``TuneError``, ... subclass it), a
  missing, unreadable or misplaced file or directory, a full or read-only
  disk (``OSError`` with one of ``USER_ERRNOS``, also when TensorFlow's file
  system layer reports it);
* Ctrl-C (``KeyboardInterrupt``) is ``error: interrupted`` and status 130,
  as a shell reports a process killed by SIGINT;
* anything else (``TypeError``, ``AttributeError``, a ``ValueError`` from
  deep inside TensorFlow, ...) is a bug: Python's traceback and status 1,
  exactly as without the wrapper. A one-line "rerun with RETRIEVAL_DEBUG=1"
  would hide the one piece of evidence of a failure that may have taken an
  hour of training to reach and may not recur.

``RETRIEVAL_DEBUG=1`` in the environment re-raises user errors and Ctrl-C
too, for their traceback.

Foundation module: standard library only and nothing from the project, so every stage
(``native_logs``, which runs first, ``serving``, ``cli``, ``pipelines``) can use it.
"""

from __future__ import annotations

import difflib
import errno
import functools
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

DEBUG_ENV = "RETRIEVAL_DEBUG"
EXIT_USER_ERROR = 2  # as argparse exits on a bad command line
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process killed by Ctrl-C


def nearest_name(word: Any, choices: Iterable[Any]) -> str | None:
    """The one of ``choices`` closest to ``word`` (difflib ratio >= 0.6), for an error's "did you mean";
    None when none is that close. Every such suggestion (config keys, columns, query keys) reads it."""
    close = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=1, cutoff=0.6)
    return close[0] if close else None


def debugging() -> bool:
    """Whether ``RETRIEVAL_DEBUG`` is set (to anything but "" or "0"): tracebacks and library noise shown."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class EntryPoint(Protocol):
    """A decorated ``main``: ``main()`` reads ``sys.argv``, ``main([...])`` the given arguments."""

    def __call__(self, argv: Sequence[str] | None = None) -> int: ...


class UserError(Exception):
    """An error the user fixes (a path, a config key, the data, a bundle): the message says what.

    Entry points print it as one line, ``error: <message>``, and exit with
    status 2 (``run_main``). The project's error classes subclass it beside
    their builtin base (``class ConfigError(UserError, ValueError)``), so
    ``except ValueError`` still catches them.
    """



class RunExistsError(UserError, FileExistsError):
    """A run's name is taken: its directory exists and overwriting was not asked for, another process holds
    it, or its checkpoints cannot be resumed (``UnfinishedRunError``)."""


# errno -> what to do about it. An OSError with one of these comes from the environment the user
# controls (paths, permissions, disk space), not from a bug; the strerror says what happened.
USER_ERRNOS: dict[int, str] = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check its permissions or choose another path",
    errno.EPERM: "check its permissions or choose another path",
    errno.EROFS: "choose a path on a writable file system",
    errno.ENOSPC: "free space on that disk or write elsewhere",
    errno.EDQUOT: "free space under your quota or write elsewhere",
    errno.EFBIG: "write to a file system that takes larger files",
    errno.EISDIR: "a directory is where a file is expected: give a file",
    errno.ENOTDIR: "a file is where a directory is expected: give a directory",
    errno.EEXIST: "something is in the way: move it or choose another path",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ELOOP: "a symbolic link points back at itself: fix the link",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files: raise the limit (ulimit -n)",
}

# How TensorFlow's C++ file system layer words those errnos (it raises tf.errors.OpError subclasses,
# e.g. ResourceExhaustedError for ENOSPC, with "<path>; <strerror>" as the message).
_TF_STRERRORS = {os.strerror(code): code for code in USER_ERRNOS if code != errno.ENOENT}


def run_main(main: Callable[[Any], int | None], argv: Sequence[str] | None = None) -> int:
    """``main(argv)``'s exit status; a user error or Ctrl-C is one line on stderr instead of a traceback.

    Returns ``main``'s own status (None counts as 0), 2 after a user error
    (``user_message``), 130 after Ctrl-C. Any other exception propagates
    (traceback, status 1); so does ``SystemExit`` (argparse's usage errors).
    With ``RETRIEVAL_DEBUG=1`` user errors and Ctrl-C propagate too.
    """
    debug = debugging()
    try:
        return main(argv) or 0
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        message = user_message(error)
        if message is None or debug:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


def user_message(error: BaseException) -> str | None:
    """The one-line message of an error the user can fix; None for anything else (a bug).

    Multi-line messages (a config with several invalid keys) are joined into
    one line: ``<first line>: <second>; <third>; ...``.
    """
    if isinstance(error, UserError):
        return one_line(str(error))
    if isinstance(error, shutil.Error):  # copytree's list of (source, destination, reason)
        problems = error.args[0] if error.args and isinstance(error.args[0], list) else []
        if not problems:
            return one_line(str(error))
        source, destination, reason = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return one_line(f"copying {source} to {destination}: {reason}{more}")
    if isinstance(error, OSError):
        return _os_message(error)
    return _tensorflow_message(error)


def one_line(text: str) -> str:
    """``text`` on one line: the first line, then ``: `` and the others (stripped) joined by ``; ``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else text
    head = lines[0] if lines[0].endswith(":") else lines[0] + ":"
    return f"{head} {'; '.join(lines[1:])}"


_PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def _os_message(error: OSError) -> str | None:
    # Raised with a message of our own (FileNotFoundError("<dir> is not a bundle: ...")): it says it all.
    if error.strerror is None and isinstance(error, _PATH_ERRORS):
        return one_line(str(error))
    if error.errno not in USER_ERRNOS:
        return None
    where = " -> ".join(str(name) for name in (error.filename, error.filename2) if name is not None)
    what = error.strerror or os.strerror(error.errno)
    return one_line(f"{where + ': ' if where else ''}{what}: {USER_ERRNOS[error.errno]}")


def _tensorflow_message(error: BaseException) -> str | None:
    tf = sys.modules.get("tensorflow")  # not imported: not raised by TensorFlow
    errors = getattr(tf, "errors", None)
    if errors is None or not isinstance(error, errors.OpError):
        return None
    text = one_line(str(getattr(error, "message", error)))
    for strerror, code in _TF_STRERRORS.items():
        if strerror in text:
            return f"{text}: {USER_ERRNOS[code]}"
    return None


def yaml_problem(error: Exception) -> str:
    """A ``yaml.YAMLError`` on one line: ``line L, column C: <problem> (<context>)``.

    PyYAML's own text spans five lines (a copy of the line and a caret under
    the column), which a one-line error cannot hold.
    """
    problem = getattr(error, "problem", None)
    if problem is None:
        return one_line(str(error))
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and start is not None:
        context += f" from line {start.line + 1}, column {start.column + 1}"
    return f"{where}{problem}" + (f" ({context})" if context else "")


def entry_point(main: Callable[[Any], int | None]) -> EntryPoint:
    """Decorate an entry point's ``main(argv)`` so that it runs through ``run_main``.

    The decorated ``main`` returns the exit status (for ``sys.exit`` or a
    console script) and can be called in-process (tests) with the same result.
    """

    @functools.wraps(main)
    def wrapped(argv: Sequence[str] | None = None) -> int:
        return run_main(main, argv)

    return wrapped
