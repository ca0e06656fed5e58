"""Server-side custom losses: the uploaded torch.fx graph, interpreted (engine/losses/custom.py)
against the allow-list (tinkerd/lossgraph.py), equals the same loss run by the SDK's own client-side
runner, in value, metrics and gradient; the engine applies exactly that gradient; hostile graphs are
user errors, refused before anything is allocated.

The reference is the SDK 0.38 itself: `trace_loss` and `encode_graph` make the upload exactly as
`ServiceClient.create_custom_loss` sends it, and `run_loss_handle` is what `forward_backward_custom`
runs client-side when the server does not take custom losses.
"""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, run_loss_handle, trace_loss
from torch.fx.node import _get_qualified_name

from tests.unit.engine.reference_grads import assert_grads_close, create_model, step, take_grads, weighted_cross_entropy_grads
from tinkerd import lossgraph
from tinkerd.engine.losses import DATUM_INDEX, custom
from tinkerd.errors import UserError
from tinkerd.types import CustomLoss, Datum, ForwardBackwardOp


def dpo(logprobs, weights, ref_logprobs, beta):
    """DPO on one datum holding both completions: weights +1 on chosen, -1 on rejected targets."""
    margin = beta * (weights * (logprobs - ref_logprobs)).sum()
    loss = -F.logsigmoid(margin)
    return loss, {"custom/margin:mean": margin.detach(), "custom/acc:mean": (margin > 0).float(),
                  "custom/pairs:sum": torch.ones_like(margin)}


def soft_topk(logprobs, target_distribution):
    """[T, K] logprobs against a [T, K] soft target, with a renormalised top-K entropy bonus."""
    p = torch.softmax(logprobs, dim=-1)
    ce = -(target_distribution * logprobs).sum()
    entropy = -(p * torch.log_softmax(logprobs, -1)).sum(dim=-1).mean()
    return ce - 0.01 * entropy, {"custom/entropy:mean": entropy, "custom/tokens:sum": torch.ones_like(entropy) * logprobs.shape[0]}


