"""Causal attention for training passes on a CPU, in query blocks that skip the keys they cannot see.

PyTorch's CPU flash-attention kernel (the one SDPA picks for fp32 and bf16) splits the keys in
blocks of 512 and skips only whole blocks past the diagonal, so up to 512 tokens a causal row costs
what a full one does: measured here (1 thread, SmolLM2's 9 query and 3 key/value heads of 64, two
rows, forward + backward) causal 14.2 ms against 13.8 full at 256 tokens, 57.6 against 54.8 at 512.
Run in blocks of queries, each against the keys up to its own last position (the first block
causal, the others with the additive mask that block needs), the same kernel does about half the
work: 256 tokens 14.4 -> 9.9 ms, 512: 55.7 -> 34.6, 1024: 161 -> 127, 2048: 529 -> 500 (there the
kernel's own skipping already does most of it). A SmolLM2 rank-32 step (benchmarks/causal_attention.py,
in-process, alternating): 2 x 256 tokens 1.024x at 1 thread, ~1.01x at 2 (there the blocks' extra
calls cost about what they save); 2 x 512 at 2 threads 1.054x.

From causal_gemm.MIN_WIDTH to MAX_WIDTH tokens (224-4096), with oneDNN on (engine/gemm.py), the
blocks are not this kernel's calls but oneDNN GEMMs and torch's softmax (engine/causal_gemm.py:
1.2-1.9x faster again on these shapes on an AMD CPU), cut by that module's `spans` and held to the
same mask rule; a bf16 pass's attention goes there too, computed in fp32. Not on a CPU where the
flash kernel is the faster (engine/cpu.py): an Intel CPU's MKL in fp32 (there these blocks, 1 thread,
2 x 256 tokens: 7.1 ms against the GEMM blocks' 11.2; 2 threads 4.4 against 7.7), and AMX in bf16,
where HF's one SDPA call runs (4.5 ms against 7.9 at 2 threads).

On that Intel CPU the one call also wins on long rows without a mask: with is_causal the kernel
skips whole key blocks past the diagonal by itself, in query tiles of 256 from 768 queries, while
a block's call of fewer queries runs tiles of 32-64. SmolLM2's attention, fp32, forward + backward
of a layer, ms at 2 threads (1 thread), the one call / blocks of T/16 queries / blocks of 256:
1 x 1024 tokens 33.1 (47.6) / 36.2 (44.4) / 31.7 (45.5); 1 x 1536: 60.6 (90.1) / 76.2 (97.0) /
66.0 (96.2); 1 x 2048: 110 (150) / 136 (175) / 122 (166); 1 x 3072: 220 (316) / 252 (361) / 247
(359); 1 x 4096: 389 (531) / 445 (656) (T/16 is 256). With a padding mask the kernel computes every
key (is_causal is off) and the blocks win at every width: 2 x 1024 73.4 (135) / 54.7 (92.7) / 52.4
(92.5); 2 x 2048 304 (549) / 218 (368) / 196 (330). So there (`cpu.mkl_avx512`) an unmasked call
of PLAIN_FROM tokens or more is HF's own, and the blocks are LONG_BLOCK queries from LONG_WIDTH.
(On the AMD CPU the blocks won at every width measured: the numbers above.)

fp32 only: in bf16 the kernel's per-call cost ate the gain (1 thread, the shapes above: 256 tokens
16.4 -> 18.0 ms, 512: 54.9 -> 49.5, 1024: 132 -> 167), and the keys' gradients summed block by
block would round in bf16 at every block where the one call rounds once (with AMX, blocks of 256
beat a padded one call from 1024 tokens, 2 x 2048 195 -> 144 ms a layer, but d k came out ~1.3x
further from float64 than the call's).

With AMX, a bf16 attention up to WIDE_BACKWARD tokens keeps HF's one call forward (its output to the
bit) and runs its backward as the fp32 kernel's, in these query blocks, from q, k, v, the output and
the gradient widened to fp32, with the forward's logsumexp (the same per row: a block's query sees
the same keys); d q, d k and d v are rounded to bf16 once. The bf16 kernel's own backward is the slow
half of that call on this CPU (SmolLM2's heads, 2 rows, a layer forward + backward, one call ->
this, 2 threads (1 thread): 128 tokens 4.4-4.9 -> 2.2-2.3 ms, 256: 5.9-6.2 -> 5.4-5.6 (10.9-11.5 ->
8.9-9.3), 384: 10.4-10.9 -> 11.0-11.4, 512: 16.4-18.8 -> 17.4-18.5, 1024: 43 -> 53-55), and the
gradients come out nearer float64 (relative error of d k 4.8e-3 -> 1.9e-3 at 256 tokens).

Right-padded rows (a batch of datums of different lengths: HF's sdpa_mask with nothing but causality
and each row's length) are the common mask, and a mask turns the kernel's own skipping off: the call
computes every key. With AMX a bf16 attention of such rows wider than the kernel's key block
(KEY_BLOCK, 512: narrower, the one call has a single key block to skip) runs each row alone at its
own length without a mask, and its padding gets zeros (nothing reads it: no real query sees its
keys, and its positions' gradient is zero). A layer forward + backward, 2 threads (1 thread), the
padded one call -> row by row: rows of 2048 and 1900 tokens 213 -> 151 ms (421 -> 228), 1600 and
1200 136 -> 83 (275 -> 132), 1100, 900, 1000 and 1024 144 -> 108 (279 -> 156), 600 and 500 30.5 ->
22.7 (54.7 -> 31.1), 520 and 400 24.4 -> 17.5; at 512 and below the rows lost at 2 threads (512 and
450 15.7 -> 17.3, 256 and 200 5.2 -> 6.4; 1 thread 29.3 -> 26.2, 10.3 -> 9.7). A row's bits then
depend on its own length, alike alone and in a shared pass. In fp32 on that CPU the blocks of 256
with the mask ran as fast as the rows one by one at 2 threads (199 against 213 ms for the first
pair; 367 against 330 at 1 thread), so there the mask stays.

It applies where HF's SDPA call would be a self-attention in which no query of a block sees a key
past the block's last position: a CPU tensor, as many queries as keys, no dropout, and no mask (HF's
is_causal) or a boolean one (HF's sdpa_mask, True = attend) that keeps to that: causal, padding,
sliding windows; a prefix seen whole inside the first block is computed exactly too. A call over
more keys than queries under a mask (queries reading cached keys and values: the sampler's prompt
chunks, engine/prefixes.py's suffixes) runs as HF's with the key/value heads left grouped
(`_grouped_call`). Anything else, and every other call without `tinkerd_causal_blocks` (the
sampler's, HF's own), goes to transformers' `sdpa_attention_forward` unchanged. The result is
the same attention up to rounding (each row's softmax now sums over its own keys only; against the
one-call kernel, 2e-6 on these shapes), and a row's bits depend only on its width, as before: the
blocks are cut from the width alone, so a run's rows give the same bits alone and in a shared pass
(engine/grouped.py calls this per run).
"""

