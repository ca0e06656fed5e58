"""Where the engine computes and in which dtype: `--device cpu|cuda`, `--dtype float32|bfloat16`.

float32 (the default) is the exact path: every tensor fp32, bit-identical to what tinkerd did before
this option existed, and pinned to HF + PEFT at 1e-5 (tests/parity/test_lora_parity.py).

bfloat16 is the mixed-precision recipe of HF + PEFT loaded in bf16 (PEFT's default
`autocast_adapter_dtype=True` keeps the adapters fp32), which is the reference its tests derive
tolerances from (tests/parity/test_bf16_parity.py, docs/precision.md), run under
`torch.autocast("cpu", dtype=torch.bfloat16)` as mixed-precision training with fp32 master
weights is:

- base weights, activations and their gradients: bf16 (half the memory, and on this CPU oneDNN's
  avx512_core_bf16 brgemm runs a transformer-shaped linear ~2-5x faster than MKL's fp32 sgemm);
- LoRA A/B (master weights), their gradients and the AdamW moments: fp32 (a bf16 update of
  lr 1e-4 on a weight of ~0.05 would round to nothing: bf16 keeps 8 bits of mantissa);
- the LoRA branch is computed in bf16 with A/B cast to bf16 (`lora_delta_add`), as PEFT's Linear
  computes it under `torch.autocast(dtype=bfloat16)`; the copies are kept until A or B changes
  (engine/lora/casts.py);
- the head's logits are a bf16 matmul, upcast to fp32 before the log-softmax (as HF's
  ForCausalLMLoss does): a logsumexp over 49k-151k logits in bf16 is off by up to ~0.03 nats;
  losses, target logprobs and the gradient with respect to them are fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tinkerd.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: the server names a Precision before it spawns
    import torch  # the engine process, and must not pay torch's ~1 s import for that

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Precision:
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.dtype)

    @property
    def torch_device(self) -> "torch.device":
        import torch

        return torch.device(self.device)

    def check(self) -> None:
        """Refuse a device this machine lacks, by name, before any model is loaded."""
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device cuda: torch {torch.__version__} sees no CUDA device here")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")


def power_of_two(scaling: float) -> bool:
    """Whether scaling multiplies exactly (lora_delta then scales the rank-r product)."""
    return math.frexp(scaling)[0] == 0.5


def lora_delta(x: "torch.Tensor", a: "torch.Tensor", b: "torch.Tensor", scaling: float) -> "torch.Tensor":
    """scaling * (x @ A^T) @ B^T, as PEFT computes it, to the bit.

    A power-of-two scaling (alpha 32 over the SDK's power-of-two ranks: 32 / 32 = 1, 32 / 8 = 4)
    scales every product and partial sum exactly, so it gives the same bits applied to the rank-r
    product [M, R] as to the result [M, out]: there it costs a pass over R columns instead of out,
    forward and backward, or none at all when it is 1 (~3% of a SmolLM2 rank-32 step on this CPU,
    benchmarks/training.py). Any other scaling keeps PEFT's order.
    """
    u = x @ a.t()
    if power_of_two(scaling):
        return (u if scaling == 1.0 else u * scaling) @ b.t()
    return (u @ b.t()) * scaling


def lora_delta_add(out: "torch.Tensor", x: "torch.Tensor", a: "torch.Tensor", b: "torch.Tensor", scaling: float) -> "torch.Tensor":
    """out + scaling * (x @ A^T) @ B^T for a low-precision layer with fp32 master A/B.

    The branch runs in the layer's dtype with A/B cast to it for this pass, as under
    `torch.autocast` (autograd casts the gradients back, so A.grad and B.grad are fp32). Computing
    the branch in fp32 instead (PEFT without autocast) cost 1.3-1.5x per SmolLM2 step on this CPU,
    1 thread (rank 32 on every linear is ~8% of the FLOPs, but at the fp32 rate and with casts of
    every activation in and out).
    """
    return out + lora_delta(x, a.to(x.dtype), b.to(x.dtype), scaling)