def shapes(logprobs, index, mask):
    """Shape arithmetic, slicing, gather with an int64 input, einsum, clamp, where, masking."""
    n = logprobs.shape[0]
    picked = torch.gather(logprobs, 0, index)
    pad = torch.zeros(n, dtype=torch.float32, device=logprobs.device)
    head = logprobs[: n // 2].sum() + torch.einsum("i,i->", logprobs, mask)
    masked = logprobs[mask > 0].mean()
    tail = torch.where(mask > 0, torch.clamp(logprobs, min=-3.0), pad).sum()
    return -(picked.sum() + head + tail + masked), {"custom/n:sum": (pad + 1).sum()}


CASES = {
    "dpo": (dpo, {"logprobs": 1, "weights": 1, "ref_logprobs": 1, "beta": 0}),
    "soft_topk": (soft_topk, {"logprobs": 2, "target_distribution": 2}),
    "shapes": (shapes, {"logprobs": 1, "index": 1, "mask": 1}),
}


def upload(fn, ranks):
    """(the SDK's handle, what the server stores and carries on the op)."""
    handle = trace_loss(fn, ranks, "session-1")
    inputs = [(i.name, int(i.rank)) for i in handle.inputs]
    graph = encode_graph(handle).model_dump(mode="json")
    graph_json = lossgraph.check(handle.name, inputs, graph)
    spec = CustomLoss("session-1:loss:0", handle.name, [n for n, _ in inputs], [r for _, r in inputs], graph_json)
    return handle, spec


def make_data(case: str, rng, lengths=(6, 4, 5)) -> tuple[list[types.Datum], list[Datum], list[torch.Tensor]]:
    """SDK datums, the engine's datums (as the codec decodes them) and per-datum logprobs."""
    sdk, ours, lps = [], [], []
    for n in lengths:
        k = 3 if case == "soft_topk" else None
        shape = (n, k) if k else (n,)
        targets = rng.integers(0, 100, shape)
        inputs = {"target_tokens": targets}
        if case == "dpo":
            inputs |= {"weights": rng.choice([-1.0, 1.0], n).astype(np.float32),
                       "ref_logprobs": -rng.random(n).astype(np.float32), "beta": np.array([0.5], np.float32)}
        elif case == "soft_topk":
            d = rng.random(shape).astype(np.float32)
            inputs |= {"target_distribution": d / d.sum(-1, keepdims=True)}
        else:
            inputs |= {"index": rng.integers(0, n, n).astype(np.int64), "mask": (rng.random(n) > 0.3).astype(np.float32)}
            inputs["mask"][0] = 1.0
        tensor_data = {key: types.TensorData.from_numpy(v.reshape(()) if key == "beta" else v) for key, v in inputs.items()}
        sdk.append(types.Datum(model_input=types.ModelInput.from_ints(list(range(n))), loss_fn_inputs=tensor_data))
        ours.append(Datum(tokens=np.arange(n), loss_fn_inputs=inputs))
        lps.append(torch.from_numpy(-rng.random(shape).astype(np.float32) * 3))
    return sdk, ours, lps


def test_the_allow_list_is_what_fx_records_and_every_name_has_its_callable():
    assert set(custom.FUNCTIONS) == lossgraph.FUNCTIONS
    for name, fn in custom.FUNCTIONS.items():
        # The SDK names a function by fx's qualified name, with `_operator` renamed `operator`.
        assert _get_qualified_name(fn).replace("_operator.", "operator.") == name
    for method in lossgraph.METHODS:
        assert hasattr(torch.Tensor, method) and not method.endswith("_"), method


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_graph_equals_the_sdk_client_side_runner(case):
    fn, ranks = CASES[case]
    handle, spec = upload(fn, ranks)
    sdk_data, data, lps = make_data(case, np.random.default_rng(1))

    client_lps = [lp.clone().requires_grad_(True) for lp in lps]
    ref_loss, ref_metrics = run_loss_handle(handle, sdk_data, client_lps)
    ref_grads = torch.autograd.grad(ref_loss, client_lps)

    bound = custom.bind(spec, data)
    lp = torch.cat(lps).requires_grad_(True)
    inputs = {DATUM_INDEX: torch.repeat_interleave(torch.arange(len(lps)), torch.tensor([len(x) for x in lps]))}
    loss, metrics = bound.loss(lp, inputs, bound.loss.resolve_config({"loss_id": spec.loss_id}))
    (grad,) = torch.autograd.grad(loss, lp)

    assert loss.item() == ref_loss.item()
    assert metrics == {**ref_metrics, "loss:sum": ref_loss.item()}
    torch.testing.assert_close(grad, torch.cat(ref_grads), rtol=0, atol=0)
    assert grad.abs().max() > 0
    # What the engine keeps per datum is only what it reads itself.
    assert all(set(d.loss_fn_inputs) == {"target_tokens"} for d in bound.data)
    assert bound.datum_loss(1, lps[1]).item() == pytest.approx(fn(lps[1], *[
        torch.from_numpy(np.asarray(data[1].loss_fn_inputs[k]).reshape(() if r == 0 else -1 if r == 1 else (len(lps[1]), -1)))
        for k, r in list(ranks.items())[1:]])[0].item(), rel=1e-6)


@pytest.fixture(scope="module")
def custom_model(engine):
    return create_model(engine, "custom-model", seed=5)


def test_the_engine_applies_exactly_the_interpreted_gradient(engine, custom_model):
    """forward_backward(custom) leaves the adapter grads of cross_entropy with weights = −dL/dlp, dL/dlp
    taken by the SDK's client-side runner on the forward's logprobs: what the SDK's two-pass path sends."""
    handle, spec = upload(*CASES["dpo"])
    rng = np.random.default_rng(4)
    sdk_data, data, _ = make_data("dpo", rng, lengths=(7, 5))
    tokens = [rng.integers(0, 150_000, len(d.tokens)) for d in data]
    for d, t in zip(data, tokens):
        d.tokens = t
        d.loss_fn_inputs["target_tokens"] = rng.integers(0, 150_000, len(t))
    ce = [Datum(tokens=d.tokens, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in data]
    lps = [torch.from_numpy(o["logprobs"]) for o in
           step(engine, ForwardBackwardOp(custom_model, ce, "cross_entropy", forward_only=True)).loss_fn_outputs]

    op = ForwardBackwardOp(custom_model, copy.deepcopy(data), "custom", {"loss_id": spec.loss_id}, custom_loss=spec)
    result = step(engine, op)
    got = take_grads(engine, custom_model)

    client_lps = [lp.clone().requires_grad_(True) for lp in lps]
    ref_loss, ref_metrics = run_loss_handle(handle, sdk_data, client_lps)
    ref_loss.backward()
    assert result.metrics == pytest.approx({**ref_metrics, "loss:sum": ref_loss.item()}, rel=1e-6)
    for o, lp in zip(result.loss_fn_outputs, lps):
        np.testing.assert_array_equal(o["logprobs"], lp.numpy())
    expected = weighted_cross_entropy_grads(engine, custom_model, [d.tokens for d in data],
                                            [d.loss_fn_inputs["target_tokens"] for d in data],
                                            [lp.grad for lp in client_lps])
    assert_grads_close(got, expected)


# --- hostile graphs: refused at creation (static) ----------------------------------------------


def _graph(fn=dpo, ranks=CASES["dpo"][1]):
    handle = trace_loss(fn, ranks, "s")
    return [(i.name, int(i.rank)) for i in handle.inputs], encode_graph(handle).model_dump(mode="json")


def _node(graph, name):
    return next(n for n in graph["nodes"] if n["name"] == name)


def _bad_function(g, target):
    _node(g, "log_sigmoid")["target"] = target


def _forward_ref(g):
    _node(g, "mul")["args"][0] = {"ref": "neg"}  # a later node: a cycle in execution order


def _self_ref(g):
    _node(g, "neg")["args"] = [{"ref": "neg"}]


def _getattr(g, attr):
    g["nodes"].insert(-1, {"op": "call_function", "name": "evil", "target": "getattr", "args": [{"ref": "logprobs"}, attr],
                           "kwargs": {}})


def _many_nodes(g):
    extra = [{"op": "call_function", "name": f"n{i}", "target": "operator.neg", "args": [{"ref": "logprobs"}], "kwargs": {}}
             for i in range(lossgraph.MAX_NODES)]
    g["nodes"][4:4] = extra


def _huge_constant(g):
    _node(g, "mul")["args"][1] = list(range(lossgraph.MAX_LITERALS + 1))


HOSTILE = {
    "eval": (lambda g: _bad_function(g, "builtins.eval"), "'builtins.eval', which is not on this server's list"),
    "os.system": (lambda g: _bad_function(g, "os.system"), "'os.system'"),
    "torch.load": (lambda g: _bad_function(g, "torch.load"), "'torch.load'"),
    "in-place method": (lambda g: _node(g, "sum_1").update(target="add_"), "method 'add_'"),
    "numpy method": (lambda g: _node(g, "sum_1").update(target="numpy"), "method 'numpy'"),
    "dunder attribute": (lambda g: _getattr(g, "__class__"), "reads attribute '__class__'"),
    "grad attribute": (lambda g: _getattr(g, "grad"), "reads attribute 'grad'"),
    "get_attr node": (lambda g: _node(g, "mul").update(op="get_attr"), "get_attr node"),
    "call_module": (lambda g: _node(g, "mul").update(op="call_module"), "call_module node"),
    "forward reference": (_forward_ref, "refers to 'neg', which is not an earlier node"),
    "self reference": (_self_ref, "refers to 'neg', which is not an earlier node"),
    "too many nodes": (_many_nodes, f"at most {lossgraph.MAX_NODES}"),
    "huge constant": (_huge_constant, f"more than {lossgraph.MAX_LITERALS} values"),
    "complex dtype": (lambda g: _node(g, "float_1")["args"].append({"dtype": "complex64"}), "dtype 'complex64'"),
    "object dtype": (lambda g: _node(g, "float_1")["args"].append({"dtype": "object"}), "dtype 'object'"),
    # Unhashable where a name is expected: a TypeError (a 500) before the checks tested isinstance first.
    "list as attribute": (lambda g: _getattr(g, ["shape"]), r"reads attribute ['shape']"),
    "list as dtype": (lambda g: _node(g, "float_1")["args"].append({"dtype": ["float32"]}), r"dtype ['float32']"),
    "unknown encoding": (lambda g: _node(g, "mul")["args"].append({"pickle": "gASV"}), "unknown argument kind 'pickle'"),
    "out= kwarg": (lambda g: _node(g, "mul")["kwargs"].update(out={"ref": "weights"}), "keyword argument 'out'"),
    "no output": (lambda g: g["nodes"].pop(), "no output node"),
    "bad metric name": (lambda g: g["nodes"][-1]["args"][0]["tuple"][1]["dict"].update({"loss:sum": {"ref": "neg"}}),
                        "metric 'loss:sum'"),
    "duplicate name": (lambda g: _node(g, "mul_1").update(name="mul"), "'mul' is defined twice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_graphs_are_refused_at_creation(case):
    mutate, message = HOSTILE[case]
    inputs, graph = _graph()
    lossgraph.check("dpo", inputs, copy.deepcopy(graph))  # the unmodified graph passes
    mutate(graph)
    with pytest.raises(UserError, match=re.escape(message)):
        lossgraph.check("dpo", inputs, graph)


def test_declared_inputs_must_match_the_placeholders():
    inputs, graph = _graph()
    with pytest.raises(UserError, match="first input must be logprobs"):
        lossgraph.check("dpo", [("weights", 1), *inputs], graph)
    with pytest.raises(UserError, match="not the declared inputs"):
        lossgraph.check("dpo", [inputs[0], inputs[2], inputs[1], inputs[3]], graph)
    with pytest.raises(UserError, match="logprobs has rank 1"):
        lossgraph.check("dpo", [("logprobs", 0), *inputs[1:]], graph)


# --- hostile at run time: sizes and values bounded before they are allocated or computed -----------


def _run(fn, ranks, data):
    _, spec = upload(fn, ranks)
    bound = custom.bind(spec, data)
    lps = [torch.zeros(len(d.tokens), requires_grad=True) for d in data]
    lp = torch.cat(lps)
    inputs = {DATUM_INDEX: torch.repeat_interleave(torch.arange(len(data)), torch.tensor([len(d.tokens) for d in data]))}
    return bound.loss(lp, inputs, {"loss_id": spec.loss_id})


def _datum(n=4, **inputs):
    return Datum(tokens=np.arange(n), loss_fn_inputs={"target_tokens": np.zeros(n, np.int64), **inputs})


def zeros_bomb(logprobs):
    big = torch.zeros(logprobs.shape[0] * 1_000_000_000, device=logprobs.device)
    return logprobs.sum() + big.sum(), {}


def repeat_bomb(logprobs):
    return logprobs.repeat(100_000, 100_000).sum(), {}


def matmul_bomb(logprobs):
    x = logprobs.repeat(2048, 512)  # [2048, 2048]: 4M cells, under the cell limit
    return (x @ x).sum(), {}


def einsum_bomb(logprobs):
    x = logprobs.repeat(2048, 512)
    return torch.einsum("ij,jk->", x, x), {}


def vector(logprobs):
    return logprobs * 2, {}


def constant(logprobs):
    return torch.ones_like(logprobs).sum().detach() * logprobs.shape[0], {}


def takes_scalar(logprobs, beta):
    return beta * logprobs.sum(), {}


@pytest.mark.parametrize("fn, message", [
    (zeros_bomb, r"node 'zeros' \(torch.zeros\) on datum 0: makes a tensor of shape \[4000000000\]"),
    (repeat_bomb, r"node 'repeat' \(repeat\) on datum 0: makes a tensor of shape \[100000, 400000\]"),
    (matmul_bomb, r"node 'matmul' \(operator.matmul\) on datum 0: about 8.59e\+09 multiply-adds"),
    (einsum_bomb, r"node 'einsum' \(torch.functional.einsum\) on datum 0: about 8.59e\+09 multiply-adds"),
    (vector, r"the loss must be a scalar, got shape \[4\]"),
    (constant, "does not depend on logprobs"),
])
def test_run_time_bombs_and_bad_results_are_user_errors(fn, message):
    with pytest.raises(UserError, match=message):
        _run(fn, {"logprobs": 1}, [_datum()])


def test_python_arithmetic_is_bounded():
    inputs, graph = _graph(vector, {"logprobs": 1})
    graph["nodes"].insert(1, {"op": "call_function", "name": "p", "target": "operator.pow", "args": [10, 10**6], "kwargs": {}})
    spec = CustomLoss("x", "vector", ["logprobs"], [1], lossgraph.check("vector", inputs, graph))
    with pytest.raises(UserError, match=r"10 \*\* 1000000 is out of range"):
        custom.Program(spec).run([torch.zeros(3)], 1 << 24, 0)


def test_wrong_input_ranks_and_missing_inputs_name_the_datum():
    ranks = {"logprobs": 1, "beta": 0}
    good = _datum(beta=np.array([0.5], np.float32))
    assert _run(takes_scalar, ranks, [good])[0].item() == 0.0
    with pytest.raises(UserError, match=r"datum 1: loss_fn_inputs\['beta'\] has 4 values.*declared it a scalar"):
        _run(takes_scalar, ranks, [good, _datum(beta=np.ones(4, np.float32))])
    with pytest.raises(UserError, match=r"datum 0 has no loss_fn_inputs\['beta'\]"):
        _run(takes_scalar, ranks, [_datum()])
    with pytest.raises(UserError, match="datum 0: target_tokens has rank 2, but loss 'takes_scalar' declared logprobs with rank 1"):
        _run(takes_scalar, ranks, [Datum(np.arange(4), {"target_tokens": np.zeros((4, 2), np.int64), "beta": np.ones(1)})])
    with pytest.raises(UserError, match=r"node 'mul' \(operator.mul\) on datum 0: RuntimeError"):
        _run(lambda logprobs, w: ((logprobs * w).sum(), {}), {"logprobs": 1, "w": 1}, [_datum(w=np.ones(3, np.float32))])


def test_a_stored_graph_with_a_foreign_operation_is_refused_by_the_engine_too():
    """The engine trusts only its own table: a row that bypassed lossgraph.check still cannot run."""
    inputs, graph = _graph(vector, {"logprobs": 1})
    graph["nodes"][1]["target"] = "builtins.exec"
    graph["nodes"][1]["op"] = "call_function"
    spec = CustomLoss("x", "vector", ["logprobs"], [1], json.dumps(graph))
    with pytest.raises(UserError, match="'builtins.exec', which is not on this server's list"):
        custom.Program(spec)


def masked_repeat(logprobs, mask):
    picked = logprobs[mask > 0]  # its size depends on the mask's values
    return picked.repeat(picked.shape[0] * 100_000).sum(), {}


def test_sizes_that_depend_on_values_are_checked_on_every_datum_of_the_same_shape():
    """The meta pass is skipped for input shapes that passed before, unless a data-dependent node
    ran: here datum 1 has datum 0's shapes but its mask makes a 64x bigger repeat, over the limit."""
    few = np.zeros(64, np.float32)
    few[0] = 1.0
    ok = _datum(64, mask=few)
    assert _run(masked_repeat, {"logprobs": 1, "mask": 1}, [ok, ok])[0].item() == 0.0
    with pytest.raises(UserError, match=r"datum 1: makes a tensor of shape \[409600000\]"):
        _run(masked_repeat, {"logprobs": 1, "mask": 1}, [ok, _datum(64, mask=np.ones(64, np.float32))])


def test_the_meta_pass_runs_once_per_input_shape():
    _, spec = upload(takes_scalar, {"logprobs": 1, "beta": 0})
    program = custom.Program(spec)
    for datum, n in enumerate((3, 3, 4)):
        program.run([torch.zeros(n), torch.tensor(0.5)], 1 << 24, datum)
    assert len(program._sized) == 2
