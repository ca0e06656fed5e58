"""`custom`: a loss uploaded with create_custom_loss, run by interpreting its torch.fx graph.

The graph arrives as data (tinkerd/lossgraph.py checked it at creation): every `call_function`
target is looked up in `FUNCTIONS`, built here from lossgraph's allow-list and nothing else, and
every `call_method` is a name from lossgraph.METHODS called on a tensor. There is no eval, exec,
import or unpickling of anything the client sent.

Semantics are the SDK's client-side `run_loss_handle` (tinker/lib/public_interfaces/custom_loss.py):
the graph runs once per datum on (that datum's target logprobs, its declared loss_fn_inputs as
tensors), the per-datum losses are summed in datum order, `:sum` metrics are summed and `:mean`
metrics averaged over the request's datums. The gradient is torch autograd through the interpreted
graph, so the engine's usual split at the target log-probs (training.py) applies unchanged and the
loss costs one forward and one backward, where the client-side path costs a forward, then a
forward+backward.

Before each node runs for real it runs on meta tensors of the same shapes (no memory, no compute):
a result over the cell limit is refused before it is allocated, and so is an argument torch
refuses. Only boolean-mask indexing and one-argument `where`, whose results are never bigger than
their input, may skip that and are sized after they run. Every failure is a UserError naming the
node and the datum; the op then fails and the adapter is untouched (training.py).
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from tinkerd import lossgraph
from tinkerd.engine.losses.params import DATUM_INDEX
from tinkerd.errors import UserError
from tinkerd.types import CustomLoss, Datum

NAME = "custom"

_MODULES = {"torch": torch, "torch.functional": torch.functional, "torch.nn.functional": F, "torch._C._nn": torch._C._nn, "operator": operator,
            "math": math}


def _resolve(name: str) -> Callable:
    """The callable of one allow-listed name (our own static list, never a name from a request)."""
    if name == "getattr":
        return getattr
    module, _, attr = name.rpartition(".")
    return getattr(_MODULES[module], attr)


FUNCTIONS: dict[str, Callable] = {name: _resolve(name) for name in sorted(lossgraph.FUNCTIONS)}
# Functions that allocate a new tensor from sizes: they run on the loss's own device, whatever the
# client traced with.
_FACTORIES = {FUNCTIONS[f"torch.{n}"] for n in ("zeros", "ones", "full", "arange", "tensor")}
_NEW_METHODS = {"new_zeros", "new_ones", "new_full"}
# Their result size depends on values, not shapes (meta tensors cannot size them), and is never
# bigger than their input: they are sized after they run.
_DATA_DEPENDENT_OK = {FUNCTIONS["operator.getitem"], FUNCTIONS["torch.where"]}
_DTYPES = {name: getattr(torch, name) for name in lossgraph.DTYPES}
_MEMORY_FORMATS = {name: getattr(torch, name) for name in lossgraph.MEMORY_FORMATS}
_META = torch.device("meta")


class _Ref:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _Device:
    """A device constant in the graph: it means the loss's own device."""


_DEVICE = _Device()


def _decode(arg: Any) -> Any:
    """The wire encoding of an argument (tinker/types/custom_loss_graph.py) as a template: Python
    values, with `_Ref` where a node's value goes."""
    if isinstance(arg, list):
        return [_decode(a) for a in arg]
    if not isinstance(arg, dict):
        return arg
    (kind, value), = arg.items()
    if kind == "ref":
        return _Ref(value)
    if kind == "tuple":
        return tuple(_decode(a) for a in value)
    if kind == "dict":
        return {k: _decode(a) for k, a in value.items()}
    if kind == "slice":
        return slice(*(_decode(a) for a in value))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(value)
    if kind == "dtype":
        return _DTYPES[value]
    if kind == "device":
        return _DEVICE
    if kind == "layout":
        return torch.strided
    if kind == "memory_format":
        return _MEMORY_FORMATS[value]
    raise UserError(f"custom loss: unknown argument kind {kind!r}")  # lossgraph.check refuses it first


