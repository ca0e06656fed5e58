"""Protobuf codec: the SDK's own `tinker_public` messages <-> domain types.

forward_backward requests arrive as protobuf; ForwardBackwardOutput and SampleResponse results must
leave as protobuf (SDK 0.38 rejects JSON for both). Every malformed field is a UserError naming it.
"""

from __future__ import annotations

import math

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from tinkerd.api import prompt_scores
from tinkerd.errors import UserError
from tinkerd.images import ChunkExpander, ImageLimits
from tinkerd.types import Datum, ForwardBackwardOp, ForwardBackwardResult, ProvenanceSpan, SampleResult

PROTO_MEDIA_TYPE = "application/x-protobuf"

_DTYPES = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}
_OUT_DTYPES = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}
# Caps a hostile shape can't exceed before we allocate: 1e8 cells is 400 MB of float32.
_MAX_CELLS = 100_000_000


def decode_tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"{where}: unsupported tensor dtype {msg.dtype}")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise UserError(f"{where}: negative dimension in shape {shape}")
    cells = math.prod(shape) if shape else None
    if cells is not None and cells > _MAX_CELLS:
        raise UserError(f"{where}: tensor of shape {shape} is too large")
    which = msg.WhichOneof("encoding")
    if which == "sparse_csr":
        if len(shape) != 2:
            raise UserError(f"{where}: sparse CSR tensors must be 2-D, got shape {shape}")
        values = _frombuffer(msg.sparse_csr.values, dtype, where)
        crow = _frombuffer(msg.sparse_csr.crow_indices, np.dtype(np.int64), where)
        col = _frombuffer(msg.sparse_csr.col_indices, np.dtype(np.int64), where)
        rows, cols = shape
        if len(crow) != rows + 1 or len(col) != len(values) or (len(crow) and (crow[0] != 0 or crow[-1] != len(values))):
            raise UserError(f"{where}: inconsistent sparse CSR indices")
        if np.any(np.diff(crow) < 0) or (len(col) and (col.min() < 0 or col.max() >= cols)):
            raise UserError(f"{where}: sparse CSR indices out of range")
        dense = np.zeros(shape, dtype=dtype)
        row_of = np.repeat(np.arange(rows), np.diff(crow))
        dense[row_of, col] = values
        return dense
    data = _frombuffer(msg.dense, dtype, where)
    if not shape:
        return data
    if data.size != cells:
        raise UserError(f"{where}: {data.size} values do not fill shape {shape}")
    return data.reshape(shape)


