"""Random graphs against the custom-loss checker and interpreter: whatever a client uploads, the
answer is a success or a UserError (a `user` 400 or failed future), never another exception (a 500
or a dead engine op). Graphs mix allowed and refused names, references, and every argument kind."""

from __future__ import annotations

import json

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinkerd import lossgraph
from tinkerd.engine.losses import custom
from tinkerd.errors import UserError
from tinkerd.types import CustomLoss

FUNCTIONS = sorted(lossgraph.FUNCTIONS)
METHODS = sorted(lossgraph.METHODS)
REFUSED = ["builtins.eval", "os.system", "torch.load", "torch.Tensor.add_", "numpy", "__class__", ""]


def _scalar():
    return st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.integers(-2**60, 2**60),
                     st.floats(-3, 3, allow_nan=False), st.sampled_from(["sum", "mean", "i,i->", "ij->j", "shape", "dim"]))


def _arg(names: list[str]):
    good = st.one_of(
        st.sampled_from(names).map(lambda n: {"ref": n}),
        st.sampled_from(["float32", "int64", "bool"]).map(lambda d: {"dtype": d}),
        st.sampled_from(["inf", "-inf", "nan"]).map(lambda f: {"float": f}),
        st.just({"device": "cpu"}),
        st.just({"ellipsis": True}),
        st.lists(st.one_of(st.none(), st.integers(-3, 3)), min_size=3, max_size=3).map(lambda s: {"slice": s}),
    )
    # Refused encodings, rarely, so that most graphs get past the checker to the interpreter.
    bad = st.sampled_from([{"dtype": "complex64"}, {"dtype": "object"}, {"float": "big"}, {"device": "nowhere"},
                           {"pickle": "gASV"}, {"ref": "later"}])
    leaf = st.one_of(_scalar(), _scalar(), good, good, good, good, good, good, bad)
    return st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.lists(inner, max_size=3).map(lambda t: {"tuple": t})),
                        max_leaves=4)


@st.composite
def graphs(draw):
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}]
    names = ["logprobs"]
    for i in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["call_function"] * 15 + ["call_method"] * 15 + ["get_attr"]))
        pool = FUNCTIONS if op == "call_function" else METHODS
        target = draw(st.sampled_from(REFUSED) if draw(st.integers(0, 19)) == 0 else st.sampled_from(pool))
        args = [{"ref": draw(st.sampled_from(names))}] + draw(st.lists(_arg(names), max_size=2))
        if target == "getattr":
            args = [args[0], draw(st.sampled_from(["shape", "ndim", "__class__", "grad"]) | _scalar())]
        kwargs = draw(st.dictionaries(st.sampled_from(["dim", "keepdim", "min", "dim", "dim", "keepdim", "min", "out"]), _arg(names), max_size=1))
        name = f"n{i}"
        nodes.append({"op": op, "name": name, "target": target, "args": args, "kwargs": kwargs})
        names.append(name)
    # A float scalar at the end more often than chance would give one: the sum of some node.
    nodes.append({"op": "call_method", "name": "total", "target": "sum", "args": [{"ref": draw(st.sampled_from(names))}],
                  "kwargs": {}})
    loss = draw(st.sampled_from(["total", "total", *names]))
    metrics = draw(st.dictionaries(st.sampled_from(["custom/a:sum", "custom/b:mean", "custom/a:sum", "loss:sum"]),
                                   st.sampled_from(names).map(lambda n: {"ref": n}), max_size=2))
    nodes.append({"op": "output", "name": "output", "target": "output",
                  "args": [{"tuple": [{"ref": loss}, {"dict": metrics}]}], "kwargs": {}})
    return {"format": 1, "nodes": nodes}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_any_upload_is_accepted_or_a_user_error_and_any_accepted_one_runs_or_is_a_user_error(graph):
    try:
        graph_json = lossgraph.check("fuzz", [("logprobs", 1)], json.loads(json.dumps(graph)))
    except UserError:
        return
    spec = CustomLoss("s:loss:0", "fuzz", ["logprobs"], [1], graph_json)
    lp = torch.randn(5, requires_grad=True)
    try:
        loss, metrics = custom.Program(spec).run([lp], 1 << 16, 0)
    except UserError:
        return
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0