def _fill(template: Any, env: dict[str, Any], device: torch.device) -> Any:
    if isinstance(template, _Ref):
        return env[template.name]
    if template is _DEVICE:
        return device
    if isinstance(template, list):
        return [_fill(a, env, device) for a in template]
    if isinstance(template, tuple):
        return tuple(_fill(a, env, device) for a in template)
    if isinstance(template, dict):
        return {k: _fill(a, env, device) for k, a in template.items()}
    if isinstance(template, slice):
        return slice(_fill(template.start, env, device), _fill(template.stop, env, device),
                     _fill(template.step, env, device))
    return template


def _walk(value: Any):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, slice):
        yield from _walk((value.start, value.stop, value.step))
    else:
        yield value


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(_META)
    if isinstance(value, torch.device):
        return _META
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        out = [_to_meta(v) for v in value]
        return type(value)(out) if not hasattr(value, "_fields") else type(value)(*out)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_to_meta(value.start), _to_meta(value.stop), _to_meta(value.step))
    return value


@dataclass
class _Node:
    name: str
    op: str  # placeholder | call_function | call_method | output
    target: str
    fn: Callable | None
    args: Any
    kwargs: Any


class Program:
    """One uploaded graph, decoded once: `run` interprets it on one datum's tensors."""

    def __init__(self, spec: CustomLoss):
        graph = json.loads(spec.graph_json)
        # Checked again here, not only at creation: the engine trusts no stored row it did not check.
        lossgraph.check(spec.name, list(zip(spec.input_names, spec.input_ranks)), graph)
        self.name = spec.name
        self.nodes = [
            _Node(n["name"], n["op"], n["target"], FUNCTIONS.get(n["target"]) if n["op"] == "call_function" else None,
                  _decode(n.get("args", [])), {k: _decode(v) for k, v in n.get("kwargs", {}).items()})
            for n in graph["nodes"]
        ]
        self._sized: set[tuple] = set()  # input signatures whose meta pass passed (run)
        self._shadow = True
        self._data_dependent = False

    def run(self, values: list[torch.Tensor], cap: int, datum: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        device = values[0].device
        # Every shape in the graph is a function of the input shapes, unless a data-dependent node ran:
        # once inputs of these shapes went through without one, the meta pass is known to pass.
        signature = (cap, *((tuple(v.shape), v.dtype) for v in values))
        self._shadow = signature not in self._sized
        self._data_dependent = False
        env: dict[str, Any] = {}
        inputs = iter(values)
        for node in self.nodes:
            where = f"custom loss {self.name!r} node {node.name!r} ({node.target}) on datum {datum}"
            if node.op == "placeholder":
                env[node.name] = next(inputs)
                continue
            args = _fill(node.args, env, device)
            kwargs = _fill(node.kwargs, env, device)
            if node.op == "output":
                result = _result(args[0], where)
                if not self._data_dependent and len(self._sized) < 1024:
                    self._sized.add(signature)
                return result
            env[node.name] = self._call(node, args, kwargs, device, cap, where)
        raise UserError(f"custom loss {self.name!r} has no output node")

    def _call(self, node: _Node, args: list, kwargs: dict, device: torch.device, cap: int, where: str) -> Any:
        if node.op == "call_method":
            if not args or not isinstance(args[0], torch.Tensor):
                raise UserError(f"{where}: method {node.target} is called on a {type(args[0]).__name__ if args else 'nothing'}, "
                                f"not a tensor")
            if node.target == "to" and any(isinstance(v, str) for v in _walk((args, kwargs))):
                raise UserError(f"{where}: .to() takes a dtype here; the loss runs on the server's device")
            name = node.target
            fn: Callable = lambda *a, **k: getattr(a[0], name)(*a[1:], **k)  # noqa: E731
        else:
            fn = node.fn
            if fn is getattr:
                if not isinstance(args[0], torch.Tensor):
                    raise UserError(f"{where}: reads {args[1]!r} of a {type(args[0]).__name__}, not of a tensor")
                return getattr(args[0], args[1])
        if fn in _FACTORIES or node.target in _NEW_METHODS:
            kwargs = {**kwargs, "device": device}
        has_tensor = any(isinstance(v, torch.Tensor) for v in _walk((args, kwargs)))
        if not has_tensor and fn not in _FACTORIES:
            _check_python_op(fn, args, where)
        elif self._shadow:
            try:  # the same call on meta tensors: its result's shape without allocating it
                shadow = fn(*_to_meta(args), **_to_meta(kwargs))
            except NotImplementedError as e:
                if fn not in _DATA_DEPENDENT_OK:
                    raise UserError(f"{where}: its result size depends on tensor values, which the server cannot "
                                    f"bound before running it ({e})") from e
                self._data_dependent = True
            except Exception as e:  # torch's own message: wrong shapes, dtypes or arguments
                raise UserError(f"{where}: {type(e).__name__}: {_short(e)}") from e
            else:
                _check_size(shadow, cap, where)
                _check_work(fn, node.target, args, shadow, where)
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            raise UserError(f"{where}: {type(e).__name__}: {_short(e)}") from e
        _check_size(out, cap, where)
        return out


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _check_size(value: Any, cap: int, where: str) -> None:
    for v in _walk(value):
        if isinstance(v, torch.Tensor):
            if v.numel() > cap:
                raise UserError(f"{where}: makes a tensor of shape {list(v.shape)} ({v.numel()} cells); this loss may "
                                f"make at most {cap}")
            if v.is_complex():
                raise UserError(f"{where}: complex tensors are not supported")
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int) and abs(v) > 2**62:
            raise UserError(f"{where}: integer result {v} is out of range")
    if isinstance(value, (str, list, tuple)) and not isinstance(value, torch.Size) and len(value) > lossgraph.MAX_STRING:
        raise UserError(f"{where}: a Python value of length {len(value)}; at most {lossgraph.MAX_STRING}")


