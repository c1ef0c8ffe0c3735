"""The C-level fast paths of a request's checks give the answers of the item-by-item rules they skip.

A 200-item history is read in one pass each: the body's lone-surrogate walk is skipped where the
bytes cannot hold one (``inputs._only_text``), a list input's element types are taken as a set
(``queries._is_id_list``) and its strings are checked for UTF-8 joined (``queries._not_unicode``).
Each is compared here with the rule written out item by item.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from starlette.exceptions import HTTPException

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.serving.http.inputs import _not_text, _only_text, _parse_object
from retrieval.serving.queries import _is_id_list, _not_unicode

HISTORY = [f"item{i}" for i in range(200)]
BODIES = [
    json.dumps({"query": {"history": HISTORY}, "k": 10, "history_order": "newest_first"}).encode(),
    b'{"query": {"history": ["a", "\\ud800"]}}',  # an escaped lone surrogate
    b'{"query": {"history": ["a", "\\u00e9"]}}',  # an escaped letter: text
    b'{"query": {"history": ["a", "\\\\ud800"]}}',  # an escaped backslash, then "ud800": text
    '{"query": {"history": ["é"]}}'.encode(),  # UTF-8 text
    b'{"query": {"history": ["\xed\xa0\x80"]}}',  # a surrogate's UTF-8 bytes, which json.loads lets through
    '{"query": {"history": ["a"]}}'.encode("utf-16-le"),
    '{"query": {"history": ["\ud800"]}}'.encode("utf-16-le", "surrogatepass"),
    '{"query": {"\ud800": 1}}'.encode("utf-32", "surrogatepass"),
]


@pytest.mark.parametrize("body", BODIES)
def test_a_body_skips_the_surrogate_walk_only_where_the_walk_finds_nothing(body):
    walked = _not_text(json.loads(body), "")  # the reference: every key and string looked at
    if _only_text(body):
        assert walked is None
    if walked is None:
        assert _parse_object(body) == json.loads(body)
    else:
        with pytest.raises(HTTPException) as refused:
            _parse_object(body)
        assert refused.value.status_code == 422 and "lone surrogate" in refused.value.detail


def test_an_ascii_history_needs_no_walk_and_an_escape_does():
    assert _only_text(BODIES[0])
    assert not _only_text(BODIES[1]) and not _only_text(BODIES[2])


@pytest.mark.parametrize("value", [
    HISTORY, [1, 2, 3], ["a", 7], [], ("a", "b"), [np.str_("a"), "b"], [True], ["a", False], [np.int64(3)],
    ["a", 1.0], ["a", None], [["a"]], "abc", b"abc", {"a": 1}, 7, None,
])
def test_a_list_input_is_accepted_exactly_where_each_element_is_a_string_or_an_int(value):
    def reference(value):
        from collections.abc import Sequence

        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            return False
        return not any(isinstance(v, bool) or not isinstance(v, str | int) for v in value)

    assert _is_id_list(value) == reference(value)


@pytest.mark.parametrize("value", [
    HISTORY, ["é", "ü"], ["a", "\ud800"], ["\ud800", "\udc00"], ["\udc00"], [1, "\ud800"], [1, "a"], [],
    "\ud800", "plain", 5, None, [["\ud800"]],
])
def test_a_history_is_not_unicode_exactly_where_one_of_its_strings_is_not(value):
    values = value if isinstance(value, list) else [value]

    def encodes(text):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True

    reference = any(isinstance(text, str) and not encodes(text) for text in values)
    assert _not_unicode(value) == reference
