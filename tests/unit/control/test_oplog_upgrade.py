"""Op schema v1 -> v2 (docs/op-contract.md): v1 records held absolute directory paths, v2 records
hold ArtifactStore keys. A v1 record already in a log decodes to the same op with its paths turned
into the keys they name, whatever data directory wrote it; one whose path is not in tinkerd's layout
fails with a reason naming the version, and a v2 record is read as it is."""

from __future__ import annotations

import numpy as np
import pytest

from tinkerd.control import oplog
from tinkerd.control.oplog import CreateSampler, OpRecord, OpType, RegisterCheckpoint
from tinkerd.errors import ServerError
from tinkerd.types import AdamParams, LoadWeightsOp, OptimStepOp, SampleOp, SamplingParams, SaveWeightsOp

RUN = "sess-1:train:0"
OLD = "/var/lib/old-data-dir"  # where the v1 server kept its data: not this server's


def _v1(record: OpRecord) -> OpRecord:
    return oplog.load_record(oplog.dumps(record), 1, "req-1")


def test_v1_paths_become_the_keys_they_name():
    save = _v1(OpRecord(OpType.SAVE_WEIGHTS, SaveWeightsOp(RUN, f"{OLD}/checkpoints/{RUN}/weights/step-3", True),
                        effect=RegisterCheckpoint(f"tinker://{RUN}/weights/step-3")))
    assert save.op == SaveWeightsOp(RUN, f"checkpoints/{RUN}/weights/step-3", True)
    assert save.effect.path == f"tinker://{RUN}/weights/step-3"  # a tinker:// path, not a directory: as it was

    step = _v1(OpRecord(OpType.OPTIM_STEP, OptimStepOp(RUN, AdamParams(), snapshot_dir=f"{OLD}/snapshots/{RUN}/seq-000000000007")))
    assert step.op.snapshot_dir == f"snapshots/{RUN}/seq-000000000007"

    load = _v1(OpRecord(OpType.LOAD_WEIGHTS, LoadWeightsOp(RUN, "tiny", f"{OLD}/checkpoints/sess-0:train:0/weights/w", True)))
    assert load.op.dir_path == "checkpoints/sess-0:train:0/weights/w" and load.op.snapshot_dir is None

    sampler = _v1(OpRecord(OpType.SAVE_WEIGHTS_FOR_SAMPLER,
                           SaveWeightsOp(RUN, f"{OLD}/checkpoints/_ephemeral/sess-1:sample:2", False),
                           effect=CreateSampler("sess-1", 2, "tiny", f"{OLD}/checkpoints/_ephemeral/sess-1:sample:2")))
    assert sampler.op.dir_path == sampler.effect.adapter_dir == "checkpoints/_ephemeral/sess-1:sample:2"

    sample = _v1(OpRecord(OpType.SAMPLE, SampleOp("tiny", f"{OLD}/checkpoints/{RUN}/sampler_weights/s", np.array([1, 2]),
                                                  SamplingParams(max_tokens=2))))
    assert sample.op.adapter_path == f"checkpoints/{RUN}/sampler_weights/s"


def test_a_v2_record_is_read_as_it_is():
    record = OpRecord(OpType.SAVE_WEIGHTS, SaveWeightsOp(RUN, f"checkpoints/{RUN}/weights/a", True))
    assert oplog.load_record(oplog.dumps(record), 2, "req-1").op == record.op
    assert oplog.SCHEMA_VERSION == 2


def test_a_v1_path_outside_the_layout_fails_with_the_reason():
    record = OpRecord(OpType.LOAD_WEIGHTS, LoadWeightsOp(RUN, "tiny", "/home/me/my-adapter", True))
    with pytest.raises(ServerError, match=r"op req-1 \(op schema v1\) cannot be converted to v2: '/home/me/my-adapter'"):
        _v1(record)
