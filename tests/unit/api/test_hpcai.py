"""The hpcai client's wire at the API edge (api/hpcai.py, api/results.py), without a server: its
JSON forward_backward decodes to the op the protobuf body gives, its paths map both ways, and its
JSON results carry the stored values (NaN as null)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb

from tinkerd.api import codec, hpcai
from tinkerd.api.results import wire_result
from tinkerd.control import oplog
from tinkerd.control.oplog import OpType
from tinkerd.errors import UserError
from tinkerd.types import ForwardBackwardResult, SampledSequence, SampleResult

TOKENS = [5, 6, 7, 8]


def _json_body(**overrides) -> bytes:
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:2]},
                                        {"type": "encoded_text", "tokens": TOKENS[2:]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [6, 7, 8, 9], "dtype": "int64", "shape": [4]},
                                "weights": {"data": [1.0, 0.5, 0.25, 0.0], "dtype": "float32", "shape": [4]}}}
    body = {"model_id": "m:train:0", "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"}}
    body.update(overrides)
    return json.dumps(body).encode()


def test_json_forward_backward_decodes_to_the_protobuf_bodys_op():
    from_json = codec.decode_forward_backward(hpcai.forward_backward_protobuf(_json_body(), forward_only=False))
    msg = pb.ForwardBackwardRequest(model_id="m:train:0", loss_fn="cross_entropy", seq_id=4)
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(TOKENS, np.int32).tobytes()
    for name, arr, dtype in (("target_tokens", np.asarray([6, 7, 8, 9], np.int64), pb.DTYPE_INT64),
                             ("weights", np.asarray([1.0, 0.5, 0.25, 0.0], np.float32), pb.DTYPE_FLOAT32)):
        t = d.loss_fn_inputs[name]
        t.dtype, t.dense = dtype, arr.tobytes()
        t.shape.extend([4])
    from_pb = codec.decode_forward_backward(msg.SerializeToString())
    assert (from_json.model_id, from_json.loss_fn, from_json.forward_only) == ("m:train:0", "cross_entropy", False)
    assert from_json.data[0].tokens.tolist() == from_pb.data[0].tokens.tolist() == TOKENS
    for name in ("target_tokens", "weights"):
        a, b = from_json.data[0].loss_fn_inputs[name], from_pb.data[0].loss_fn_inputs[name]
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    # No seq_id in the transcoded body: the route runs it in arrival order.
    assert codec.forward_backward_seq_id(hpcai.forward_backward_protobuf(_json_body(), False))[1] == 0
    forward = _json_body()
    forward = forward.replace(b'"forward_backward_input"', b'"forward_input"')
    assert codec.decode_forward_backward(hpcai.forward_backward_protobuf(forward, forward_only=True)).forward_only


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b.update(model_id=None), "model_id is required"),
    (lambda b: b.update(forward_backward_input={"data": "x", "loss_fn": "cross_entropy"}),
     "forward_backward_input is required"),
    (lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"][0].update(tokens=[1, True]), "integers"),
    (lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"][0].update(tokens=[2**40]), "32 bits"),
    (lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"][0].update(tokens=[[1]]), "integers"),
    (lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"].update(dtype="float64"),
     "float32|int64"),
    (lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"].update(data=["a"]), "numbers"),
    (lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"].update(shape=[5]), "do not fill"),
    (lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"].update(shape=[2**70]), "shape"),
    (lambda b: b["forward_backward_input"].update(loss_fn_config=[1]), "loss_fn_config"),
    (lambda b: b["forward_backward_input"].update(loss_fn_config={"x": 10**400}), "finite number"),
])
def test_bad_json_forward_backward_is_a_user_error_naming_the_field(mutate, message):
    body = json.loads(_json_body())
    mutate(body)
    with pytest.raises(UserError, match=message):
        codec.decode_forward_backward(hpcai.forward_backward_protobuf(json.dumps(body).encode(), False))


def test_paths_map_both_ways_and_leave_others_alone():
    assert hpcai.to_tinker("hpcai://r:train:0/training/x") == "tinker://r:train:0/weights/x"
    assert hpcai.to_tinker("hpcai://r:train:0/sampler/x") == "tinker://r:train:0/sampler_weights/x"
    assert hpcai.to_hpcai("tinker://r:train:0/sampler_weights/x") == "hpcai://r:train:0/sampler/x"
    assert hpcai.to_hpcai("tinker://r:train:0/external_weights/x") == "tinker://r:train:0/external_weights/x"
    assert hpcai.to_tinker("tinker://r/weights/x") == "tinker://r/weights/x"
    assert str(hpcai.parse_path("hpcai://r:train:0/training/x")) == "tinker://r:train:0/weights/x"
    with pytest.raises(UserError, match="training\\|sampler"):
        hpcai.to_tinker("hpcai://r/weights/x")


def test_json_results_carry_the_stored_values_and_protobuf_stays_the_default():
    logprobs = np.asarray([-0.1, -2.5, -3.0], np.float32)
    fb = oplog.dumps(ForwardBackwardResult([{"logprobs": logprobs}], {"loss:sum": 5.6}))
    body, media = wire_result(OpType.FORWARD_BACKWARD.value, fb, oplog.DOMAIN_RESULT, as_json=True)
    out = json.loads(body)
    assert media == "application/json" and out["metrics"] == {"loss:sum": 5.6}
    tensor = out["loss_fn_outputs"][0]["logprobs"]
    assert tensor["shape"] == [3] and np.asarray(tensor["data"], np.float32).tobytes() == logprobs.tobytes()
    assert wire_result(OpType.FORWARD_BACKWARD.value, fb, oplog.DOMAIN_RESULT)[1] == codec.PROTO_MEDIA_TYPE

    sample = oplog.dumps(SampleResult([SampledSequence([3, 4], [-0.5, -0.25], "length")],
                                      prompt_logprobs=np.asarray([math.nan, -1.5], np.float32)))
    out = json.loads(wire_result(OpType.SAMPLE.value, sample, oplog.DOMAIN_RESULT, as_json=True)[0])
    assert out == {"type": "sample", "prompt_logprobs": [None, -1.5],
                   "sequences": [{"stop_reason": "length", "tokens": [3, 4], "logprobs": [-0.5, -0.25]}]}

    saved = oplog.dumps({"path": "tinker://r:train:0/weights/s"})
    official = json.loads(wire_result(OpType.SAVE_WEIGHTS.value, saved, oplog.DOMAIN_RESULT)[0])
    theirs = json.loads(wire_result(OpType.SAVE_WEIGHTS.value, saved, oplog.DOMAIN_RESULT, hpcai_paths=True)[0])
    assert official["path"] == "tinker://r:train:0/weights/s" and theirs["path"] == "hpcai://r:train:0/training/s"
