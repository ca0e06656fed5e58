"""The op log's record encoding (control/oplog.py, docs/op-contract.md): every op comes back equal,
arrays bit-exact; a record from before a field existed takes its default; one from a newer tinkerd,
or one that is not there, is refused with a message naming why."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from tests.unit.control.test_scheduler import _wait_done
from tinkerd.artifacts import LocalArtifactStore
from tinkerd.control import oplog
from tinkerd.control.control import Control, Work
from tinkerd.control.oplog import OpRecord, OpType, Payer, RegisterCheckpoint
from tinkerd.control.recovery import Recovery, rebuild_work
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.tables import FutureRow, TrainingRunRow
from tinkerd.errors import ServerError, UserError
from tinkerd.types import (
    AdamParams,
    CreateModelOp,
    Datum,
    ForwardBackwardOp,
    ForwardBackwardResult,
    LoraSpec,
    OptimStepOp,
    SampledSequence,
    SampleOp,
    SampleResult,
    SamplingParams,
    ServedModel,
    StepOutput,
)


def _fb() -> ForwardBackwardOp:
    tokens = np.array([1, 2, 2**40], dtype=np.int64)
    weights = np.array([0.1, np.nan, -0.0], dtype=np.float32)
    soft = np.arange(6, dtype=np.float64).reshape(3, 2)[:, ::-1]  # not contiguous
    return ForwardBackwardOp("s:train:0", [Datum(tokens, {"weights": weights, "soft": soft})], "cross_entropy",
                             {"clip_low": 0.2, "mode": "x"}, allow_non_finite=True)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("value", [
    OpRecord(OpType.FORWARD_BACKWARD, _fb(), Payer("acct", "s", "tiny")),
    OpRecord(OpType.CREATE_MODEL, CreateModelOp("s:train:0", "tiny", LoraSpec(8, 32.0, seed=2**62)),
             reply={"model_id": "s:train:0"}),
    OpRecord(OpType.OPTIM_STEP, OptimStepOp("m", AdamParams(1e-2, eps=1e-12), snapshot_dir="/x")),
    OpRecord(OpType.SAVE_WEIGHTS, OptimStepOp("m", AdamParams()), effect=RegisterCheckpoint("tinker://m/weights/a", 60,
                                                                                           {"k": [1, {"n": None}]})),
    OpRecord(OpType.SAMPLE, SampleOp("tiny", None, np.array([5, 6], np.int64),
                                     SamplingParams(4, stop_token_seqs=((1, 2), (3,)), stop_strings=("\n",)), 2)),
    ForwardBackwardResult([{"logprobs": np.array([-1.5, float("-inf")], np.float32)}], {"loss:sum": 3.25}),
    SampleResult([SampledSequence([1, 2], [-0.5, -0.25], "stop", (np.zeros((2, 3), np.int64), np.ones((2, 3))))]),
    {"metrics": {"grad_norm:mean": 0.5}, 3: (1, 2)},
])
def test_values_come_back_equal_and_arrays_bit_exact(value):
    assert _same(value, oplog.loads(oplog.dumps(value)))


def test_a_record_from_before_a_field_existed_takes_its_default():
    stored = json.loads(oplog.dumps(OptimStepOp("m", AdamParams())))
    del stored["f"]["allow_non_finite"], stored["f"]["adam_params"]["f"]["grad_clip_norm"]
    op = oplog.loads(json.dumps(stored).encode())
    assert op == OptimStepOp("m", AdamParams())


def test_a_record_with_fields_this_tinkerd_does_not_know_is_refused():
    stored = json.loads(oplog.dumps(OpRecord(OpType.OPTIM_STEP, OptimStepOp("m", AdamParams()))))
    stored["f"]["op"]["f"]["momentum_v2"] = 1
    row = FutureRow(request_id="req-1", body=json.dumps(stored).encode(), op_version=1)
    with pytest.raises(ServerError, match="momentum_v2"):
        rebuild_work(row)


@pytest.mark.parametrize("body,version,why", [
    (b'{"model_id": "m"}', None, "pre-v1 wire form"),
    (b"x", oplog.SCHEMA_VERSION + 1, "newer tinkerd"),
    (b"", oplog.SCHEMA_VERSION, "lost its stored record"),
])
def test_records_that_cannot_be_replayed_say_why(body, version, why):
    with pytest.raises(ServerError, match=why):
        rebuild_work(FutureRow(request_id="req-1", body=body, op_version=version))


def test_rebuilt_work_is_the_accepted_op_with_its_billing():
    record = OpRecord(OpType.FORWARD_BACKWARD, _fb(), Payer("acct", "s", "tiny"))
    work = rebuild_work(FutureRow(request_id="r", body=oplog.dumps(record), op_version=oplog.SCHEMA_VERSION))
    assert _same(work.op, record.op) and work.record.op_type is OpType.FORWARD_BACKWARD
    assert work.billing.account_id == "acct" and work.billing.count(None).trained_tokens == 3


def test_a_pydantic_model_in_a_field_comes_back_and_only_ours_load():
    from tinker import types as t

    params = t.AdamParams(learning_rate=0.5)
    assert oplog.loads(oplog.dumps({"p": params})) == {"p": params}
    with pytest.raises(ValueError, match="not one of"):
        oplog.loads(b'{"$pd": "os:system", "v": {}}')


class _Engine:
    """Serves only `served`; replays succeed unless an op's model_id is in `fail`."""

    def __init__(self, served: list[str], fail: tuple[str, ...] = ()):
        self.served, self.fail, self.replayed = served, fail, []

    def models(self):
        return [ServedModel(name, name, 64, "qwen3") for name in self.served]

    def step(self, batch):
        self.replayed += [op for _, op in batch.run]
        return StepOutput([(t, UserError("broken snapshot") if op.model_id in self.fail else {}) for t, op in batch.run],
                          active_rows=0)

    def close(self):
        pass


