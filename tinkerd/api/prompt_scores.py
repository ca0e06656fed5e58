"""The wire side of SampleRequest.target_prompt_logprobs and prompt_alt_tokens_k (the engine side:
engine/sampler/prompt_scores.py).

The request's target tensor is the SDK's JSON TensorData: int64 ids [len(prompt) - 1, K], dense or
sparse CSR (unlisted cells name nothing, as -1 does). The engine gets it dense. The answer,
SampleResponse.target_prompt_logprobs, has "the same shape and layout": float32, dense for a dense
request, and for a CSR request CSR with the request's own row pointers and columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from tinkerd.errors import UserError

# As the engine's cap on top-k pairs (sampler/rules.py MAX_TOPK_PAIRS), checked here before a dense
# array is allocated for a hostile shape.
MAX_CELLS = 1 << 20


@dataclass(frozen=True)
class Csr:
    crow: np.ndarray  # [R + 1] int64
    col: np.ndarray  # [nnz] int64


def target_ids(td, prompt_len: int) -> tuple[np.ndarray, Csr | None]:
    """The dense [P-1, K] int64 ids (-1: none) of a TensorData, and its CSR layout if it had one."""
    where = "target_prompt_logprobs"
    if td.dtype != "int64":
        raise UserError(f"{where} must be an int64 tensor of token ids, got {td.dtype}")
    shape = list(td.shape) if td.shape is not None else None
    if shape is None or len(shape) != 2 or any(not isinstance(s, int) or s < 0 for s in shape):
        raise UserError(f"{where} must be 2-D, [len(prompt) - 1, K], got shape {shape}")
    rows, k = shape
    if rows != prompt_len - 1:
        raise UserError(f"{where} must have len(prompt) - 1 = {prompt_len - 1} rows, got shape {shape}")
    if rows * k > MAX_CELLS:
        raise UserError(f"{where} of shape {shape} asks for more than {MAX_CELLS} logprobs")
    data = np.asarray(td.data, dtype=np.float64)
    if data.size and (not np.isfinite(data).all() or (data != np.round(data)).any() or (np.abs(data) > 2**62).any()):
        raise UserError(f"{where} must hold integer token ids")
    data = data.astype(np.int64)
    if (td.sparse_crow_indices is None) != (td.sparse_col_indices is None):
        raise UserError(f"{where}: sparse_crow_indices and sparse_col_indices go together")
    if td.sparse_crow_indices is None:
        if data.size != rows * k:
            raise UserError(f"{where}: {data.size} values do not fill shape {shape}")
        return data.reshape(rows, k), None
    crow = np.asarray(td.sparse_crow_indices, dtype=np.int64)
    col = np.asarray(td.sparse_col_indices, dtype=np.int64)
    if len(crow) != rows + 1 or len(col) != data.size or crow[0] != 0 or crow[-1] != data.size \
            or (np.diff(crow) < 0).any() or (col.size and (col.min() < 0 or col.max() >= k)):
        raise UserError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.full((rows, k), -1, dtype=np.int64)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = data
    return dense, Csr(crow, col)


def fill_response(out: pb.SampleResponse, targets: np.ndarray | None, alt: tuple[np.ndarray, np.ndarray] | None,
                  csr: Csr | None) -> None:
    if targets is not None:
        msg = out.target_prompt_logprobs
        msg.dtype = pb.DTYPE_FLOAT32
        msg.shape.extend(targets.shape)
        if csr is None:
            msg.dense = np.ascontiguousarray(targets, dtype=np.float32).tobytes()
        else:
            rows = np.repeat(np.arange(targets.shape[0]), np.diff(csr.crow))
            msg.sparse_csr.values = np.ascontiguousarray(targets[rows, csr.col], dtype=np.float32).tobytes()
            msg.sparse_csr.crow_indices = csr.crow.tobytes()
            msg.sparse_csr.col_indices = csr.col.tobytes()
    if alt is not None:
        ids, lps = alt
        for msg, arr, dtype, np_dtype in ((out.prompt_alt_tokens.tokens, ids, pb.DTYPE_INT64, np.int64),
                                          (out.prompt_alt_tokens.logprobs, lps, pb.DTYPE_FLOAT32, np.float32)):
            msg.dtype = dtype
            msg.shape.extend(arr.shape)
            msg.dense = np.ascontiguousarray(arr, dtype=np_dtype).tobytes()
