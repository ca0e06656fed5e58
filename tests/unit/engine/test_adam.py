"""The engine's AdamW (engine/adam.py): a gradient handed over in another memory layout than its
parameter's updates the parameter exactly as the same gradient laid out like it."""

from __future__ import annotations

import torch

from tinkerd.engine import adam


def _step(grad_parts: list[torch.Tensor], lr: float = 1e-2) -> torch.Tensor:
    param = torch.nn.Parameter(torch.full((32, 576), 0.1))
    for g in grad_parts:
        adam.add_grad(param, g.clone())  # clone keeps the layout; the first one becomes .grad itself
    optimizer = adam.new_adamw([param])
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return param.detach()


def test_a_transposed_gradient_updates_the_parameter_as_a_contiguous_one():
    torch.manual_seed(0)
    # [G, in, R] as bmm's backward makes it: run 1's gradient of A [R, in] is a transposed view.
    stacked = torch.randn(4, 576, 32) * 1e-3
    g = stacked.transpose(1, 2)[1]
    assert not g.is_contiguous()
    reference = _step([g.contiguous()])
    assert torch.equal(_step([g]), reference)
    # The reference is the update AdamW defines: foreach's, to its last bit or two.
    assert adam.new_adamw([torch.nn.Parameter(torch.zeros(1))]).defaults["fused"]
    param = torch.nn.Parameter(torch.full((32, 576), 0.1))
    param.grad = g.contiguous()
    torch.optim.AdamW([param], lr=1e-2, foreach=True).step()
    assert torch.allclose(param.detach(), reference, rtol=0, atol=1e-6)


def test_a_second_gradient_in_another_layout_adds_entry_by_entry():
    torch.manual_seed(1)
    first, second = torch.randn(32, 576), torch.randn(576, 32).t()
    assert torch.equal(_step([first, second]), _step([first, second.contiguous()]))
