"""The engine's AdamW: which kernel runs it, and the check of the AdamParams an optim_step carries.

The API bounds the parameters where a request is decoded (api/limits.py); ops replayed from the log
and ops from in-process callers reach the engine without that, so the engine checks again before it
touches the optimizer.
"""

from __future__ import annotations

import torch

from tinkerd.errors import UserError
from tinkerd.types import AdamParams


def check_params(p: AdamParams) -> None:
    """Each hyperparameter in the range where AdamW means something; a UserError naming the first that is not."""
    if not p.learning_rate >= 0:
        raise UserError(f"adam_params.learning_rate must be >= 0, got {p.learning_rate}")
    for name, beta in (("beta1", p.beta1), ("beta2", p.beta2)):
        if not 0 <= beta < 1:
            raise UserError(f"adam_params.{name} must be in [0, 1), got {beta}")
    if not p.eps >= 0:
        raise UserError(f"adam_params.eps must be >= 0, got {p.eps}")
    if not p.weight_decay >= 0:
        raise UserError(f"adam_params.weight_decay must be >= 0, got {p.weight_decay}")
    if not p.grad_clip_norm >= 0:
        raise UserError(f"adam_params.grad_clip_norm must be >= 0 (0 = no clipping), got {p.grad_clip_norm}")


def new_adamw(params: list[torch.Tensor]) -> torch.optim.AdamW:
    """An AdamW over `params` (hyperparameters are placeholders: optim_step sets them every step).

    torch's fused kernel where it has one (CPU, CUDA): one pass over each tensor and its moments,
    where `foreach` makes ~8 (lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_ ...). SmolLM2's
    rank-32 adapter, 9.8M parameters in 420 tensors: 55-75 -> 10-14 ms per step at 1 and 2 threads
    (/tmp harness, interleaved). The two differ in the last bit (~1 ulp after 3 steps), so a run
    keeps one kernel: `keep_kernel` after loading saved state.
    """
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if fused else {"foreach": True}))


def add_grad(param: torch.Tensor, g: torch.Tensor) -> None:
    """param.grad += g, with .grad in param's memory layout.

    torch 2.13's fused CPU AdamW reads a gradient in its parameter's memory order whatever the
    gradient's strides: a transposed [R, in] gradient of a contiguous A moved each entry by another
    entry's update (up to 2 x lr off against `foreach`; CUDA's fused kernel raises instead). Autograd
    gives a leaf's gradient its layout for mm but not for every op (bmm, a stacked or transposed
    parameter), so the layout is made here rather than trusted.
    """
    if param.grad is not None:
        param.grad.add_(g)  # add_ reads g by index: any layout
    elif g.stride() == param.stride():
        param.grad = g
    else:
        param.grad = torch.empty_like(param).copy_(g)  # empty_like keeps param's strides


def keep_kernel(optimizer: torch.optim.Optimizer, fresh: dict) -> None:
    """After load_state_dict, which also loads the saved groups' `fused`/`foreach` flags (a
    checkpoint of an older tinkerd says foreach): run this version's kernel, `fresh`'s."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fresh.get("fused"), fresh.get("foreach")