from __future__ import annotations

import functools
import weakref

import torch

from tinkerd.engine import causal_gemm, cpu

IMPLEMENTATION = "tinkerd_sdpa"
# Queries per block: small blocks skip the most keys, but each is a kernel call (forward, backward).
# 32 was fastest up to 512 tokens on this CPU, 64-128 beyond (the numbers above).
MIN_BLOCK = 32
BLOCKS = 16
# On an Intel CPU's MKL (engine/cpu.py), measured in the module docstring: queries per block from
# LONG_WIDTH tokens, and the kernel's one call for an unmasked attention from PLAIN_FROM.
LONG_WIDTH, LONG_BLOCK = 1024, 256
PLAIN_FROM = 1536
# The kernel's key block: a bf16 attention of right-padded rows wider than this runs row by row on AMX.
KEY_BLOCK = 512
# Widest bf16 attention whose backward runs as the fp32 kernel's blocks on AMX (module docstring).
WIDE_BACKWARD = 256

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def spans(t: int) -> list[tuple[int, int]]:
    """The query blocks [start, stop) of a width-t attention: a function of t alone (on a machine)."""
    size = LONG_BLOCK if t >= LONG_WIDTH and cpu.mkl_avx512() else max(MIN_BLOCK, t // BLOCKS)
    return [(s, min(t, s + size)) for s in range(0, t, size)]


def sdpa_attention(module, query, key, value, attention_mask, tinkerd_causal_blocks: bool = False, **kwargs):
    """transformers' SDPA attention function (query/key/value [B, heads, T, d], returns [B, T, heads, d]),
    in causal query blocks when the training pass asks for it and the call is one they fit."""
    from transformers.integrations import sdpa_attention as hf

    if _reads_cached_prefix(module, query, key, attention_mask, kwargs):
        return _grouped_call(query, key, value, attention_mask, kwargs.get("scaling")), None
    if tinkerd_causal_blocks:
        scale = kwargs.get("scaling")
        lengths = _row_lengths(module, query, key, attention_mask, kwargs)
        if lengths is not None:  # right-padded rows, each its own unmasked call at its own length
            return _by_row(module, query, key, value, lengths, kwargs), None
        if causal_gemm.fits(query, attention_mask):  # fp32 or bf16
            if _fits(module, query, key, attention_mask, kwargs, causal_gemm.spans):
                return causal_gemm.attend(query, key, value, attention_mask, scale).transpose(1, 2), None
        elif _blocks_win(query, attention_mask) and _fits(module, query, key, attention_mask, kwargs):
            return CausalBlocks.apply(query, key, value, attention_mask, scale).transpose(1, 2), None
        elif _widened_backward(query, attention_mask) and _fits(module, query, key, attention_mask, kwargs):
            return WidenedBackward.apply(query, key, value, attention_mask, scale).transpose(1, 2), None
    return hf.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _reads_cached_prefix(module, query, key, attention_mask, kwargs) -> bool:
    """Whether this is a call over more keys than queries (queries reading cached keys and values: a
    sampler's prompt chunk after kept columns, engine/prefixes.py's suffixes after their group's
    prompt) with grouped key/value heads, under a mask, on a CPU. HF's SDPA call widens keys and
    values to the query heads there (repeat_kv: torch's CUDA kernels take no grouped heads under a
    mask), and a training backward then zeroes, fills and sums gradients of that widened size; torch's
    CPU flash kernel takes the grouped heads and that mask itself. A prompt chunk (forward only) gets
    the widened call's bits; SmolLM2, 2 threads, a 1,024-token prompt's prefill 1.03x, 4 x 256 1.016x."""
    return (query.device.type == "cpu" and key.shape[2] > query.shape[2] > 1 and attention_mask is not None
            and getattr(module, "num_key_value_groups", 1) > 1 and not _extras(kwargs))


def _extras(kwargs) -> bool:
    """Whether HF's call carries anything beyond plain scaled-dot-product attention (dropout, a logit
    softcap, a position bias, attention sinks), which only its own call handles."""
    return bool(kwargs.get("dropout", 0.0)) or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux"))


def _grouped_call(query, key, value, attention_mask, scale) -> torch.Tensor:
    """[B, Tq, heads, d]: HF's SDPA call with the key/value heads left grouped (enable_gqa). Its
    output and query gradient are HF's bits; the key and value gradients sum a group's query heads
    inside the kernel, so they round in another order than the widened call's sum (~1 ulp). SmolLM2
    (9 query heads over 3), a layer's 32 suffixes of 63 tokens over 319 keys, forward + backward:
    69-76 ms widened against 38-40 grouped at 2 threads, 121-142 against 71-80 at 1."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _blocks_win(query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether the flash kernel's blocks beat its one call here (module docstring): fp32, except an
    unmasked call (HF's is_causal: the kernel skips the key blocks past the diagonal itself) from
    PLAIN_FROM tokens on an Intel CPU's MKL."""
    return query.dtype == torch.float32 and not (
        attention_mask is None and query.shape[2] >= PLAIN_FROM and cpu.mkl_avx512())


def _widened_backward(query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether a bf16 attention's backward runs as the fp32 kernel's blocks (module docstring): AMX,
    at most WIDE_BACKWARD tokens, and a mask (if any) of HF's [B or 1, 1, T, T] shape."""
    return (query.dtype == torch.bfloat16 and query.shape[2] <= WIDE_BACKWARD and cpu.amx()
            and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)))