_CONTRACTIONS = {FUNCTIONS["torch.matmul"], FUNCTIONS["operator.matmul"]}


def _check_work(fn: Callable, target: str, args: list, shadow: Any, where: str) -> None:
    """Matrix products are the one way to much compute from tensors under the cell limit: two
    [4096, 4096] operands cost 137 GFLOP. Bound multiply-adds, counted on the meta shapes."""
    if fn in _CONTRACTIONS or target == "matmul":
        a = args[0]
        work = shadow.numel() * (a.shape[-1] if isinstance(a, torch.Tensor) and a.ndim else 1)
    elif fn is FUNCTIONS["torch.functional.einsum"]:
        sizes: dict[str, int] = {}
        operands = args[1:] if not (len(args) == 2 and isinstance(args[1], (list, tuple))) else args[1]
        letters = [part for part in str(args[0]).split("->")[0].split(",")]
        for spec, t in zip(letters, operands):
            if isinstance(t, torch.Tensor) and "..." not in spec:
                for letter, size in zip(spec.strip(), t.shape):
                    sizes[letter] = size
        work = math.prod(sizes.values()) if sizes else 0
    else:
        return
    if work > lossgraph.MAX_MATMUL_WORK:
        raise UserError(f"{where}: about {work:.2e} multiply-adds; a custom loss may do at most "
                        f"{lossgraph.MAX_MATMUL_WORK:.2e} in one product")


def _check_python_op(fn: Callable, args: list, where: str) -> None:
    """Arithmetic on Python values (shape sizes): refuse what would take unbounded time or memory."""
    if fn is operator.pow and len(args) == 2 and all(isinstance(a, (int, float)) for a in args):
        base, exp = args
        if abs(exp) > 64 or (isinstance(base, int) and isinstance(exp, int) and abs(base) > 2**32):
            raise UserError(f"{where}: {base} ** {exp} is out of range")
    if fn is operator.mul and any(isinstance(a, (str, list, tuple)) for a in args):
        n = next((a for a in args if isinstance(a, int)), 0)
        seq = next(a for a in args if isinstance(a, (str, list, tuple)))
        if len(seq) * max(n, 0) > lossgraph.MAX_SEQUENCE:
            raise UserError(f"{where}: repeats a sequence to more than {lossgraph.MAX_SEQUENCE} items")


