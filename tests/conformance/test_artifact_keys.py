"""Op schema v2 (ArtifactStore keys, docs/op-contract.md) through the unmodified SDK: a data
directory written by the last tinkerd of op schema v1 (absolute paths in its op log and checkpoint
rows; unpacked from this repository's history) is opened by this one, killed with ops pending: the
run resumes with exactly the losses of an uninterrupted run, its old checkpoint loads, and its old
sampler samples as before the upgrade."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.conformance.test_op_log import ARGS, _client, _kill, _port
from tests.conformance.test_retention import ADAM, _batch, _train
from tests.history import assert_continues, checkout_of
from tests.serverproc import start_server

# The last commit of op schema v1 (TINKERD_OPLOG_V1_CHECKOUT: a checkout of it elsewhere).
OPLOG_V1_COMMIT = "08c2975a933dececd135198b5db2b2dcb8600b8f"
PROMPT = types.ModelInput.from_ints([5, 17, 99, 3])
PARAMS = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def v1_checkout(tmp_path_factory) -> Path:
    return checkout_of(OPLOG_V1_COMMIT, "op-log-v1", "TINKERD_OPLOG_V1_CHECKOUT", tmp_path_factory)


def _stored(data_dir: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(data_dir / "tinkerd.sqlite") as db:
        return db.execute(sql).fetchall()


def test_a_data_dir_of_op_schema_v1_resumes_loads_and_samples_after_the_upgrade(tmp_path, v1_checkout):
    assert not (v1_checkout / "tinkerd" / "artifacts.py").exists()  # the code before keys
    args = ARGS + _port()
    old = start_server(tmp_path, [TINY], args, launcher=["env", "-C", str(v1_checkout)], own_models=True)
    try:
        sc = _client(old)
        reference = _train(sc.create_lora_training_client(base_model=TINY, rank=8, seed=7).result(), range(5))
        tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=7).result()
        first = _train(tc, range(2))
        state = tc.save_state("mid").result().path
        sampler_path = tc.save_weights_for_sampler("s").result().path
        sampled = sc.create_sampling_client(model_path=sampler_path).result().sample(PROMPT, 1, PARAMS).result()
        # Accepted and killed at once: these may still be pending in the v1 log, and run after the upgrade.
        fb = tc.forward_backward(_batch(2), "cross_entropy")
        step = tc.optim_step(ADAM)
        _kill(old)
        # The v1 form: absolute directories in the op records and the checkpoint rows.
        assert {v for (v,) in _stored(tmp_path, "SELECT op_version FROM futures")} == {1}
        assert all(d.startswith("/") for (d,) in _stored(tmp_path, "SELECT dir_path FROM checkpoints"))
        new = start_server(tmp_path, [TINY], args)
        try:
            step.result()
            rest = [fb.result().metrics["loss:sum"]] + _train(tc, range(3, 5))
            assert {v for (v,) in _stored(tmp_path, "SELECT op_version FROM futures")} == {1, 2}
            sc = _client(new)
            again = sc.create_sampling_client(model_path=sampler_path).result().sample(PROMPT, 1, PARAMS).result()
            assert again.sequences[0].tokens == sampled.sequences[0].tokens
            # The v1 row's checkpoint loads: the load op carries its key, and the run trains on from it.
            loaded = sc.create_training_client_from_state_with_optimizer(state).result()
            assert_continues([], _train(loaded, range(2, 5)), reference[2:])
        finally:
            new.stop()
    finally:
        old.stop()
    assert_continues(first, rest, reference)
