"""The router's front door: body nesting, numbers and shape are refused with the field named,
before anything reaches a part (`serving.request_body`)."""

from __future__ import annotations

import json

import pytest

from ipnext.serving.request_body import BodyError, check_json_depth, first_non_finite, parse_request_body


def test_nesting_is_counted_without_parsing_and_strings_do_not_count() -> None:
    check_json_depth(b'{"inputs": [[1]]}', 3)
    with pytest.raises(BodyError, match="nested 4 levels deep; at most 3") as err:
        check_json_depth(b'{"inputs": [[[1]]]}', 3)
    assert err.value.status == 400
    # Brackets inside strings (escaped quotes too) are text, not nesting.
    check_json_depth(b'{"inputs": "[[[[[[\\"[[[[", "key": "{{{{"}', 2)
    check_json_depth(b"", 1)


def test_a_body_deep_enough_to_crash_the_parser_is_refused_before_it() -> None:
    deep = b'{"inputs": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with pytest.raises(RecursionError):
        json.loads(deep)  # what the router did before: a 500 with a traceback
    with pytest.raises(BodyError, match="nested 200001 levels deep; at most 32"):
        parse_request_body(deep, 32)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"inputs": {"user": 1e999, "items": [1]}}', "inputs.user"),
        (b'{"inputs": {"user": -1e999}}', "inputs.user"),
        (b'{"inputs": {"user": {"features": [0.5, NaN, 1]}}}', "inputs.user.features[1]"),
        (b'{"inputs": [[1, 2], [3, Infinity]]}', "inputs[1][1]"),
        (b'{"inputs": {"a": [{"b": -Infinity}]}}', "inputs.a[0].b"),
    ],
)
def test_non_finite_numbers_are_refused_with_their_path(body: bytes, field: str) -> None:
    with pytest.raises(BodyError) as err:
        parse_request_body(body, 32)
    assert err.value.status == 400
    assert err.value.message.startswith(f"{field}: not a finite number"), err.value.message


def test_finite_bodies_pass_unchanged() -> None:
    body = parse_request_body(b'{"inputs": {"user": 3, "items": [1, 2.5e3, -0.0]}, "key": "u-7"}', 32)
    assert body == {"inputs": {"user": 3, "items": [1, 2500.0, -0.0]}, "key": "u-7"}
    assert first_non_finite({"a": [1, 2.0, "NaN", None, True]}, "inputs") is None  # a string is not a number


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"not json", "body is not JSON"),
        (b"\xff\xfe", "body is not JSON"),
        (b"[1, 2]", "body must be a JSON object"),
        (b'{"input": 1}', "body must be a JSON object"),
        (b'{"inputs": 1, "key": 5}', "key: 5 is not a string"),
    ],
)
def test_malformed_bodies_are_the_callers_mistake(body: bytes, words: str) -> None:
    with pytest.raises(BodyError, match=words) as err:
        parse_request_body(body, 32)
    assert err.value.status == 400
