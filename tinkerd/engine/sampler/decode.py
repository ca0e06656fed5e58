"""One decode step of the Llama family without the HF layer classes: the same math, fewer ops.

A decode step pushes B rows of one token each through every layer. On SmolLM2-135M at 8 rows the
linears take ~42 ms of a ~63 ms step through the HF modules; most of the rest is per-op overhead
of code written for any sequence length and any cache: mask construction, [B, 1, ...] reshapes and
transposes, a 5-op RMSNorm, the cache's `update` indirection, `repeat_kv`. This path runs the
model's own modules and parameters (the multi-LoRA linears, rotary embedding, norms' weights) on
[B, H] rows and writes each layer's key/value column straight into the batch cache (kv.py).

Measured per step here (1 thread, 8 rows, ~70 cached columns, weights on 2 MB pages): linears
~29 ms, attention ~4.5, everything else ~5. Each small op right after a GEMM costs 2-3x what it
costs alone (the GEMM's megabytes of streamed weights evict the interpreter's code and data from
L2; a oneDNN call itself has 14-24 us of fixed cost, more there), so the glue between linears is
kept to as few kernels and calls as the math allows.

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

from tinkerd.engine.lora.layers import packed_linear_2d
from tinkerd.engine.sampler.kv import BatchCache

# model_type values whose HF decoder layer has the structure above (transformers 5.x).
_LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _rms_weight_eps(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class _Linears:
    """h [B, in] -> [B, sum of outs]: one or more linears of the same input, outputs side by side.

    Called, it adds each linear's adapters to its own slice of the output, exactly as its
    MultiLoraLinear would in sampling mode; `plain` skips that for steps whose rows all read the
    base model. Both skip nn.Module dispatch (~5 us a call, 211 calls a step on SmolLM2). Siblings
    packed together (layers.PackedStack: q|k|v, gate|up) run as one GEMM; a single packed linear
    runs alone; anything else runs module by module, outputs concatenated.
    """

    def __init__(self, *linears: nn.Module):
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.packed = self.bias = None
        first = getattr(linears[0], "stack", None)
        if first is not None and first[0].members == list(linears):
            self.packed, self.bias = first[0].packed, first[0].bias
        elif len(linears) == 1 and getattr(linears[0], "packed_weight", None) is not None:
            self.packed, self.bias = linears[0].packed_weight, linears[0].base.bias

    def plain(self, h: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return self(h)
        return packed_linear_2d(h, self.packed, self.bias)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            outs = [lin(h) for lin in self.linears]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        out = packed_linear_2d(h, self.packed, self.bias)
        if len(self.linears) == 1:
            return self.linears[0]._add_adapters_inplace(h, out)
        for lin, part in zip(self.linears, out.split(self.sizes, dim=-1)):
            lin._add_adapters_inplace(h, part)
        return out


def _half_swap_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == swap_halves(x) * this."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as HF's apply_rotary_pos_emb (rotate_half convention); x [B, heads, D].

    x * cos + rotate_half(x) * sin in three kernels: the halves swapped by one roll, then mul and
    addcmul (HF's rotate_half is slice, neg, cat, then mul, mul, add).
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


class FusedDecode:
    """Callable (tokens [B], positions [B, 1], mask [B, 1, 1, W + 1], cache) -> hidden [B, H].

    The cache may keep prompts that several rows share once (kv.BatchCache(shared=True)); their
    rows' attention then reads those columns through shared.SharedPrefixes.attend.
    """

    def __init__(self, body: nn.Module):
        self.body = body
        cfg = body.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        first = body.layers[0].self_attn
        self.head_dim = getattr(first, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = float(first.scaling)
        both = [self._layer(layer) for layer in body.layers]
        self.layers, self.plain_layers = [a for a, _ in both], [p for _, p in both]
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
    def _layer(layer: nn.Module) -> tuple[tuple, tuple]:
        """This layer's parameters and linears, once with adapters and once plain (base rows only)."""
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = _rms_weight_eps(attn.q_norm) if hasattr(attn, "q_norm") else None
        k_norm = _rms_weight_eps(attn.k_norm) if hasattr(attn, "k_norm") else None
        qkv, o, gate_up, down = (
            _Linears(attn.q_proj, attn.k_proj, attn.v_proj), _Linears(attn.o_proj),
            _Linears(mlp.gate_proj, mlp.up_proj), _Linears(mlp.down_proj),
        )
        n1, n2, inner = _rms_weight_eps(layer.input_layernorm), _rms_weight_eps(layer.post_attention_layernorm), mlp.gate_proj.out_features
        return (
            (n1, qkv, q_norm, k_norm, o, n2, gate_up, inner, down),
            (n1, qkv.plain, q_norm, k_norm, o.plain, n2, gate_up.plain, inner, down.plain),
        )

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: BatchCache, adapters: bool = True
    ) -> torch.Tensor:
        """adapters=False: every row reads the base model, so no linear has adapters to add."""
        b, w = tokens.shape[0], cache.width
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        groups = hq // hk  # query heads per key/value head; head h reads kv head h // groups (HF GQA)
        hidden_size = self.body.config.hidden_size
        x = self.body.embed_tokens(tokens)  # [B, H]
        cos, sin = self.body.rotary_emb(x[:, None, :], positions)  # each [B, 1, D]
        cos, sin = cos.to(x.dtype), _half_swap_sin(sin.to(x.dtype))
        # The additive mask, built once per step for every (row, kv head): [B * Hk, 1, W + 1].
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        bias = bias.view(b, 1, w + 1).repeat_interleave(hk, dim=0)
        shared = cache.shared if cache.shared is not None and cache.shared.plan() is not None else None
        for i, (cache_layer, (n1, qkv, q_norm, k_norm, o_proj, n2, gate_up, inner, down)) in enumerate(zip(
            cache.layers, self.layers if adapters else self.plain_layers
        )):
            # narrow/select/view rather than tensor[...] indexing: right after a GEMM, with the
            # interpreter's code evicted, Python indexing costs a few us more per call.
            h = F.rms_norm(x, (hidden_size,), n1[0], n1[1])
            out = qkv(h).view(b, hq + 2 * hk, d)  # q | k | v heads
            qk = out.narrow(1, 0, hq + hk)
            if q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before the rotation
                qk = torch.cat((F.rms_norm(qk[:, :hq], (d,), *q_norm), F.rms_norm(qk[:, hq:], (d,), *k_norm)), dim=1)
            qk = _rotate(qk, cos, sin)  # [B, Hq + Hk, D]: one rotation for both
            cache_layer.keys.select(2, w).copy_(qk.narrow(1, hq, hk))
            cache_layer.values.select(2, w).copy_(out.narrow(1, hq + hk, hk))
            # Attention of one new token per row as two batched GEMMs over (row, kv head): the
            # cache's [B, Hk, W + 1, D] columns are [B * Hk, W + 1, D] views, no copy; SDPA's flash
            # kernel spends ~190 us per call on this shape, ~2x these three kernels.
            keys = cache_layer.keys.reshape(b * hk, -1, d).narrow(1, 0, w + 1)
            values = cache_layer.values.reshape(b * hk, -1, d).narrow(1, 0, w + 1)
            q = qk.narrow(1, 0, hq).reshape(b * hk, groups, d)
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=self.scaling)  # [B * Hk, G, W + 1]
            if shared is None:
                attn = torch.bmm(torch.softmax(scores, dim=-1), values)  # [B * Hk, G, D] = [B, Hq * D]
            else:  # rows of a shared prompt read its columns first (shared.py)
                attn = shared.attend(i, q, scores, values, self.scaling)
            x.add_(o_proj(attn.view(b, hq * d)))  # x is this step's own tensor
            h = F.rms_norm(x, (hidden_size,), n2[0], n2[1])
            g = gate_up(h)  # [B, 2 I]: gate | up
            x.add_(down(F.silu(g.narrow(1, 0, inner)).mul_(g.narrow(1, inner, inner))))
        return F.rms_norm(x, (hidden_size,), self.final_norm[0], self.final_norm[1])