def _row_lengths(module, query, key, attention_mask, kwargs) -> list[int] | None:
    """Each row's real length where `attention_mask` is right padding alone (row b: causal, keys
    below n_b) in a bf16 attention wider than KEY_BLOCK on AMX, else None: such a mask turns the
    kernel's skipping off, and row by row at its own length none is needed (module docstring)."""
    t = query.shape[2]
    if (attention_mask is None or query.dtype != torch.bfloat16 or t <= KEY_BLOCK or not cpu.amx()
            or attention_mask.dtype != torch.bool or attention_mask.shape != (query.shape[0], 1, t, t)):
        return None
    if not _fits(module, query, key, None, kwargs):  # dropout, softcap, sinks, ...: HF's
        return None
    return _right_padding(attention_mask)


# Masks _right_padding read lately: (a weak reference to the tensor, the view's place and version,
# the lengths). HF makes a pass's mask once and hands it (a shared pass: the same view of it per run,
# engine/grouped.py) to every layer; the check reads B x T^2 values, a few ms at 2048 tokens, so it
# runs once per mask and pass.
_seen: list[tuple] = []
SEEN = 8


def _right_padding(sees: torch.Tensor) -> list[int] | None:
    """Per row b, n_b where sees[b, 0] is exactly (j <= i) & (j < n_b) (HF's sdpa_mask of a
    right-padded row) with n_b >= 1, else None."""
    base = sees if sees._base is None else sees._base
    key = (sees.storage_offset(), tuple(sees.shape), sees.stride(), sees._version)
    for ref, seen_key, found in _seen:
        if ref() is base and seen_key == key:
            return found
    t = sees.shape[-1]
    lengths = sees[:, 0, -1].sum(-1).tolist()  # the last query sees every real key
    tril, keys = torch.ones(t, t, dtype=torch.bool).tril(), torch.arange(t)
    right = all(n >= 1 and torch.equal(sees[b, 0], tril & (keys < n)) for b, n in enumerate(lengths))
    found = lengths if right else None
    _seen[:] = [(weakref.ref(base), key, found)] + [e for e in _seen[: SEEN - 1] if e[0]() is not None]
    return found


