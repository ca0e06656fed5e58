"""One decode step of the Llama family without the HF layer classes: the same math, fewer ops.

A decode step pushes B rows of one token each through every layer. On SmolLM2-135M at 8 rows the
linears take ~42 ms of a ~63 ms step through the HF modules; most of the rest is per-op overhead
of code written for any sequence length and any cache: mask construction, [B, 1, ...] reshapes and
transposes, a 5-op RMSNorm, the cache's `update` indirection, `repeat_kv`. This path runs the
model's own modules and parameters (the multi-LoRA linears, rotary embedding, norms' weights) on
[B, H] rows and writes each layer's key/value column straight into the batch cache (kv.py).

Only architectures whose decoder layer is exactly
    x += o_proj(attn(rope(norm_q(q_proj(n1(x)))), rope(norm_k(k_proj(n1(x)))), v_proj(n1(x))))
    x += down_proj(act(gate_proj(n2(x))) * up_proj(n2(x)))
with RMSNorm n1, n2 (and optional per-head q/k RMSNorm, Qwen3) are taken; anything else keeps the
HF path. Tests pin this path against the HF body's hidden states and a naive generate.

Shapes: B rows, H hidden, Hq query heads, Hk key/value heads, D head dim, W cached columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinkerd.engine.lora.layers import MultiLoraLinear, packed_linear_2d
from tinkerd.engine.sampler.kv import BatchCache

# model_type values whose HF decoder layer has the structure above (transformers 5.x).
_LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _rms_weight_eps(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _direct(linear: nn.Module):
    """h [B, in] -> [B, out] through one linear, skipping nn.Module dispatch where it can.

    A decode step calls 211 linears on SmolLM2; a wrapped one with a oneDNN-packed weight is called
    as MultiLoraLinear.forward would in sampling mode, minus ~5 us of module and reshape overhead.
    """
    if isinstance(linear, MultiLoraLinear) and linear.packed_weight is not None:
        packed, bias, add_adapters = linear.packed_weight, linear.base.bias, linear._add_adapters_inplace

        def run(h: torch.Tensor) -> torch.Tensor:
            return add_adapters(h, packed_linear_2d(h, packed, bias))

        return run
    return linear


def _fused_qkv(q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module):
    """h [B, in] -> (q, k, v) from one packed GEMM over the stacked weights; None where not all packed.

    Three skinny GEMMs (576x576, 576x192, 576x192 on SmolLM2) stream their weights at 10-18 GB/s
    against ~20 for one 576x960: -25% of this layer's projection time at 8 rows (1 and 2 threads).
    Costs one more packed copy of the q/k/v weights (66 MB on SmolLM2-135M); the per-module packed
    copies stay for prefill, which runs through the HF layers. Each projection's adapters are added
    to its slice of the output, exactly as its own MultiLoraLinear would.
    """
    layers = (q_proj, k_proj, v_proj)
    if not all(isinstance(lin, MultiLoraLinear) and lin.packed_weight is not None for lin in layers):
        return None
    biases = [lin.base.bias for lin in layers]
    if any(b is None for b in biases) != all(b is None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([lin.base.weight.detach() for lin in layers]), 8)
    sizes = [lin.out_features for lin in layers]

    def run(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = packed_linear_2d(h, packed, bias)  # [B, q + k + v]
        parts = out.split(sizes, dim=-1)
        for lin, part in zip(layers, parts):
            lin._add_adapters_inplace(h, part)
        return parts

    return run


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as HF's apply_rotary_pos_emb (rotate_half convention); x [B, heads, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class FusedDecode:
    """Callable (tokens [B], positions [B, 1], mask [B, 1, 1, W + 1], cache) -> hidden [B, H]."""

    def __init__(self, body: nn.Module):
        self.body = body
        cfg = body.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        first = body.layers[0].self_attn
        self.head_dim = getattr(first, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = float(first.scaling)
        self.layers = [self._layer(layer) for layer in body.layers]
        self.final_norm = _rms_weight_eps(body.norm)

    @staticmethod
    def build(body: nn.Module) -> FusedDecode | None:
        """The fused step for this decoder body, or None where its structure is not the one above."""
        cfg = getattr(body, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in _LLAMA_FAMILY:
            return None
        if getattr(cfg, "hidden_act", None) != "silu" or not hasattr(body, "rotary_emb"):
            return None
        try:
            return FusedDecode(body)
        except AttributeError:  # a layer without the expected modules: keep the HF path
            return None

    @staticmethod
    def _layer(layer: nn.Module) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = _rms_weight_eps(attn.q_norm) if hasattr(attn, "q_norm") else None
        k_norm = _rms_weight_eps(attn.k_norm) if hasattr(attn, "k_norm") else None
        return (
            _rms_weight_eps(layer.input_layernorm), _fused_qkv(attn.q_proj, attn.k_proj, attn.v_proj),
            (_direct(attn.q_proj), _direct(attn.k_proj), _direct(attn.v_proj)), q_norm, k_norm, _direct(attn.o_proj), _rms_weight_eps(layer.post_attention_layernorm),
            _direct(mlp.gate_proj), _direct(mlp.up_proj), _direct(mlp.down_proj),
        )

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: BatchCache) -> torch.Tensor:
        b, w = tokens.shape[0], cache.width
        hidden_size = self.body.config.hidden_size
        x = self.body.embed_tokens(tokens)  # [B, H]
        cos, sin = self.body.rotary_emb(x[:, None, :], positions)  # each [B, 1, D]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        # An additive mask, built once: SDPA turns a boolean one into this in every layer.
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        for cache_layer, (n1, qkv, projections, q_norm, k_norm, o_proj, n2, gate, up, down) in zip(
            cache.layers, self.layers
        ):
            h = F.rms_norm(x, (hidden_size,), n1[0], n1[1])
            q, k, v = qkv(h) if qkv is not None else (proj(h) for proj in projections)
            q = q.view(b, self.heads, self.head_dim)
            k = k.view(b, self.kv_heads, self.head_dim)
            v = v.view(b, self.kv_heads, self.head_dim)
            if q_norm is not None:
                q = F.rms_norm(q, (self.head_dim,), q_norm[0], q_norm[1])
            if k_norm is not None:
                k = F.rms_norm(k, (self.head_dim,), k_norm[0], k_norm[1])
            qk = _rotate(torch.cat((q, k), dim=1), cos, sin)  # [B, Hq + Hk, D]: one rotation for both
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            cache_layer.keys[:, :, w] = k
            cache_layer.values[:, :, w] = v
            attn = F.scaled_dot_product_attention(
                q[:, :, None, :], cache_layer.keys[:, :, : w + 1], cache_layer.values[:, :, : w + 1],
                attn_mask=bias, scale=self.scaling, enable_gqa=self.kv_heads != self.heads,
            )  # [B, Hq, 1, D]
            x.add_(o_proj(attn.reshape(b, self.heads * self.head_dim)))  # x is this step's own tensor
            h = F.rms_norm(x, (hidden_size,), n2[0], n2[1])
            g = F.silu(gate(h), inplace=True).mul_(up(h))
            x.add_(down(g))
        return F.rms_norm(x, (hidden_size,), self.final_norm[0], self.final_norm[1])