def _logged(store, model_id: str, seq_id: int, record: OpRecord, status: str) -> str:
    rid = f"req-{model_id}-{seq_id}"
    store.add(FutureRow(request_id=rid, request_type=record.op_type.value, target=model_id, seq_id=seq_id,
                        body=oplog.dumps(record), op_version=oplog.SCHEMA_VERSION, status=status, created_at=utcnow()))
    return rid


@pytest.mark.parametrize("engine,why", [
    (_Engine(["other"]), "trained on tiny, which this server does not serve now"),
    (_Engine(["tiny"], fail=("s:train:0",)), "replaying its CreateModelOp failed: broken snapshot"),
])
def test_a_run_that_cannot_be_rebuilt_is_recorded_and_its_ops_fail_with_the_reason(tmp_path, engine, why):
    store = Store.sqlite(tmp_path / "db.sqlite")
    store.add(TrainingRunRow(model_id="s:train:0", session_id="s", base_model="tiny", lora_rank=4, lora_config={},
                             created_at=utcnow(), last_request_at=utcnow()))
    _logged(store, "s:train:0", 0, OpRecord(OpType.CREATE_MODEL, CreateModelOp("s:train:0", "tiny", LoraSpec(4, 8.0))),
            "complete")
    step = OpRecord(OpType.OPTIM_STEP, OptimStepOp("s:train:0", AdamParams()))
    _logged(store, "s:train:0", 1, step, "complete")
    pending = _logged(store, "s:train:0", 2, step, "pending")
    control = Control(store, engine, Recovery(store, LocalArtifactStore(tmp_path)))
    control.start()
    try:
        row = store.get(FutureRow, pending)
        assert row.status == "failed" and why in row.error
        with pytest.raises(UserError, match=why):
            control.submit("OptimStep", "s:train:0", 3, b"", Work.of(step))
    finally:
        control.stop()
    # A start that can rebuild it drops the record.
    control = Control(store, _Engine(["tiny"]), Recovery(store, LocalArtifactStore(tmp_path)))
    control.start()
    try:
        assert control.recovery.failure("s:train:0") is None
        assert _wait_done(control, control.submit("OptimStep", "s:train:0", 3, b"", Work.of(step)).request_id).status \
            == "complete"
    finally:
        control.stop()
