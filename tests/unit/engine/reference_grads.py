"""The reference the engine-level loss tests share (test_losses, test_custom_loss,
test_stable_reinforce): a loss's forward_backward must leave exactly the adapter grads that
cross_entropy leaves with weights = -dL/dlogprobs, dL/dlogprobs taken by autograd on the forward's
logprobs (what the SDK's client-side forward_backward_custom sends)."""

from __future__ import annotations

import torch

from tinkerd.types import CreateModelOp, Datum, ForwardBackwardOp, LoraSpec


def step(engine, op):
    """One op through the engine; its exception raised, not returned."""
    (result,) = engine.run_ops([op])
    if isinstance(result, Exception):
        raise result
    return result


def create_model(engine, model_id: str, seed: int) -> str:
    step(engine, CreateModelOp(model_id, "tinkerd/tiny-qwen3", LoraSpec(rank=4, alpha=8.0, seed=seed)))
    return model_id


def take_grads(engine, model_id: str) -> list[torch.Tensor]:
    """The adapter's accumulated grads, then cleared, so the next op starts from none."""
    adapter = engine.runtime_of(model_id).pool.get(model_id)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in adapter.parameters()]
    for p in adapter.parameters():
        p.grad = None
    adapter.pending_grads = 0
    return grads


def weighted_cross_entropy_grads(engine, model_id: str, tokens, targets, dloss_dlp) -> list[torch.Tensor]:
    """The grads of cross_entropy with weights = -dL/dlogprobs (one tensor per datum), taken and
    cleared; some of them non-zero, or the comparison would prove nothing."""
    weighted = [Datum(tokens=t, loss_fn_inputs={"target_tokens": tt, "weights": -torch.as_tensor(g).numpy()})
                for t, tt, g in zip(tokens, targets, dloss_dlp)]
    step(engine, ForwardBackwardOp(model_id, weighted, "cross_entropy"))
    expected = take_grads(engine, model_id)
    assert any(e.abs().max() > 0 for e in expected)
    return expected


def split(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """A gradient over the concatenated logprobs, per datum."""
    return list(torch.split(flat, list(lengths)))


def assert_grads_close(got: list[torch.Tensor], expected: list[torch.Tensor], atol: float = 1e-7) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)

