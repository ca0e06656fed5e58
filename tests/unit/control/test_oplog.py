"""The op log's record encoding (control/oplog.py, docs/op-contract.md): every op comes back equal,
arrays bit-exact; a record from before a field existed takes its default; one from a newer tinkerd,
or one that is not there, is refused with a message naming why."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from tinkerd.control import oplog
from tinkerd.control.oplog import OpRecord, OpType, Payer, RegisterCheckpoint
from tinkerd.control.recovery import rebuild_work
from tinkerd.control.store.tables import FutureRow
from tinkerd.errors import ServerError
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