def _by_row(module, query, key, value, lengths: list[int], kwargs) -> torch.Tensor:
    """[B, T, heads, d]: row b's attention over its first n_b positions without a mask (HF's one
    call), and zeros past them. Those are padding: no real query sees their keys, and nothing reads
    their outputs but their own positions, whose gradient is zero; so the real positions get what the
    masked call gives them, up to its rounding (engine/grouped.py widens a run's rows the same way)."""
    t = query.shape[2]
    rows = []
    for b, n in enumerate(lengths):
        q, k, v = (x[b : b + 1, :, :n] for x in (query, key, value))
        o, _ = sdpa_attention(module, q, k, v, None, tinkerd_causal_blocks=True, **kwargs)  # [1, n, heads, d]
        rows.append(widen(o, t))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def widen(o: torch.Tensor, t: int) -> torch.Tensor:
    """An output [B, w, ...] padded with zeros to width t along dim 1: rows' padding (here, and a
    shared pass's runs narrower than the pass, engine/grouped.py)."""
    w = o.shape[1]
    return o if w == t else torch.nn.functional.pad(o, (0, 0) * (o.dim() - 2) + (0, t - w))


def _fits(module, query, key, attention_mask, kwargs, cuts=spans) -> bool:
    """Whether the blocks `cuts` makes compute this call exactly (module docstring)."""
    t = query.shape[2]
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if query.device.type != "cpu" or not is_causal or key.shape[2] != t or t < 2 * MIN_BLOCK or _extras(kwargs):
        return False
    if attention_mask is None:
        return True
    if attention_mask.dtype != torch.bool or attention_mask.shape[-2:] != (t, t):
        return False
    return not any(bool(attention_mask[..., s:e, e:].any()) for s, e in cuts(t)[:-1])  # no query sees a later block


def _mask(sees: torch.Tensor | None, s: int, e: int, like: torch.Tensor) -> torch.Tensor | None:
    """Block [s, e)'s additive mask over keys [0, e): from HF's boolean mask `sees`, or causal
    (None for the first block: the kernel's own is_causal). Made when needed, forward and again
    backward, not kept: at 2048 tokens the blocks' masks of one layer would hold T^2 / 2 floats per row."""
    if sees is None:
        if s == 0:
            return None
        if e <= CACHED_KEYS:
            return _cached_causal_mask(s, e, like.dtype, like.device)
        sees = torch.ones(e - s, e, dtype=torch.bool, device=like.device).tril(s)
    else:
        sees = sees[..., s:e, :e]
    return _additive(sees, like.dtype)


