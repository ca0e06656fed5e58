"""The typed, versioned op log: what an accepted op is, and how it and its result are persisted.

docs/op-contract.md is the contract; this module is its code. An accepted op is stored as an
`OpRecord` (its `OpType`, the engine op from tinkerd/types.py, who pays, the bookkeeping its success
does, and the static fields of its reply) in its domain form, never as the wire bytes it came in.
Recovery rebuilds ops from these records alone: no API layer, no validation against today's config.
A finished op's result is stored as its domain value (ForwardBackwardResult, SampleResult, a dict)
in the same encoding; the API turns it into wire bytes when it is retrieved.

The encoding is generic, so a new field on an op needs no change here: every dataclass is written
as {"$dc": class name, "f": {field: value}}, an ndarray as its dtype, shape and raw bytes (bit-exact),
tuples and dicts tagged so they come back as they went, a pydantic model as its class path and
JSON dump (only tinkerd's and the SDK's classes are loaded back). A dataclass is looked up by name among those
of tinkerd.types and this module; a stored record missing a field gets the field's default.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import json
from typing import Any

import numpy as np
import pydantic

from tinkerd import types
from tinkerd.artifacts import key_of_path
from tinkerd.errors import ServerError

# Bumped when a stored record would no longer decode to the op it was (a field renamed or removed, a
# meaning changed); adding a field with a default does not bump it. Rows with op_version NULL hold
# the pre-v1 form (the raw HTTP body), which cli/serve.py converts once on start (api/legacy.py).
# v2: the ops' dir_path, snapshot_dir and adapter_path and CreateSampler.adapter_dir are ArtifactStore
# keys (tinkerd/artifacts.py), not absolute paths; a v1 record is converted as it is read (_upgrade_v1).
SCHEMA_VERSION = 2

# The media type a stored domain result carries; any other is wire bytes stored by an older tinkerd,
# handed out as they are.
DOMAIN_RESULT = "application/x-tinkerd-domain+json; v=1"


class OpType(str, enum.Enum):
    """Every future-returning op; the values are the stored request_type (and dedupe key) names."""

    CREATE_MODEL = "CreateModel"
    FORWARD = "Forward"
    FORWARD_BACKWARD = "ForwardBackward"
    OPTIM_STEP = "OptimStep"
    SAVE_WEIGHTS = "SaveWeights"
    SAVE_WEIGHTS_FOR_SAMPLER = "SaveWeightsForSampler"
    LOAD_WEIGHTS = "LoadWeights"
    SAVE_WEIGHTS_EXTERNAL = "SaveWeightsExternal"
    SAMPLE = "Sample"


@dataclasses.dataclass
class Payer:
    """Who an op is billed to, resolved when it was accepted."""

    account_id: str | None
    session_id: str | None
    base_model: str | None


@dataclasses.dataclass
class RegisterCheckpoint:
    """After the op wrote its files: register `path` (a tinker:// path) as a checkpoint."""

    path: str
    ttl_seconds: int | None = None
    user_metadata: dict | None = None


@dataclasses.dataclass
class CreateSampler:
    """After an ephemeral save_weights_for_sampler: create the sampling session on its adapter, and
    prune the session's older ephemeral samplers. With `inflight_of` (kind="inflight"): the session
    follows that run's inflight target, and this save repoints every inflight session of the run to
    its adapter (None, as every record before it: a snapshot)."""

    session_id: str
    sampling_session_seq_id: int
    base_model: str
    adapter_dir: str
    inflight_of: str | None = None


Effect = RegisterCheckpoint | CreateSampler


@dataclasses.dataclass
class OpRecord:
    """One accepted op as the log keeps it (FutureRow.body with FutureRow.op_version set)."""

    op_type: OpType
    op: Any  # a tinkerd.types engine op
    payer: Payer | None = None
    effect: Effect | None = None
    # Fields of the reply known when the op was accepted ({"model_id": ...}, {"path": ...}).
    reply: dict = dataclasses.field(default_factory=dict)


def _classes() -> dict[str, type]:
    names = {**vars(types), **globals()}
    return {n: o for n, o in names.items() if isinstance(o, type) and dataclasses.is_dataclass(o)}


_CLASSES: dict[str, type] | None = None


def _to_json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return {"$nd": data.dtype.str, "shape": list(data.shape), "b64": base64.b64encode(data.tobytes()).decode()}
    if isinstance(value, np.generic):
        return value.item()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"$dc": type(value).__name__,
                "f": {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, pydantic.BaseModel):  # a field typed with a pydantic model (a loss config, say)
        cls = type(value)
        return {"$pd": f"{cls.__module__}:{cls.__qualname__}", "v": value.model_dump(mode="json")}
    if isinstance(value, tuple):
        return {"$tuple": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {"$map": [[_to_json(k), _to_json(v)] for k, v in value.items()]}
    raise TypeError(f"cannot store a {type(value).__name__} in the op log")


def _from_json(value: Any) -> Any:
    global _CLASSES
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "$nd" in value:
        flat = np.frombuffer(base64.b64decode(value["b64"]), dtype=np.dtype(value["$nd"]))
        return flat.reshape(value["shape"]).copy()  # writable, as the op had it
    if "$pd" in value:
        module, _, name = value["$pd"].partition(":")
        if module.split(".")[0] not in ("tinkerd", "tinker"):  # only our own and the SDK's models
            raise ValueError(f"stored model {value['$pd']!r} is not one of tinkerd's or the SDK's")
        return getattr(importlib.import_module(module), name).model_validate(value["v"])
    if "$tuple" in value:
        return tuple(_from_json(v) for v in value["$tuple"])
    if "$map" in value:
        return {_from_json(k): _from_json(v) for k, v in value["$map"]}
    if _CLASSES is None:
        _CLASSES = _classes()
    cls = _CLASSES.get(value["$dc"])
    if cls is None:
        raise ValueError(f"unknown stored type {value['$dc']!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(value["f"]) - known
    if unknown:  # written by a newer tinkerd: refuse rather than drop what it meant
        raise ValueError(f"stored {cls.__name__} has fields this tinkerd does not know: {sorted(unknown)}")
    out = cls(**{k: _from_json(v) for k, v in value["f"].items()})
    if cls is OpRecord:
        out.op_type = OpType(out.op_type)
    return out


def dumps(value: Any) -> bytes:
    """A domain value (op record, result) as the log stores it."""
    return json.dumps(_to_json(value), separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    return _from_json(json.loads(data))


def load_record(body: bytes, version: int | None, request_id: str = "?") -> OpRecord:
    """The stored op of a FutureRow; a ServerError naming why when it cannot be read."""
    if version is None:
        raise ServerError(f"op {request_id} is stored in the pre-v1 wire form and was not converted "
                          "on start (see the start-up log); it cannot be replayed")
    if version > SCHEMA_VERSION:
        raise ServerError(f"op {request_id} was stored by a newer tinkerd (op schema v{version}, this one reads "
                          f"up to v{SCHEMA_VERSION})")
    if not body:
        raise ServerError(f"op {request_id} has lost its stored record")
    try:
        record = loads(body)
    except (ValueError, KeyError, TypeError) as e:
        raise ServerError(f"op {request_id}'s stored record cannot be read: {e}") from e
    if not isinstance(record, OpRecord):
        raise ServerError(f"op {request_id}'s stored record is a {type(record).__name__}, not an op")
    if version < 2:
        try:
            _upgrade_v1(record)
        except ValueError as e:
            raise ServerError(f"op {request_id} (op schema v1) cannot be converted to v{SCHEMA_VERSION}: {e}") from e
    return record


# The fields that held an absolute directory path in v1 and hold an artifact key since v2.
_PATH_FIELDS = ("dir_path", "snapshot_dir", "adapter_path")


def _upgrade_v1(record: OpRecord) -> None:
    """v1 -> v2: every path the record holds becomes the key it names (artifacts.key_of_path reads
    the key from the path's own layout, so the data directory it was written under does not matter)."""
    for name in _PATH_FIELDS:
        value = getattr(record.op, name, None)
        if isinstance(value, str):
            setattr(record.op, name, key_of_path(value))
    if isinstance(record.effect, CreateSampler):
        record.effect.adapter_dir = key_of_path(record.effect.adapter_dir)