def _frombuffer(buf: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(buf) % dtype.itemsize:
        raise UserError(f"{where}: byte length {len(buf)} is not a multiple of {dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype).copy()


# Image chunks without a model to count them for (fsck's re-decoding of stored wire bodies).
_NO_IMAGES = ImageLimits(max_bytes=0, max_pixels=0)


def decode_forward_backward(body: bytes, vision_of=None, limits: ImageLimits = _NO_IMAGES) -> ForwardBackwardOp:
    """`vision_of(model_id)` -> (base model name, its VisionSpec or None): how image chunks are
    expanded (tinkerd/images.py); without it an image chunk is refused."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise UserError(f"malformed ForwardBackwardRequest protobuf: {e}") from e
    if not msg.model_id:
        raise UserError("ForwardBackwardRequest.model_id is required")
    data = []
    model: tuple | None = None  # (base model, its VisionSpec), looked up at the first image
    budget = [limits.max_bytes]  # shared by the request's datums
    for i, d in enumerate(msg.data):
        chunks = ChunkExpander("this model", None, limits, budget)
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind == "encoded_text":
                chunks.text(_frombuffer(chunk.encoded_text.tokens, np.dtype(np.int32), f"datum {i} tokens"))
            elif kind == "image":
                if model is None and vision_of is not None:
                    model = vision_of(msg.model_id)
                if model is not None:
                    chunks.model, chunks.vision = model
                img = chunk.image
                if img.HasField("override_dimensions"):  # protobuf only; the SDK never sets it
                    raise UserError(f"datum {i} chunk {j}: ImageChunk.override_dimensions is not supported; "
                                    "send the image at the size it should be read at")
                expected = img.expected_tokens if img.HasField("expected_tokens") else None
                chunks.image(img.data, img.format, expected, f"datum {i} chunk {j}")
            else:
                raise UserError(f"datum {i}: {kind} chunks are not supported by tinkerd")
        toks = chunks.tokens()
        inputs = {name: decode_tensor(t, f"datum {i} loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
        for name, arr in inputs.items():
            # Weights or advantages of inf or NaN make the loss NaN; refused here (a 400) before
            # the op is queued, as the engine refuses them too (engine/training.py: _validate_datum).
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise UserError(f"datum {i} loss_fn_inputs[{name!r}] contains NaN or infinite values")
        # Provenance: only stable_reinforce reads it (control/stability.py checks it against the
        # records); the cookbook's rl/train.py attaches it to every RL datum whatever the loss.
        data.append(Datum(tokens=toks, loss_fn_inputs=inputs,
                          model_input_spans=_spans(d.model_input_spans, f"datum {i} model_input_spans"),
                          loss_fn_input_spans=_spans(d.loss_fn_input_spans, f"datum {i} loss_fn_input_spans"),
                          images=chunks.image_inputs()))
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return ForwardBackwardOp(
        model_id=msg.model_id,
        data=data,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
    )


def _spans(msgs, where: str) -> list[ProvenanceSpan] | None:
    """The SDK sends both span lists or neither (Datum.with_provenance); an empty list reads as none."""
    if not msgs:
        return None
    spans = []
    for j, msg in enumerate(msgs):
        kind = msg.WhichOneof("span")
        if kind is None:
            raise UserError(f"{where}[{j}]: a provenance span needs prompt_tokens or sampled_tokens")
        arm = getattr(msg, kind)
        if arm.offset < 0 or arm.length < 0 or not arm.sequence_id:
            raise UserError(f"{where}[{j}]: needs a sequence_id, offset >= 0 and length >= 0")
        spans.append(ProvenanceSpan("prompt" if kind == "prompt_tokens" else "sampled", arm.sequence_id,
                                    int(arm.offset), int(arm.length)))
    return spans


def forward_only(body: bytes) -> bytes:
    """A ForwardBackwardRequest body with forward_only set (POST /forward)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise UserError(f"malformed ForwardBackwardRequest protobuf: {e}") from e
    msg.forward_only = True
    return msg.SerializeToString()


def forward_backward_seq_id(body: bytes) -> tuple[str, int]:
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    return msg.model_id, msg.seq_id


def encode_forward_backward_output(result: ForwardBackwardResult) -> bytes:
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in result.metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(result.loss_fn_outputs)
    names = list(result.loss_fn_outputs[0]) if result.loss_fn_outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(d[name]) for d in result.loss_fn_outputs]
        dtype = np.dtype(np.float32) if arrays[0].dtype.kind == "f" else np.dtype(np.int64)
        arrays = [a.astype(dtype, copy=False) for a in arrays]
        bt = record.fields[name]
        bt.dtype = _OUT_DTYPES[dtype]
        bt.trailing_shape.extend(arrays[0].shape[1:])
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt.offsets = offsets.tobytes()
        bt.data = b"".join(a.tobytes() for a in arrays)
    return out.SerializeToString()


def encode_sample_response(result: SampleResult, target_csr=None) -> bytes:
    """`target_csr`: the CSR layout of the request's target_prompt_logprobs, kept in the answer."""
    out = pb.SampleResponse()
    for seq in result.sequences:
        s = out.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            _fill_topk(s.topk_sampled_logprobs, *seq.topk_logprobs)
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(result.prompt_logprobs, dtype=np.float32).tobytes()
    if result.topk_prompt_logprobs is not None:
        _fill_topk(out.topk_prompt_logprobs, *result.topk_prompt_logprobs)
    prompt_scores.fill_response(out, result.target_prompt_logprobs, result.prompt_alt_tokens, target_csr)
    out.prompt_cache_hit_tokens = result.prompt_cache_hit_tokens
    return out.SerializeToString()


def _fill_topk(msg: pb.TopkLogprobs, ids: np.ndarray, lps: np.ndarray) -> None:
    """ids / lps [N, K], row-major; empty cells are (0, -99999.0), which the SDK reads as None."""
    n, k = ids.shape
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(lps, dtype=np.float32).tobytes()
    msg.k = k
    msg.length = n
