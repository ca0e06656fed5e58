"""The typed op log (docs/op-contract.md) through the unmodified SDK against real servers: a run
accepted under one config recovers bit-exactly after a restart under another (a lower
--max-lora-rank), fails with the recorded reason while its base model is not served and comes back
when it is, and a data directory written by the code before the op log (raw request bodies in the
log: the last commit before it, unpacked from this repository's history) recovers after the upgrade."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
from pathlib import Path

import pytest
import tinker

from tests.conformance.conftest import TINY
from tests.conformance.test_retention import (  # the same SDK loop and data
    ADAM,
    _batch,
    _train,
)
from tests.history import assert_continues, checkout_of
from tinkerd.control.oplog import SCHEMA_VERSION
from tests.serverproc import API_KEY, logged_ops, start_server

LLAMA = "tinkerd/tiny-llama"
# Snapshots only at the first optim_step: a restart replays every op after it from the log.
ARGS = ["--threads", "1", "--snapshot-interval-s", "3600"]
# How the SDK surfaces a 400 (at submit) or a failed future.
REFUSED = (tinker.BadRequestError, tinker.RequestFailedError)
# The last commit before the op log, to write an old-form data directory with; unpacked from this
# repository's history (TINKERD_PRE_OPLOG_CHECKOUT: a checkout of it elsewhere).
PRE_OPLOG_COMMIT = "bc8f09fd255d6dba2f774a3ee6faa6bbd3b9d624"


@pytest.fixture(scope="module")
def old_checkout(tmp_path_factory) -> Path:
    return checkout_of(PRE_OPLOG_COMMIT, "pre-op-log", "TINKERD_PRE_OPLOG_CHECKOUT", tmp_path_factory)


def _port() -> list[str]:
    """A fixed port for a test's servers: the SDK clients keep talking to it across the restarts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return ["--port", str(s.getsockname()[1])]


def _client(srv) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)


def _kill(srv) -> None:
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait()


def _op_versions(data_dir: Path, model_id: str) -> set:
    return {r.op_version for r in logged_ops(data_dir, model_id)}


def test_a_run_recovers_exactly_after_lowering_max_lora_rank(tmp_path):
    args = ARGS + _port()
    srv = start_server(tmp_path, [TINY], args)
    try:
        sc = _client(srv)
        reference = _train(sc.create_lora_training_client(base_model=TINY, rank=8, seed=5).result(), range(6))
        tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=5).result()
        first = _train(tc, range(3))
        _kill(srv)
        srv = start_server(tmp_path, [TINY], args + ["--max-lora-rank", "4"])
        rest = _train(tc, range(3, 6))  # the same client: its seq_ids go on
        assert not [line for line in srv.lines if "replay of" in line or "cannot be rebuilt" in line]
        # Today's limit still holds for new work: only what was accepted under the old one replays.
        with pytest.raises(REFUSED, match="LoRA rank must be between 1 and 4"):
            _client(srv).create_lora_training_client(base_model=TINY, rank=8).result()
    finally:
        srv.stop()
    assert first + rest == reference


def test_a_run_of_a_base_model_no_longer_served_fails_with_the_recorded_reason_until_it_is(tmp_path):
    args = ARGS + _port()
    srv = start_server(tmp_path, [TINY, LLAMA], args)
    try:
        sc = _client(srv)
        reference = _train(sc.create_lora_training_client(base_model=LLAMA, rank=4, seed=3).result(), range(4))
        tc = sc.create_lora_training_client(base_model=LLAMA, rank=4, seed=3).result()
        first = _train(tc, range(2))
        _kill(srv)
        srv = start_server(tmp_path, [TINY], args)
        with pytest.raises(REFUSED, match=f"trained on {LLAMA}, which this server does not serve now"):
            tc.forward_backward(_batch(2), "cross_entropy").result()
        srv.stop()
        srv = start_server(tmp_path, [TINY, LLAMA], args)  # served again: the record goes, the run resumes
        rest = _train(tc, range(2, 4))
    finally:
        srv.stop()
    assert first + rest == reference


def test_a_data_dir_written_before_the_op_log_recovers_after_the_upgrade(tmp_path, old_checkout):
    assert (old_checkout / "tinkerd" / "api" / "replay.py").is_file()  # the raw-body log's code
    # The old code, run from its own checkout (python -m finds the cwd's tinkerd first).
    args = ARGS + _port()
    old = start_server(tmp_path, [TINY], args, launcher=["env", "-C", str(old_checkout)], own_models=True)
    try:
        sc = _client(old)
        reference = _train(sc.create_lora_training_client(base_model=TINY, rank=8, seed=7).result(), range(6))
        tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=7).result()
        first = _train(tc, range(3))
        # Accepted and killed at once: these may still be pending in the old log, and run after the upgrade.
        fb = tc.forward_backward(_batch(3), "cross_entropy")
        step = tc.optim_step(ADAM)
        _kill(old)
        with sqlite3.connect(tmp_path / "tinkerd.sqlite") as db:  # the old form: raw request bodies, no version
            assert "op_version" not in {c[1] for c in db.execute("PRAGMA table_info(futures)")}
        new = start_server(tmp_path, [TINY], args)
        try:
            step.result()
            rest = [fb.result().metrics["loss:sum"]] + _train(tc, range(4, 6))
            assert any("converted" in line and f"op schema v{SCHEMA_VERSION}" in line for line in new.lines)
            assert _op_versions(tmp_path, tc.model_id) == {SCHEMA_VERSION}  # converted on start, and new ops logged typed
        finally:
            new.stop()
    finally:
        old.stop()
    assert_continues(first, rest, reference)
