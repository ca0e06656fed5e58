"""The JSON depth pre-scan (api/deps.py: check_json_depth): deep bodies are a 400 `user` error naming
the limit before any parser recurses, brackets inside strings do not count, and the SDK's own
requests (5 levels at most) pass."""

from __future__ import annotations

import json

import pytest
from tinker import types as t

from tinkerd.api.deps import MAX_JSON_DEPTH, check_json_depth, load_json, parse
from tinkerd.errors import UserError


def nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * depth + close * depth).encode()


def objects(depth: int) -> bytes:
    return ('{"a":' * depth + "1" + "}" * depth).encode()


def test_depth_at_the_limit_passes_and_one_more_is_a_user_error_naming_it():
    for make in (nested, objects):
        check_json_depth(make(MAX_JSON_DEPTH))
        with pytest.raises(UserError) as info:
            check_json_depth(make(MAX_JSON_DEPTH + 1))
        assert info.value.status_code == 400 and f"{MAX_JSON_DEPTH} levels" in info.value.message


def test_the_count_is_exact_past_the_fast_path():
    # Many shallow brackets (past the "few brackets" shortcut) then a deep run; chunk borders crossed.
    shallow = b"[]," * 3_000_000
    check_json_depth(b"[" + shallow + nested(MAX_JSON_DEPTH - 1) + b"]")
    with pytest.raises(UserError):
        check_json_depth(b"[" + shallow + nested(MAX_JSON_DEPTH) + b"]")


@pytest.mark.parametrize("body", [
    json.dumps({"stop": ["[" * 1000, "{" * 1000]}).encode(),  # brackets in strings do not nest
    json.dumps({"s": '\\"' + "[" * 1000}).encode(),  # an escaped quote does not end the string
    json.dumps({"s": "\\\\", "t": "[" * 1000}).encode(),  # an escaped backslash does not escape the quote
])
def test_brackets_inside_strings_do_not_count(body):
    check_json_depth(body)


@pytest.mark.parametrize("body", [
    json.dumps({"s": "]" * 1000, "x": json.loads(nested(MAX_JSON_DEPTH + 1))}).encode(),  # closers in a string hide nothing
    json.dumps({"s": "\\\\", "x": json.loads(nested(MAX_JSON_DEPTH + 1))}).encode(),
])
def test_strings_do_not_hide_real_nesting(body):
    with pytest.raises(UserError):
        check_json_depth(body)


def test_parse_and_load_json_check_depth_before_parsing():
    deep = b'{"request_id": "x", "extra": ' + nested(5000) + b"}"
    with pytest.raises(UserError, match="levels deep"):
        parse(t.FutureRetrieveRequest, deep)
    with pytest.raises(UserError, match="levels deep"):
        load_json(nested(100_000))  # json.loads raised RecursionError here: a 500
    assert load_json(b"") == {}
    with pytest.raises(UserError, match="invalid JSON"):
        load_json(b"{")


def test_the_sdks_deepest_request_passes():
    # asample's prompt.chunks[].tokens[] and sampling_params.stop[]: 5 levels, the deepest measured.
    req = t.SampleRequest(prompt=t.ModelInput.from_ints(list(range(100))), num_samples=2,
                          sampling_params=t.SamplingParams(max_tokens=4, stop=["[[["]), base_model="m")
    body = req.model_dump_json().encode()
    assert parse(t.SampleRequest, body) == req
