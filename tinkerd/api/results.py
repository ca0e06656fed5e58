"""Wire encoding of stored results: control stores each op's domain result (control/oplog.py); it
becomes the SDK's bytes here, when it is retrieved. A result an older tinkerd stored as wire bytes
is handed out as it is."""

from __future__ import annotations

import json
import math

import numpy as np

from tinkerd.api import codec, hpcai, prompt_scores
from tinkerd.control import oplog
from tinkerd.control.oplog import OpType

# The `type` field of each JSON reply, as the SDK's response models name it.
WIRE_TYPES = {
    OpType.CREATE_MODEL: "create_model",
    OpType.OPTIM_STEP: "optim_step",
    OpType.SAVE_WEIGHTS: "save_weights",
    OpType.SAVE_WEIGHTS_FOR_SAMPLER: "save_weights_for_sampler",
    OpType.LOAD_WEIGHTS: "load_weights",
    OpType.SAVE_WEIGHTS_EXTERNAL: "save_weights_external",
}


def wire_result(request_type: str, result: bytes, media_type: str | None,
                op_body: bytes | None = None, as_json: bool = False, hpcai_paths: bool = False) -> tuple[bytes, str]:
    """(body, media type) of a stored result, as retrieve_future answers it. `op_body`: the op's
    stored record, read only for what the answer's layout depends on (a sample's CSR targets).
    `as_json`: forward(_backward) and sample results as JSON (the hpcai client asks for them so);
    `hpcai_paths`: checkpoint paths in the hpcai:// form (api/hpcai.py)."""
    if media_type != oplog.DOMAIN_RESULT:
        return result, media_type or "application/octet-stream"
    value = oplog.loads(result)
    op_type = OpType(request_type)
    if op_type in (OpType.FORWARD, OpType.FORWARD_BACKWARD):
        if as_json:
            return _json(forward_backward_json(value))
        return codec.encode_forward_backward_output(value), codec.PROTO_MEDIA_TYPE
    if op_type == OpType.SAMPLE:
        if as_json:
            return _json(sample_json(value))
        return codec.encode_sample_response(value, _target_csr(value, op_body)), codec.PROTO_MEDIA_TYPE
    reply = {**value, "type": WIRE_TYPES[op_type]}
    if hpcai_paths and "path" in reply:
        reply["path"] = hpcai.to_hpcai(reply["path"])
    return _json(reply)


def _json(obj: dict) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), "application/json"


def _tensor(arr: np.ndarray) -> dict:
    arr = np.asarray(arr)
    dtype = "float32" if arr.dtype.kind == "f" else "int64"
    # float32 values as Python floats: each prints as the shortest repr that reads back to the same
    # float32, so the client's to_numpy() gets the server's bits.
    return {"data": arr.astype(np.float32 if dtype == "float32" else np.int64).ravel().tolist(),
            "dtype": dtype, "shape": list(arr.shape)}


def forward_backward_json(result) -> dict:
    """ForwardBackwardOutput as the hpcai client (and tinker SDK 0.1.x) reads it."""
    return {"loss_fn_output_type": "ArrayRecord",
            "loss_fn_outputs": [{name: _tensor(a) for name, a in d.items()} for d in result.loss_fn_outputs],
            "metrics": {k: float(v) for k, v in result.metrics.items()}}


def _floats(values) -> list[float | None]:
    """NaN (a prompt's first position has no logprob) as null: JSON has no NaN."""
    return [None if not math.isfinite(v) else v for v in np.asarray(values, dtype=np.float32).tolist()]


def sample_json(result) -> dict:
    return {"type": "sample",
            "sequences": [{"stop_reason": s.stop_reason, "tokens": [int(t) for t in s.tokens],
                           "logprobs": _floats(s.logprobs)} for s in result.sequences],
            "prompt_logprobs": None if result.prompt_logprobs is None else _floats(result.prompt_logprobs)}


def _target_csr(result, op_body: bytes | None) -> prompt_scores.Csr | None:
    """The CSR layout a sample's target_prompt_logprobs came in, which its answer keeps."""
    if getattr(result, "target_prompt_logprobs", None) is None or not op_body:
        return None
    csr = oplog.loads(op_body).op.target_prompt_csr
    return None if csr is None else prompt_scores.Csr(*csr)
