"""The HPC-AI `hpcai` client (0.2.0, a fork of tinker SDK 0.1.5) at the API edge.

Its requests are translated here into the official SDK's request shapes, and then go through the
same `prepare_*` functions, limits and op records as every other request: control, engine and store
never see which client sent an op (docs/compatibility.md, "The hpcai client"). What differs:

- `create_model` without `session_id`/`model_seq_id`: the model goes into an implicit session of the
  caller's API key (`sess-hpcai-<key id>`), numbered in order;
- `forward_backward` / `forward` as JSON (`forward_backward_input` / `forward_input`): transcoded to
  the protobuf message the official SDK sends, so `codec.decode_forward_backward` validates it;
  such ops carry no `seq_id` and run in arrival order on their model (below);
- `load_weights` without `optimizer`: weights only (what 0.1.x `load_state` meant);
- `hpcai://<run>/<training|sampler>/<name>` wherever a `tinker://` path is read;
- `retrieve_future` carrying `model_id` (ignored).

Its answers: results as JSON when it asks for `application/json` (api/results.py), and paths in
the `hpcai://` form when the `User-Agent` is the hpcai client's. The official SDK sends neither, so
it sees exactly what it saw before.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import numpy as np
from fastapi import Request
from tinker.proto import tinker_public_pb2 as pb

from tinkerd.api.deps import AppState, load_json
from tinkerd.control.ids import TinkerPath, parse_tinker_path
from tinkerd.errors import UserError

# `AsyncHpcAI/Python 0.1.5` (the client every SDK call uses) and `HpcAI/...` (its sync resources).
_USER_AGENT = re.compile(r"(^|[\s(])(Async)?HpcAI/")
SCHEME = "hpcai://"
# hpcai's type segment -> tinkerd's, and back. External exports have no hpcai form.
TO_TINKER = {"training": "weights", "sampler": "sampler_weights"}
TO_HPCAI = {v: k for k, v in TO_TINKER.items()}
_JSON_DTYPES = {"float32": np.float32, "int64": np.int64}
_PB_DTYPES = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_INT32 = np.iinfo(np.int32)
# Numbering of models in implicit sessions: one lock per process is enough, the API runs in one.
_numbering = threading.Lock()
# model_id -> whether its training ops carry seq_ids (check_ordering); a few bytes per model.
_modes: dict[str, bool] = {}
_modes_lock = threading.Lock()


def is_hpcai(request: Request) -> bool:
    return bool(_USER_AGENT.search(request.headers.get("user-agent", "")))


def wants_json(request: Request) -> bool:
    """The client asked for JSON results: it accepts application/json and not protobuf (the official
    SDK sends `application/x-protobuf`, httpx `*/*`: both keep getting protobuf)."""
    accept = request.headers.get("accept", "").lower()
    return "application/json" in accept and "application/x-protobuf" not in accept


# -- paths -----------------------------------------------------------------------------------------


def to_tinker(path: Any) -> Any:
    """`hpcai://run/training/x` -> `tinker://run/weights/x`; anything else unchanged (a wrong hpcai
    type segment is left for the tinker parser to refuse, naming the path)."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        return path
    run, _, rest = path[len(SCHEME):].partition("/")
    segment, _, name = rest.partition("/")
    if segment not in TO_TINKER:
        raise UserError(f"invalid path {path!r}: expected hpcai://<run_id>/<training|sampler>/<name>")
    return f"tinker://{run}/{TO_TINKER[segment]}/{name}"


