"""api/limits.py through the prepare functions, and what the upgrade of a pre-op-log data directory
(api/legacy.py) does with ops logged before the bounds."""

from __future__ import annotations

from types import SimpleNamespace

import json
import math

import pytest
from sqlalchemy import func, select

from tinkerd.artifacts import LocalArtifactStore
from tinkerd.api.deps import AppState
from tinkerd.api import legacy
from tinkerd.api.routes import training
from tinkerd.config import ServerConfig
from tinkerd.control.runs import Runs
from tinkerd.control.recovery import rebuild_work
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.futures import FutureRepository
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import UserError
from tinkerd.types import ServedModel

TINY = "tinkerd/tiny-qwen3"


@pytest.fixture
def st(tmp_path) -> AppState:
    runs = Runs(Store.sqlite(tmp_path / "db.sqlite"), LocalArtifactStore(tmp_path))
    served = {TINY: ServedModel(TINY, TINY, 4096, "qwen3")}
    # Of control, the upgrade uses only the op log's repository.
    control = SimpleNamespace(futures=FutureRepository(runs.store))
    return AppState(ServerConfig(data_dir=tmp_path), control, runs, served, None)


@pytest.fixture
def run_id(st) -> str:
    session = st.runs.sessions.create_session([], {}, "0.38.0")
    return st.runs.training_runs.create_run(session, 0, TINY, {"rank": 4, "seed": 1}, {})[0].model_id


def _body(**fields) -> bytes:
    return json.dumps(fields, allow_nan=True).encode()


def _optim(run_id: str, seq_id=1, **adam) -> bytes:
    return _body(model_id=run_id, seq_id=seq_id, adam_params={"learning_rate": 1e-3, **adam})


BAD_ADAM = {
    "learning_rate": [math.inf, math.nan, -1e-3],
    "eps": [0.0, -1e-8, math.inf],
    "weight_decay": [math.inf, -0.1, 1e300],
    "beta1": [1.0, -0.1, math.nan],
    "beta2": [1.0, 2.0],
    "grad_clip_norm": [-1.0, math.inf],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in BAD_ADAM.items() for v in vs])
def test_bad_adam_params_are_user_errors_naming_the_field(st, run_id, field, value):
    with pytest.raises(UserError, match=f"adam_params.{field}"):
        training.prepare_optim_step(st, _optim(run_id, **{field: value}))


@pytest.mark.parametrize("seq_id", [2**63, -(2**63) - 1, 2**64, -1])
def test_int64_edges_of_seq_id_and_model_seq_id(st, run_id, seq_id):
    with pytest.raises(UserError, match="seq_id"):
        training.prepare_optim_step(st, _optim(run_id, seq_id=seq_id))
    session = st.runs.training_runs.run(run_id).session_id
    create = _body(session_id=session, model_seq_id=seq_id, base_model=TINY, lora_config={"rank": 4})
    with pytest.raises(UserError, match="model_seq_id"):
        training.prepare_create_model(st, create)


def test_in_range_values_pass(st, run_id):
    edge = 2**63 - 1
    op = training.prepare_optim_step(st, _optim(run_id, seq_id=edge, eps=1e-300, beta2=0.999999)).work.op
    assert (op.adam_params.eps, op.allow_non_finite) == (1e-300, False)


@pytest.mark.parametrize("path", ["", "a/b", "..", ".", "x\x00y", "n" * 129, "ok\n"])
def test_absurd_checkpoint_names(st, run_id, path):
    with pytest.raises(UserError, match="invalid path"):
        training.prepare_save_weights(st, _body(model_id=run_id, seq_id=1, path=path))


def test_save_weights_without_a_name_or_seq_id(st, run_id):
    with pytest.raises(UserError, match="needs a path"):
        training.prepare_save_weights(st, _body(model_id=run_id))
    assert training.prepare_save_weights(st, _body(model_id=run_id, seq_id=4)).work.op.dir_path.endswith("step-4")


def _converted(st, request_type: str, body: bytes, status: str) -> FutureRow:
    """A row as a pre-op-log tinkerd stored it (the raw body), after the start-up conversion."""
    rid = f"req-{st.runs.store.query(select(func.count()).select_from(FutureRow))[0]}"
    st.runs.store.add(FutureRow(request_id=rid, request_type=request_type, target="t", body=body, status=status,
                                created_at=utcnow()))
    legacy.convert(st)
    return st.runs.store.get(FutureRow, rid)


def test_the_upgrade_converts_completed_ops_as_they_ran_and_checks_pending_ones(st, run_id):
    old = _optim(run_id, eps=0.0)  # accepted before eps > 0 was enforced
    row = _converted(st, "OptimStep", old, "complete")
    op = rebuild_work(row).op
    assert op.adam_params.eps == 0.0 and op.allow_non_finite  # replayed as it ran, guard off
    row = _converted(st, "OptimStep", old, "pending")  # never ran: refused like a new request
    assert row.status == "failed" and "adam_params.eps" in row.error and row.op_version is None
    session = st.runs.training_runs.run(run_id).session_id
    old_create = _body(session_id=session, model_seq_id=-1, base_model=TINY, lora_config={"rank": 4})
    assert rebuild_work(_converted(st, "CreateModel", old_create, "complete")).op.model_id == f"{session}:train:-1"
    # A good op, completed or not, is the same op either way.
    good = _optim(run_id)
    done, pending = _converted(st, "OptimStep", good, "complete"), _converted(st, "OptimStep", good, "pending")
    assert rebuild_work(done).op.adam_params == rebuild_work(pending).op.adam_params


def test_allow_non_finite_reaches_the_ops(st, run_id):
    st.config = ServerConfig(data_dir=st.config.data_dir, allow_non_finite=True)
    assert training.prepare_optim_step(st, _optim(run_id)).work.op.allow_non_finite
