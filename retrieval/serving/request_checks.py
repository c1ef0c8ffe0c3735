"""The rules of a serving request, stated once: the Python API (``retrieval.serving.Bundle``), the
command line (``retrieval recommend``, ``retrieval.serving.batch``) and the HTTP service
(``retrieval.serving.http``) all call these functions, so an argument means the same thing everywhere.

- An id (a user id, an item id) is a string or an integer; an integer is read as its decimal string,
  for users and items alike (``494`` names item ``"494"``). Anything else (a float, a bool, None, a
  list) is refused.
- A list of ids (``exclude_item_ids``) is a list, tuple, set or array of ids; None means none. A
  bare string is refused: iterating it would read one id per character.
- ``k`` is an integer (not a bool, not ``"10"``, not ``2.5``) of at least 1. A k above the catalogue
  size is capped at it: no answer can hold more items than the catalogue has, and nothing is
  allocated for ranks that cannot exist.
- Query keys a bundle does not read are refused, with a "did you mean" for a near miss.

Every refusal is a ``RequestError``: a ``ValueError`` (the HTTP service answers 422) and a
``UserError`` (the command line prints one line and exits 2), naming the argument and the value.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from retrieval.common.errors import UserError, nearest_name


class RequestError(UserError, ValueError):
    """A request the bundle cannot answer as asked (an item id not in its catalogue, k below 1):
    one line naming the argument and the value. A ValueError, so the HTTP service answers it with a 422."""


def short(value: Any) -> str:
    """A bounded repr for error messages: a client's deeply nested or huge value is not echoed whole."""
    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxlist, bounded.maxdict, bounded.maxstring, bounded.maxother = 2, 4, 4, 40, 40
    return bounded.repr(value)


def is_id(value: Any) -> bool:
    """True for a value an id may be given as: a string, or an integer that is not a bool."""
    return isinstance(value, str) or (isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_))


def checked_id(value: Any, name: str) -> str:
    """An id (``str`` or ``int``) as the string the bundle stores; RequestError naming ``name`` otherwise."""
    if isinstance(value, str):
        return value
    if is_id(value):
        return str(int(value))
    raise RequestError(f"{name} must be an id (a string or an integer), got {short(value)}")


def checked_ids(value: Any, name: str) -> list[str]:
    """A list of ids (list, tuple, set or 1-d array; None: none) as strings, each as ``checked_id`` reads it.

    Raises:
      RequestError: naming ``name``: a bare string or bytes (not a list of ids), a mapping, a
        non-iterable, or an element that is no id (named by its position).
    """
    if value is None:
        return []
    if isinstance(value, str | bytes):
        return _not_a_list(value, name, f"a single string; wrap one id in a list: [{short(value)}]")
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        return _not_a_list(value, name, f"{type(value).__name__} {short(value)}")
    if isinstance(value, np.ndarray) and value.ndim != 1:
        return _not_a_list(value, name, f"an array of shape {value.shape}")
    return [checked_id(item, f"{name}[{position}]") for position, item in enumerate(value)]


def _not_a_list(value: Any, name: str, got: str) -> list[str]:
    raise RequestError(f"{name} must be a list of ids (or None for none), got {got}")


def checked_id_lists(value: Any, count: int, name: str) -> list[list[str]]:
    """One list of ids per query (``checked_ids`` each), ``count`` of them; None: ``count`` empty lists."""
    if value is None:
        return [[] for _ in range(count)]
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence | np.ndarray):
        raise RequestError(f"{name} must hold one list of ids per query ({count}), got {short(value)}")
    if len(value) != count:
        raise RequestError(f"{name} has {len(value)} lists for {count} queries")
    return [checked_ids(items, f"{name}[{position}]") for position, items in enumerate(value)]


def checked_k(k: Any, catalogue_size: int, name: str = "k") -> int:
    """``k`` (an int of at least 1, not a bool) capped at ``catalogue_size``; RequestError naming ``name`` otherwise."""
    if isinstance(k, bool | np.bool_) or not isinstance(k, int | np.integer):
        raise RequestError(f"{name} must be an integer (the number of items to return), got {short(k)}")
    if k < 1:
        raise RequestError(f"{name} must be at least 1, got {int(k)}")
    return int(min(int(k), max(catalogue_size, 1)))


def check_query_keys(
    query: Mapping[str, Any], known: Sequence[str], position: int, notes: Mapping[str, str] | None = None
) -> None:
    """Refuse a key of ``query`` outside ``known`` (the keys the bundle reads), with a "did you mean"
    for a near miss and ``notes[key]`` (why such a key is not read) when given.

    A key the bundle ignored would be ignored silently: a misspelt feature is then a missing one, and a
    ``history`` sent to a bundle that reads none would neither shape nor filter the answer.
    """
    for key in query:
        if key in known:
            continue
        near = nearest_name(key, known)
        note = (notes or {}).get(str(key))
        raise RequestError(f"query {position} has the key {short(key)}, which this bundle does not read "
                           f"(it reads {list(known)})" + (f": {note}" if note else "")
                           + (f"; did you mean {near!r}?" if near else ""))


def encodes_as_utf8(text: str) -> bool:
    """Whether UTF-8 can encode ``text`` (False for a lone surrogate, which JSON's ``\\ud800`` escape can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