def to_hpcai(path: Any) -> Any:
    """`tinker://run/weights/x` -> `hpcai://run/training/x`; external exports and others unchanged."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        return path
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in TO_HPCAI:
        return path
    return f"{SCHEME}{parts[0]}/{TO_HPCAI[parts[1]]}/{parts[2]}"


def parse_path(path: Any) -> TinkerPath:
    """A checkpoint path in either form."""
    return parse_tinker_path(to_tinker(path))


# -- requests --------------------------------------------------------------------------------------


def _object(body: bytes, what: str) -> dict:
    obj = load_json(body)
    if not isinstance(obj, dict):
        raise UserError(f"{what}: the body must be a JSON object")
    return obj


def create_model_body(st: AppState, request: Request, body: bytes) -> bytes:
    """A create_model without a session gets the key's implicit session and the next model number in
    it; one with a session is left as it is."""
    obj = _object(body, "create_model")
    if "session_id" in obj or "model_seq_id" in obj:
        return body
    key_id = getattr(request.state, "key_id", None) or request.state.account_id
    session_id = f"sess-hpcai-{key_id}"
    if not st.runs.sessions.session_exists(session_id):
        st.runs.sessions.create_session(["hpcai-implicit"], {}, request.headers.get("x-stainless-package-version"),
                               request.state.account_id, session_id=session_id)
    obj.update(session_id=session_id, model_seq_id=st.runs.training_runs.run_count(session_id))
    return json.dumps(obj).encode()


def numbering() -> threading.Lock:
    """Held by create_model from taking the next number (create_model_body) to making the run row
    (prepare_create_model): two concurrent creates in one implicit session never share a number."""
    return _numbering


def load_weights_body(body: bytes) -> bytes:
    obj = _object(body, "load_weights")
    if "optimizer" in obj and not str(obj.get("path", "")).startswith(SCHEME):
        return body
    obj.setdefault("optimizer", False)  # hpcai 0.1.x load_state: weights only
    obj["path"] = to_tinker(obj.get("path"))
    return json.dumps(obj).encode()


def retrieve_body(body: bytes) -> bytes:
    """hpcai's retrieve_future names the future's model_id too; the request id alone finds it."""
    if b'"model_id"' not in body:
        return body
    obj = load_json(body)
    if isinstance(obj, dict):
        obj.pop("model_id", None)
    return json.dumps(obj).encode()


def is_json_body(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json"


def forward_backward_protobuf(body: bytes, forward_only: bool) -> bytes:
    """hpcai's JSON forward(_backward) request as the protobuf ForwardBackwardRequest the official SDK
    sends, with no seq_id: the decoder that reads the SDK's bodies then checks it field by field."""
    key = "forward_input" if forward_only else "forward_backward_input"
    obj = _object(body, "forward" if forward_only else "forward_backward")
    model_id, fb = obj.get("model_id"), obj.get(key)
    if not isinstance(model_id, str) or not model_id:
        raise UserError("model_id is required (a string)")
    if not isinstance(fb, dict) or not isinstance(fb.get("data"), list) or not isinstance(fb.get("loss_fn"), str):
        raise UserError(f"{key} is required: {{data: [datum, ...], loss_fn: <name>}}")
    msg = pb.ForwardBackwardRequest(model_id=model_id, loss_fn=fb["loss_fn"], forward_only=forward_only)
    config = fb.get("loss_fn_config") or {}
    if not isinstance(config, dict):
        raise UserError("loss_fn_config must be an object of numbers")
    for name, value in config.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e308 < value < 1e308:
            raise UserError(f"loss_fn_config[{name!r}] must be a finite number")
        msg.loss_fn_config[str(name)] = float(value)
    for i, datum in enumerate(fb["data"]):
        _datum(msg.data.add(), datum, i)
    return msg.SerializeToString()


