"""A base model named by its hub id on a machine that cannot reach the hub (engine/model/hub.py):
it loads from the Hugging Face cache, or fails at once naming what is missing, and never asks the
hub (huggingface_hub would retry it for 23 s to minutes first)."""

from __future__ import annotations

import shutil
import socket

import pytest

from tinkerd.engine.model import hub, registry
from tinkerd.errors import UserError

TINY = "tinkerd/tiny-qwen3"


def _never(*args, **kwargs):
    raise AssertionError("the hub was asked")


@pytest.fixture
def no_hub(monkeypatch, models_dir):
    registry.load_model(TINY, models_dir)  # built before any lookup is refused
    monkeypatch.setattr(hub, "unreachable", lambda: True)
    monkeypatch.setattr(socket, "getaddrinfo", _never)  # any lookup of a host fails the test


def test_an_uncached_hub_name_fails_at_once(no_hub, tmp_path):
    with pytest.raises(UserError, match=r"'someone/not-cached'.*not in this machine's Hugging Face cache.*huggingface\.co"):
        registry.load_model("someone/not-cached", tmp_path / "models")
    with pytest.raises(UserError, match="not in this machine's Hugging Face cache"):
        registry.load_model("not a valid repo id!!", tmp_path / "models")


def test_a_cached_hub_model_loads_from_the_cache(no_hub, tmp_path, models_dir, monkeypatch):
    from huggingface_hub import constants

    built = registry.load_model(TINY, models_dir)  # the tiny model's files, as a hub snapshot
    cache = tmp_path / "hub"
    repo = cache / "models--someone--cached-tiny"
    snapshot = repo / "snapshots" / ("ab" * 20)
    shutil.copytree(built.tokenizer_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    loaded = registry.load_model("someone/cached-tiny", tmp_path / "models")
    assert loaded.tokenizer_id == "someone/cached-tiny"  # what get_info reports
    assert loaded.tokenizer_dir == str(snapshot)  # later tokenizer loads read the cache, not the hub
    for got, want in zip(loaded.model.state_dict().values(), built.model.state_dict().values()):
        assert got.equal(want)

    (snapshot / "model.safetensors").unlink()  # a partial entry (an offline source's alias has no weights)
    with pytest.raises(UserError, match="from the Hugging Face cache"):
        registry.load_model("someone/cached-tiny", tmp_path / "models")


def test_hf_hub_offline_means_unreachable_without_a_connection(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket, "create_connection", _never)
    assert hub.unreachable()