def _result(output: Any, where: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, metrics = output
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        raise UserError(f"{where}: the loss must be a floating-point tensor, got {type(loss).__name__}"
                        f"{'' if not isinstance(loss, torch.Tensor) else ' of ' + str(loss.dtype)}")
    if loss.ndim != 0:
        raise UserError(f"{where}: the loss must be a scalar, got shape {list(loss.shape)}")
    for key, value in metrics.items():
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise UserError(f"{where}: metric {key!r} must be a one-element tensor")
    return loss, metrics


# -------------------------------------------------------------------------------------------------
# binding a stored loss to one forward_backward's data


@dataclass
class Bound:
    """A custom loss with one request's per-datum inputs: `loss` is what training.py calls on the
    concatenated target logprobs; `data` the datums with only what the engine itself reads."""

    loss: Any  # losses.LossFn
    data: list[Datum]
    datum_loss: Callable[[int, torch.Tensor], torch.Tensor]


def _datum_inputs(spec: CustomLoss, i: int, datum: Datum) -> list[torch.Tensor]:
    given = datum.loss_fn_inputs
    if "target_tokens" not in given:
        raise UserError(f"datum {i}: loss_fn {NAME} requires loss_fn_inputs ['target_tokens']")
    target_rank = np.asarray(given["target_tokens"]).ndim
    if target_rank != spec.input_ranks[0]:
        raise UserError(f"datum {i}: target_tokens has rank {target_rank}, but loss {spec.name!r} declared logprobs "
                        f"with rank {spec.input_ranks[0]}")
    out = []
    for key, rank in zip(spec.input_names[1:], spec.input_ranks[1:]):
        if key not in given:
            raise UserError(f"datum {i} has no loss_fn_inputs[{key!r}], which loss {spec.name!r} takes")
        arr = np.asarray(given[key])
        if rank == 0:
            # The wire has no empty shape: a scalar arrives as one value.
            if arr.size != 1:
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has {arr.size} values, but loss {spec.name!r} "
                                f"declared it a scalar")
            arr = arr.reshape(())
        elif arr.ndim != rank:
            raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has rank {arr.ndim}, but loss {spec.name!r} declared "
                            f"{key} with rank {rank}")
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] must be numeric, got {arr.dtype}")
        # The dtype the client sent (float32 or int64), as the SDK's TensorData.to_torch gives it.
        out.append(torch.from_numpy(np.array(arr)))
    return out


def bind(spec: CustomLoss, data: list[Datum], program: Program | None = None) -> Bound:
    from tinkerd.engine.losses import LossFn  # the registry imports this module

    program = program or Program(spec)
    per_datum = [_datum_inputs(spec, i, d) for i, d in enumerate(data)]
    caps = [max(lossgraph.MAX_TENSOR_CELLS, 4 * max([x.numel() for x in xs] + [np.asarray(d.loss_fn_inputs["target_tokens"]).size]))
            for xs, d in zip(per_datum, data)]

    def datum_loss(i: int, lp: torch.Tensor) -> torch.Tensor:
        loss, _ = program.run([lp, *per_datum[i]], caps[i], i)
        return loss

    def fn(target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config) -> tuple[torch.Tensor, dict[str, float]]:
        counts = torch.bincount(inputs[DATUM_INDEX], minlength=len(data)).tolist()
        total: torch.Tensor | None = None
        sums: dict[str, float] = {}
        start = 0
        for i, n in enumerate(counts):
            lp = target_logprobs[start:start + n]
            start += n
            loss, metrics = program.run([lp, *per_datum[i]], caps[i], i)
            total = loss if total is None else total + loss
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach().reshape(()))
        assert total is not None
        if target_logprobs.requires_grad and not total.requires_grad:
            raise UserError(f"custom loss {spec.name!r} does not depend on logprobs, so it has no gradient")
        out = {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}
        out["loss:sum"] = float(total.detach())
        return total, out

    loss = LossFn(name=NAME, fn=fn, required_inputs=("target_tokens",), config_defaults={"loss_id": None})
    stripped = [Datum(tokens=d.tokens, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in data]
    return Bound(loss, stripped, datum_loss)
