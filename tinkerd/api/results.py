"""Wire encoding of stored results: control stores each op's domain result (control/oplog.py); it
becomes the SDK's bytes here, when it is retrieved. A result an older tinkerd stored as wire bytes
is handed out as it is."""

from __future__ import annotations

import json

from tinkerd.api import codec, prompt_scores
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
                op_body: bytes | None = None) -> tuple[bytes, str]:
    """(body, media type) of a stored result, as retrieve_future answers it. `op_body`: the op's
    stored record, read only for what the answer's layout depends on (a sample's CSR targets)."""
    if media_type != oplog.DOMAIN_RESULT:
        return result, media_type or "application/octet-stream"
    value = oplog.loads(result)
    op_type = OpType(request_type)
    if op_type in (OpType.FORWARD, OpType.FORWARD_BACKWARD):
        return codec.encode_forward_backward_output(value), codec.PROTO_MEDIA_TYPE
    if op_type == OpType.SAMPLE:
        return codec.encode_sample_response(value, _target_csr(value, op_body)), codec.PROTO_MEDIA_TYPE
    return json.dumps({**value, "type": WIRE_TYPES[op_type]}).encode(), "application/json"


def _target_csr(result, op_body: bytes | None) -> prompt_scores.Csr | None:
    """The CSR layout a sample's target_prompt_logprobs came in, which its answer keeps."""
    if getattr(result, "target_prompt_logprobs", None) is None or not op_body:
        return None
    csr = oplog.loads(op_body).op.target_prompt_csr
    return None if csr is None else prompt_scores.Csr(*csr)
