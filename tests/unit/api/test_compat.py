"""Unknown request fields from a newer SDK are dropped; every other schema error still fails."""

from __future__ import annotations

import json

import pydantic
import pytest
from tinker import types as t

from tinkerd.api import compat


def body(obj) -> bytes:
    return json.dumps(obj).encode()


SESSION = {"tags": ["a"], "user_metadata": None, "sdk_version": "0.38.0"}


def test_a_top_level_unknown_field_is_dropped_and_named():
    req, ignored = compat.validate_lenient(t.CreateSessionRequest, body({**SESSION, "brand_new": {"x": 1}}))
    assert (req.tags, req.sdk_version) == (["a"], "0.38.0")
    assert ignored == ["brand_new"]


def test_a_known_request_passes_untouched():
    req, ignored = compat.validate_lenient(t.CreateSessionRequest, body(SESSION))
    assert ignored == [] and req.tags == ["a"]


def test_nested_unknown_fields_inside_lists_and_unions_are_dropped():
    # ModelInput's chunks are a plain union: pydantic tries every member and calls `tokens` "extra" to
    # the image ones; only the field no member knows is reported, by its place in the data.
    sample = {"num_samples": 1, "base_model": "m", "sampling_params": {"max_tokens": 4},
              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2], "new_chunk_field": True},
                                    {"type": "encoded_text", "tokens": [3], "new_chunk_field": 1}]}}
    req, ignored = compat.validate_lenient(t.SampleRequest, body(sample))
    assert [c.tokens for c in req.prompt.chunks] == [[1, 2], [3]] and req.sampling_params.max_tokens == 4
    assert ignored == ["prompt.chunks.new_chunk_field"]
    optim = {"model_id": "m", "seq_id": 1, "optim_params": {"learning_rate": 1e-3, "new_beta": 0.5}, "new_top": 1}
    req, ignored = compat.validate_lenient(t.OptimStepRequest, body(optim))
    assert req.optim_params.learning_rate == 1e-3
    assert ignored == ["new_top", "optim_params.new_beta"]


def test_a_wrong_type_is_still_an_error_even_beside_an_unknown_field():
    with pytest.raises(pydantic.ValidationError) as e:
        compat.validate_lenient(t.CreateSessionRequest, body({**SESSION, "tags": "not-a-list", "brand_new": 1}))
    assert any(err["loc"] == ("tags",) for err in e.value.errors())


def test_a_missing_required_field_is_still_an_error():
    with pytest.raises(pydantic.ValidationError):
        compat.validate_lenient(t.CreateSessionRequest, body({"tags": [], "brand_new": 1}))


def test_each_unknown_field_is_logged_once(caplog):
    caplog.set_level("WARNING", logger="tinkerd.api.compat")
    for _ in range(3):
        compat.validate_lenient(t.SessionHeartbeatRequest, body({"session_id": "s", "logged_once_field": 1}))
    lines = [r.getMessage() for r in caplog.records if "logged_once_field" in r.getMessage()]
    assert len(lines) == 1 and "SessionHeartbeatRequest.logged_once_field" in lines[0]


def test_session_warning_speaks_only_when_there_is_something_to_say():
    assert compat.session_warning(compat.SCHEMA_SDK_VERSION, []) is None
    assert compat.session_warning("0.36.0", []) is None
    newer = compat.session_warning("99.0.0", [])
    assert "99.0.0" in newer and "ignored" in newer
    assert "brand_new" in compat.session_warning(compat.SCHEMA_SDK_VERSION, ["brand_new"])
    assert compat.session_warning("not a version", []) is None