def _additive(sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As SDPA itself turns a boolean mask into an additive one (0 / -inf, the query's dtype)."""
    return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, float("-inf"))


# Causal blocks' masks over at most this many keys are made once and reused by every layer and
# pass (a block's mask depends on its span alone): at 2 threads, making them per call cost about
# what the blocks saved. The cache holds at most 256 blocks of <= 64 x 1024 floats (~16 widths,
# <= 32 MB); longer ones are made per call, where they are a vanishing share of the attention's work.
CACHED_KEYS = 1024


@functools.lru_cache(maxsize=256)
def _cached_causal_mask(s: int, e: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _additive(torch.ones(e - s, e, dtype=torch.bool, device=device).tril(s), dtype)


class CausalBlocks(torch.autograd.Function):
    """The flash kernel per query block, forward and backward; the keys' and values' gradients
    summed over the blocks that see them. q [B, H, T, d]; k, v [B, H_kv, T, d] (grouped-query
    attention natively, as the kernel does it); sees: HF's boolean mask [B or 1, 1, T, T] or None."""

    @staticmethod
    def forward(ctx, q, k, v, sees, scale):
        t = q.shape[2]
        # [B, T, H, d] underneath, as HF hands the output on.
        out = q.new_empty(q.shape[0], t, q.shape[1], q.shape[3]).transpose(1, 2)
        lses = []
        for s, e in spans(t):
            mask = _mask(sees, s, e, q)
            o, lse = _flash(q[:, :, s:e], k[:, :, :e], v[:, :, :e], 0.0, mask is None, attn_mask=mask, scale=scale)
            out[:, :, s:e] = o
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.sees, ctx.scale = sees, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, *lses = ctx.saved_tensors
        return (*_blocks_backward(g, q, k, v, out, lses, ctx.sees, ctx.scale), None, None)


def _blocks_backward(g, q, k, v, out, lses: list, sees, scale) -> tuple:
    """(d q, d k, d v): the flash kernel's backward per query block of spans(T), block i from its
    rows' logsumexp lses[i]; the keys' and values' gradients summed over the blocks that see them."""
    g_q = torch.empty_like(q)
    g_k = g_v = None
    # The last block first: it sees every key, so its gradients start the sums.
    for (s, e), lse in reversed(list(zip(spans(q.shape[2]), lses))):
        mask = _mask(sees, s, e, q)
        dq, dk, dv = _flash_backward(g[:, :, s:e], q[:, :, s:e], k[:, :, :e], v[:, :, :e], out[:, :, s:e], lse,
                                     0.0, mask is None, attn_mask=mask, scale=scale)
        g_q[:, :, s:e] = dq
        if g_k is None:
            g_k, g_v = dk, dv
        else:
            g_k[:, :, :e] += dk
            g_v[:, :, :e] += dv
    return g_q, g_k, g_v


class WidenedBackward(torch.autograd.Function):
    """A bf16 attention: forward HF's one flash call (is_causal, or HF's boolean mask `sees` made
    additive as SDPA makes it), backward the fp32 kernel per query block from widened tensors and
    the forward's logsumexp, d k and d v summed in fp32, each gradient rounded once (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sees, scale):
        mask = None if sees is None else _additive(sees, q.dtype)
        out, lse = _flash(q, k, v, 0.0, sees is None, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sees, ctx.scale = sees, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        g_q, g_k, g_v = _blocks_backward(*(x.float() for x in (g, q, k, v, out)),
                                         [lse[:, :, s:e] for s, e in spans(q.shape[2])], ctx.sees, ctx.scale)
        return g_q.to(q.dtype), g_k.to(k.dtype), g_v.to(v.dtype), None, None


def install(model) -> None:
    """Give an SDPA model this module's attention (HF's SDPA for every call that does not ask for
    blocks); a model on another implementation (eager, for gpt-oss's sinks) keeps its own."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(IMPLEMENTATION, sdpa_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
