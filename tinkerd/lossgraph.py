"""Server-side custom losses as data: what `create_custom_loss` may upload, checked without torch.

The SDK traces a per-datum loss `fn(logprobs, *inputs) -> (loss, metrics)` with torch.fx and sends
its graph node by node (tinker/types/custom_loss_graph.py): placeholders, then `call_function` /
`call_method` nodes whose arguments are JSON with `{"ref": name}` for earlier nodes, then one
`output`. Nothing in it is code until the engine rebuilds it (engine/losses/custom.py) from the
allow-lists below: a name not listed here is refused at creation with a `user` 400, and the engine
has a callable for exactly these names (tests/unit/engine/test_custom_loss.py checks both ways).

This module is shared by control (checks the upload) and engine (interprets it), so it imports
neither, nor torch. The checks here are the static ones; what depends on shapes (a tensor too big,
an argument torch refuses) is checked by the engine on each forward_backward, before anything is
allocated (a pass on meta tensors), and fails that op with a `user` error naming the node.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tinkerd.errors import UserError

# -- limits -----------------------------------------------------------------------------------------
MAX_NODES = 1024  # a DPO loss is ~20 nodes; fx graphs of real losses stay far below this
MAX_LITERALS = 4096  # JSON scalars in all arguments together: no smuggled constant tables
MAX_ARG_DEPTH = 8  # nesting of lists / tuples / dicts inside one argument
MAX_STRING = 128  # an einsum equation or a reduction name, not a payload
MAX_INT = 2**53  # integer literals (dims, sizes, indices); sizes are bounded again at run time
MAX_INPUTS = 16  # the SDK's own cap, logprobs included
MAX_METRICS = 32
MAX_LOSSES_PER_SESSION = 256
MAX_NAME = 128
# Per node at run time (engine): a tensor of more cells than this, or than 4x the datum's largest
# input, is refused before it is allocated.
MAX_TENSOR_CELLS = 1 << 24
# Multiply-adds of one matmul / einsum (about a second of one core): the cell limit alone allows
# products of 10^11.
MAX_MATMUL_WORK = 1 << 30
# Python values the graph computes (shape arithmetic): ints and sequences stay small.
MAX_SEQUENCE = 64

# -- the allow-lists, by the names fx records (torch.fx.node._get_qualified_name; the SDK renames
# CPython's `_operator` to `operator`) ------------------------------------------------------------
_TORCH = """
abs neg exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square sigmoid tanh relu sign floor ceil
round trunc reciprocal sin cos erf pow add sub mul div true_divide clamp clip clamp_min clamp_max
minimum maximum where masked_fill lerp logaddexp xlogy nan_to_num isfinite isnan isinf logical_and
logical_or logical_not eq ne lt le gt ge sum mean prod amax amin max min logsumexp softmax log_softmax
cumsum std var argmax argmin topk sort gather index_select take_along_dim cat stack reshape flatten
squeeze unsqueeze transpose permute narrow flip matmul dot outer numel zeros ones full arange
tensor zeros_like ones_like full_like cosine_similarity
""".split()
_FUNCTIONAL = "log_softmax softmax relu cross_entropy nll_loss kl_div mse_loss l1_loss smooth_l1_loss " \
              "binary_cross_entropy_with_logits normalize".split()
# torch.nn.functional's C builtins, named by where they live.
_C_NN = "log_sigmoid softplus one_hot".split()
_OPERATOR = """
add sub mul truediv floordiv mod pow neg pos abs getitem eq ne lt le gt ge and_ or_ xor invert matmul
""".split()
_MATH = "exp log log1p sqrt tanh floor ceil fabs".split()

FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{n}" for n in _TORCH]
    + [f"torch.nn.functional.{n}" for n in _FUNCTIONAL]
    + [f"torch._C._nn.{n}" for n in _C_NN]
    + ["torch.functional.einsum"]  # where torch.einsum is defined
    + [f"operator.{n}" for n in _OPERATOR]
    + [f"math.{n}" for n in _MATH]
    + ["getattr"]
)
# Tensor methods: no in-place ones (`add_`: they would write into logprobs or the inputs), none that
# leave torch (item, numpy, tolist) or move memory between devices (cpu, cuda, pin_memory).
METHODS: frozenset[str] = frozenset("""
sum mean prod amax amin max min logsumexp softmax log_softmax cumsum std var argmax argmin exp exp2
expm1 log log1p log2 log10 sqrt rsqrt square sigmoid tanh relu abs neg sign floor ceil round trunc
reciprocal pow clamp clip clamp_min clamp_max add sub mul div minimum maximum where masked_fill eq ne
lt le gt ge logical_and logical_or logical_not isfinite isnan isinf nan_to_num gather index_select
take_along_dim reshape view view_as flatten squeeze unsqueeze transpose t permute narrow flip expand
expand_as repeat contiguous clone detach float double bool long int to type_as size dim numel matmul
dot outer topk sort new_zeros new_ones new_full
""".split())
# `getattr(tensor, name)`: shape facts only. Everything else (`__class__`, `grad_fn`, `_cdata`,
# `data`, `grad`) is the attribute access a hostile graph would use.
ATTRIBUTES: frozenset[str] = frozenset({"shape", "dtype", "device", "ndim", "T", "mT"})
DTYPES: frozenset[str] = frozenset(
    {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"})
LAYOUTS: frozenset[str] = frozenset({"strided"})
MEMORY_FORMATS: frozenset[str] = frozenset({"contiguous_format", "preserve_format"})
# Any device a client traced on; the engine runs the loss on its own device whatever it says.
_DEVICE = re.compile(r"(cpu|cuda|mps|meta)(:\d{1,3})?")

_NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_KWARG = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_NON_FINITE = {"inf", "-inf", "nan"}


def check(name: str, inputs: list[tuple[str, int]], graph: dict[str, Any]) -> str:
    """Refuse (UserError) anything but a graph of listed operations over the declared inputs; returns
    the graph as canonical JSON, the form it is stored and carried in."""
    if not 0 < len(name) <= MAX_NAME:
        raise UserError(f"create_custom_loss: name must be 1 to {MAX_NAME} characters")
    _check_inputs(inputs)
    if graph.get("format") != 1:
        raise UserError(f"create_custom_loss: graph format {graph.get('format')!r} is not supported (1 is)")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise UserError("create_custom_loss: graph.nodes must be a non-empty list")
    if len(nodes) > MAX_NODES:
        raise UserError(f"create_custom_loss: the graph has {len(nodes)} nodes; at most {MAX_NODES} are allowed")
    budget = [MAX_LITERALS]
    seen: set[str] = set()
    placeholders: list[str] = []
    for i, node in enumerate(nodes):
        where = f"create_custom_loss: node {i}"
        node_name = node.get("name")
        if not isinstance(node_name, str) or not _NODE_NAME.fullmatch(node_name):
            raise UserError(f"{where}: name {node_name!r} must be an identifier of at most 128 characters")
        where = f"create_custom_loss: node {node_name!r}"
        if node_name in seen:
            raise UserError(f"{where} is defined twice; node names must be unique")
        op, target = node.get("op"), node.get("target")
        args, kwargs = node.get("args", []), node.get("kwargs", {})
        if not isinstance(target, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
            raise UserError(f"{where}: target must be a string, args a list and kwargs an object")
        if op == "placeholder":
            if i != len(placeholders) or args or kwargs or target != node_name:
                raise UserError(f"{where}: placeholders come first, one per input, named after it, without arguments")
            placeholders.append(node_name)
        elif op == "output":
            if i != len(nodes) - 1:
                raise UserError(f"{where}: the output node must be the graph's last node")
            if len(args) != 1 or kwargs:
                raise UserError(f"{where}: the output node takes exactly one argument, (loss, metrics)")
            _check_arg(args[0], seen, budget, where, 0)
            _check_output(args[0], where)
        elif op == "call_function":
            if target not in FUNCTIONS:
                raise UserError(f"{where} calls {target!r}, which is not on this server's list of allowed "
                                f"functions (docs/compatibility.md lists them)")
            if target == "getattr":
                _check_getattr(args, kwargs, where)
        elif op == "call_method":
            if target not in METHODS:
                raise UserError(f"{where} calls method {target!r}, which is not on this server's list of allowed "
                                f"tensor methods (in-place and device methods never are)")
            if not args:
                raise UserError(f"{where}: a method call needs the tensor it is called on as its first argument")
        elif op in ("get_attr", "call_module"):
            raise UserError(f"{where} is a {op} node; a custom loss may not read module attributes or call modules")
        else:
            raise UserError(f"{where} has unknown op {op!r}")
        if op in ("call_function", "call_method"):
            for key in kwargs:
                if not isinstance(key, str) or not _KWARG.fullmatch(key) or key == "out":
                    raise UserError(f"{where}: keyword argument {key!r} is not allowed")
            for arg in args:
                _check_arg(arg, seen, budget, where, 0)
            for arg in kwargs.values():
                _check_arg(arg, seen, budget, where, 0)
        seen.add(node_name)
    if placeholders != [n for n, _ in inputs]:
        raise UserError(f"create_custom_loss: the graph's placeholders {placeholders} are not the declared inputs "
                        f"{[n for n, _ in inputs]} in order")
    if nodes[-1].get("op") != "output":
        raise UserError("create_custom_loss: the graph has no output node")
    return json.dumps(graph, sort_keys=True, separators=(",", ":"))


def _check_inputs(inputs: list[tuple[str, int]]) -> None:
    if not inputs or inputs[0][0] != "logprobs":
        raise UserError("create_custom_loss: the first input must be logprobs")
    if len(inputs) > MAX_INPUTS:
        raise UserError(f"create_custom_loss: {len(inputs)} inputs; at most {MAX_INPUTS} are allowed, logprobs included")
    names = [n for n, _ in inputs]
    if len(set(names)) != len(names):
        raise UserError(f"create_custom_loss: input names {names} repeat")
    for n, rank in inputs:
        if not _INPUT_NAME.fullmatch(n):
            raise UserError(f"create_custom_loss: input name {n!r} must be lowercase letters, digits and underscores")
        if rank not in (0, 1, 2):
            raise UserError(f"create_custom_loss: input {n!r} has rank {rank!r}; ranks are 0, 1 or 2")
    if inputs[0][1] not in (1, 2):
        raise UserError("create_custom_loss: logprobs has rank 1 ([T]) or 2 ([T, K])")


def _check_getattr(args: list, kwargs: dict, where: str) -> None:
    if (kwargs or len(args) != 2 or not isinstance(args[0], dict) or "ref" not in args[0]
            or not isinstance(args[1], str) or args[1] not in ATTRIBUTES):
        attr = args[1] if len(args) > 1 else None
        raise UserError(f"{where} reads attribute {attr!r}; a custom loss may read only {sorted(ATTRIBUTES)} "
                        f"of a tensor")


def _check_arg(arg: Any, seen: set[str], budget: list[int], where: str, depth: int) -> None:
    """One encoded argument (tinker/types/custom_loss_graph.py: CustomLossNode.args)."""
    if depth > MAX_ARG_DEPTH:
        raise UserError(f"{where}: an argument is nested more than {MAX_ARG_DEPTH} deep")
    budget[0] -= 1
    if budget[0] < 0:
        raise UserError(f"create_custom_loss: the graph's arguments hold more than {MAX_LITERALS} values; "
                        f"pass large constants as loss_fn_inputs")
    if arg is None or isinstance(arg, bool):
        return
    if isinstance(arg, int):
        if abs(arg) > MAX_INT:
            raise UserError(f"{where}: integer constant {arg} is out of range (|x| <= 2^53)")
        return
    if isinstance(arg, float):
        if not math.isfinite(arg):
            raise UserError(f"{where}: a non-finite float must be sent as {{'float': ...}}")
        return
    if isinstance(arg, str):
        if len(arg) > MAX_STRING:
            raise UserError(f"{where}: a string constant of {len(arg)} characters; at most {MAX_STRING}")
        return
    if isinstance(arg, list):
        for a in arg:
            _check_arg(a, seen, budget, where, depth + 1)
        return
    if not isinstance(arg, dict) or len(arg) != 1:
        raise UserError(f"{where}: cannot read argument {str(arg)[:80]!r}")
    (kind, value), = arg.items()
    if kind == "ref":
        if not isinstance(value, str) or value not in seen:
            raise UserError(f"{where} refers to {value!r}, which is not an earlier node (graphs are acyclic and in "
                            f"execution order)")
    elif kind in ("tuple", "slice"):
        if not isinstance(value, list) or (kind == "slice" and len(value) != 3):
            raise UserError(f"{where}: malformed {kind} argument")
        for a in value:
            _check_arg(a, seen, budget, where, depth + 1)
    elif kind == "dict":
        if not isinstance(value, dict):
            raise UserError(f"{where}: malformed dict argument")
        for key, a in value.items():
            if len(key) > MAX_STRING:
                raise UserError(f"{where}: a dict key of {len(key)} characters; at most {MAX_STRING}")
            _check_arg(a, seen, budget, where, depth + 1)
    elif kind == "ellipsis":
        if value is not True:
            raise UserError(f"{where}: malformed ellipsis argument")
    elif kind == "float":
        if not isinstance(value, str) or value not in _NON_FINITE:
            raise UserError(f"{where}: float constant {value!r} must be 'inf', '-inf' or 'nan'")
    elif kind == "dtype":
        if not isinstance(value, str) or value not in DTYPES:
            raise UserError(f"{where}: dtype {value!r} is not allowed (allowed: {', '.join(sorted(DTYPES))})")
    elif kind == "device":
        if not isinstance(value, str) or not _DEVICE.fullmatch(value):
            raise UserError(f"{where}: device {value!r} is not a device name")
    elif kind == "layout":
        if not isinstance(value, str) or value not in LAYOUTS:
            raise UserError(f"{where}: layout {value!r} is not allowed")
    elif kind == "memory_format":
        if not isinstance(value, str) or value not in MEMORY_FORMATS:
            raise UserError(f"{where}: memory_format {value!r} is not allowed")
    else:
        raise UserError(f"{where}: unknown argument kind {kind!r}")


def _check_output(arg: Any, where: str) -> None:
    pair = arg.get("tuple") if isinstance(arg, dict) else arg
    if not isinstance(pair, list) or len(pair) != 2:
        raise UserError(f"{where}: a custom loss returns (loss, metrics)")
    loss, metrics = pair
    if not (isinstance(loss, dict) and "ref" in loss):
        raise UserError(f"{where}: the loss must be a tensor the graph computes")
    if not (isinstance(metrics, dict) and isinstance(metrics.get("dict"), dict)):
        raise UserError(f"{where}: the metrics must be a dict of tensors")
    if len(metrics["dict"]) > MAX_METRICS:
        raise UserError(f"{where}: {len(metrics['dict'])} metrics; at most {MAX_METRICS}")
    for key, value in metrics["dict"].items():
        if not METRIC_KEY.fullmatch(key):
            raise UserError(f"{where}: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean")
        if not (isinstance(value, dict) and "ref" in value):
            raise UserError(f"{where}: metric {key!r} must be a tensor the graph computes")
