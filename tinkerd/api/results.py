"""Wire encoding of stored results: control stores each op's domain result (control/oplog.py); it
becomes the SDK's bytes here, when it is retrieved. A result an older tinkerd stored as wire bytes
is handed out as it is."""

from __future__ import annotations

import json

from tinkerd.api import codec
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


def wire_result(request_type: str, result: bytes, media_type: str | None) -> tuple[bytes, str]:
    """(body, media type) of a stored result, as retrieve_future answers it."""
    if media_type != oplog.DOMAIN_RESULT:
        return result, media_type or "application/octet-stream"
    value = oplog.loads(result)
    op_type = OpType(request_type)
    if op_type in (OpType.FORWARD, OpType.FORWARD_BACKWARD):
        return codec.encode_forward_backward_output(value), codec.PROTO_MEDIA_TYPE
    if op_type == OpType.SAMPLE:
        return codec.encode_sample_response(value), codec.PROTO_MEDIA_TYPE
    return json.dumps({**value, "type": WIRE_TYPES[op_type]}).encode(), "application/json"
