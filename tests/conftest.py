"""Shared fixtures: one Engine with the tiny Qwen3 loaded, built once per test session on CPU."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

# Hermetic Hugging Face cache for the whole test run and every server it starts: the SmolLM2 load
# writes its tokenizer alias there (engine/model/hub_alias.py), and nothing may read or write the
# developer's own cache. Set before transformers is imported: huggingface_hub reads it at import.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="tinkerd-test-hf-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)

import pytest
import torch

from tests import serverproc
from tinkerd.engine.engine import Engine, ModelRuntime
from tinkerd.engine.model.registry import cache_dir_for

TINY_QWEN3 = "tinkerd/tiny-qwen3"


@pytest.fixture(scope="session", autouse=True)
def torch_threads():
    # One intra-op thread: the tiny model gains little from more (measured on 2 cores: 11.6 s vs 8.0 s
    # for the engine tests), while OpenMP threads spin-waiting against another busy process (a second
    # test run, a dev server) made single training steps 10-50x slower.
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def quiet_sdk_after_the_tests():
    yield
    # SDK clients that tests leave open keep heart-beating from daemon threads after their servers
    # are gone; once pytest has closed its output streams, their warnings print "Logging error".
    logging.getLogger("tinker").setLevel(logging.CRITICAL)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session", autouse=True)
def servers_share_models(models_dir):
    """Every server the tests start links its data dir's models/ to the session's (serverproc.py)."""
    serverproc.share_models(models_dir)
    yield
    serverproc.share_models(None)


@pytest.fixture(scope="session")
def engine(models_dir) -> Engine:
    """Shared across tests: use a unique model_id per test, and never unload the base model."""
    eng = Engine(models_dir)
    eng.load_base_model(TINY_QWEN3)
    return eng


@pytest.fixture(scope="session")
def bf16_session_engine(models_dir) -> Engine:
    """A `--dtype bfloat16` engine shared like `engine`: bf16 base, fp32 master adapters."""
    from tinkerd.engine.precision import Precision

    eng = Engine(models_dir, precision=Precision("cpu", "bfloat16"))
    eng.load_base_model(TINY_QWEN3)
    return eng


@pytest.fixture(scope="session")
def tiny_runtime(engine) -> ModelRuntime:
    return engine.runtime(TINY_QWEN3)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_runtime, models_dir):
    """The built tiny model on disk, for loading an independent HF reference copy."""
    return cache_dir_for(TINY_QWEN3, models_dir)


@pytest.fixture(scope="session")
def pg_server_url():
    """A real PostgreSQL server for the session (tests/postgres.py): $TINKERD_TEST_PG_URL, or a
    throwaway cluster started here and stopped at the end."""
    from tests.postgres import Cluster

    if os.environ.get("TINKERD_TEST_PG_URL"):
        yield os.environ["TINKERD_TEST_PG_URL"]
        return
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster.url()
    finally:
        cluster.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty store URL on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db.sqlite'}"
    from tests.postgres import fresh_database

    return fresh_database(request.getfixturevalue("pg_server_url"))