def _datum(out, datum: Any, i: int) -> None:
    if not isinstance(datum, dict):
        raise UserError(f"datum {i}: expected {{model_input, loss_fn_inputs}}")
    chunks = (datum.get("model_input") or {}).get("chunks") if isinstance(datum.get("model_input"), dict) else None
    if not isinstance(chunks, list):
        raise UserError(f"datum {i}: model_input.chunks is required (a list)")
    for j, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise UserError(f"datum {i}: {kind} chunks are not supported by tinkerd's text models")
        tokens = _array(chunk.get("tokens"), np.int64, f"datum {i} chunk {j} tokens")
        if tokens.size and (tokens.min() < _INT32.min or tokens.max() > _INT32.max):
            raise UserError(f"datum {i} chunk {j} tokens: token ids must fit in 32 bits")
        out.model_input.add().encoded_text.tokens = tokens.astype(np.int32).tobytes()
    inputs = datum.get("loss_fn_inputs") or {}
    if not isinstance(inputs, dict):
        raise UserError(f"datum {i}: loss_fn_inputs must be an object of tensors")
    for name, tensor in inputs.items():
        where = f"datum {i} loss_fn_inputs[{name!r}]"
        if not isinstance(tensor, dict) or tensor.get("dtype") not in _JSON_DTYPES:
            raise UserError(f"{where}: expected {{data, dtype: float32|int64, shape}}")
        data = _array(tensor.get("data"), _JSON_DTYPES[tensor["dtype"]], where)
        shape = tensor.get("shape")
        if shape is None:
            shape = [data.size]
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                  and 0 <= s <= _INT32.max for s in shape):
            raise UserError(f"{where}: shape must be a list of integers from 0 to {_INT32.max}")
        t = out.loss_fn_inputs[str(name)]
        t.dtype = _PB_DTYPES[tensor["dtype"]]
        t.shape.extend(shape)  # checked against the data by the decoder
        t.dense = data.tobytes()


def _array(values: Any, dtype, where: str) -> np.ndarray:
    if not isinstance(values, list):
        raise UserError(f"{where}: expected a list of numbers")
    try:
        arr = np.asarray(values, dtype=np.float64 if dtype is np.float32 else object)
        if dtype is np.int64:
            if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
                raise TypeError
            arr = np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{where}: expected a list of {'integers' if dtype is np.int64 else 'numbers'}") from None
    if arr.ndim != 1:
        raise UserError(f"{where}: expected a flat list of numbers")
    return arr.astype(dtype)


def check_ordering(st: AppState, model_id: str, seq_id: int | None) -> None:
    """A model's training ops either all carry seq_ids (the official SDK numbers them) or none do
    (hpcai: run in arrival order). Both kinds on one model would interleave wrongly, since the queue
    orders one model's ops by seq_id, or by arrival for ops without one: refused."""
    if seq_id == 0:  # the model's creation (create_model or a create-via-load), which both kinds have
        return
    wanted = seq_id is not None
    with _modes_lock:
        mode = _modes.get(model_id)
    if mode is None:
        # The model's first op after its creation decides; read once per process from the log.
        first = st.control.futures.first_training_op(model_id)
        with _modes_lock:
            mode = _modes.setdefault(model_id, (first[0] is not None) if first else wanted)
    if mode != wanted:
        have, got = ("with", "without") if mode else ("without", "with")
        raise UserError(f"model {model_id} has had training ops {have} seq_id and this one comes {got}: one "
                        "model's ops are ordered either by seq_id or by arrival, never both (use one client "
                        "kind per model)")


# -- answers ---------------------------------------------------------------------------------------


def rest_answer(request: Request, answer: dict) -> dict:
    """A REST answer with checkpoints in the hpcai client's terms for that client: `checkpoint_path`
    in the hpcai:// form and `checkpoint_id` the bare name (what its path parser yields, and what its
    archive and delete calls send). External exports, which it has no type for (its Checkpoint model
    refuses any type but training and sampler), are left out of its listings."""
    if not is_hpcai(request):
        return answer
    return _rewrite(answer)


def _rewrite(node: Any) -> Any:
    if isinstance(node, list):
        return [_rewrite(n) for n in node if not (isinstance(n, dict) and n.get("checkpoint_type") == "external")]
    if not isinstance(node, dict):
        return node
    node = {k: _rewrite(v) for k, v in node.items()}
    if "tinker_path" in node and "checkpoint_type" in node:
        node["checkpoint_path"] = to_hpcai(node["tinker_path"])
        node["checkpoint_id"] = str(node["tinker_path"]).rsplit("/", 1)[-1]
    return node
