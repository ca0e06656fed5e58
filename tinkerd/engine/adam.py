"""The engine's own check of the AdamParams an optim_step carries (moved out of training.py).

The API bounds them where a request is decoded (api/limits.py); ops replayed from the log and ops
from in-process callers reach the engine without that, so the engine checks again before it
touches the optimizer.
"""

from __future__ import annotations

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
