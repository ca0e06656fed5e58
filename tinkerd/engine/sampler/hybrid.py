"""The decode batch of a hybrid linear-attention model (Qwen3.5): KV columns and per-row states.

Qwen3.5 interleaves Gated DeltaNet layers with gated full attention (3 of every 4 layers are
DeltaNet by default). A DeltaNet layer caches no keys or values: each sequence carries
    conv state       [conv_dim, K]      the last K inputs of its depthwise causal conv1d
                                        (conv_dim = 2 key_dim + value_dim, K the kernel size, 4)
    recurrent state  [Hv, Dk, Dv]       the delta rule's fast-weight memory
whose sizes do not depend on the sequence length. `HybridBatchCache` holds them per row beside
the full-attention layers' right-aligned KV columns (kv.BatchCache, unchanged for those), and its
layers are transformers' own `LinearAttentionLayer`s, so the HF modules read and update them as
they do a DynamicCache's: one decode step runs `causal_conv1d_update` on each row's conv state in
place and writes the rows' new recurrent states back.

A row's states come from its request's one-row prefill cache (a DynamicCache built from the
config, which transformers gives LinearAttentionLayers for these layers), copied n times on join
(num_samples rows share one prefill), and rows leaving the batch are dropped by index. Padding
never reaches a state: prefill is one unpadded row, and decode steps feed exactly one real token
per row (the full-attention layers' masks hide their padding columns as for a dense model).

Budget: a row's states cost `state_bytes_per_row` whatever its length; the sampler counts them
beside the KV bytes per cached position (the tiny test model: 3 layers x (96 x 4 + 4 x 8 x 16) x
4 B = 10.5 KiB per row; Qwen3.5-9B in fp32: 24 x (8192 x 4 + 32 x 128 x 128) x 4 B = 51 MiB).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from tinkerd.engine.sampler.kv import BatchCache, _Layer

LINEAR = "linear_attention"


def layer_types(config) -> list[str]:
    return list(getattr(config, "layer_types", None) or [])


def is_hybrid(config) -> bool:
    return LINEAR in layer_types(config)


def state_bytes_per_row(config, dtype: torch.dtype) -> int:
    """Bytes of one row's conv and recurrent states over every linear-attention layer (0 if none)."""
    linear = layer_types(config).count(LINEAR)
    if not linear:
        return 0
    key_dim = config.linear_key_head_dim * config.linear_num_key_heads
    value_dim = config.linear_value_head_dim * config.linear_num_value_heads
    conv = (2 * key_dim + value_dim) * config.linear_conv_kernel_dim
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return linear * (conv + recurrent) * dtype.itemsize


def new_batch_cache(config, num_layers: int, shared: bool = False) -> BatchCache:
    """An empty decode-batch cache for this model: HybridBatchCache where it has linear layers;
    `shared`: rows of one prompt read it once (shared.py; the fused decode step only)."""
    if is_hybrid(config):
        return HybridBatchCache(layer_types(config)[:num_layers])
    return BatchCache(num_layers, shared=shared)


def _states(layer: LinearAttentionCacheLayerMixin) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.conv_states[0], layer.recurrent_states[0]


class HybridBatchCache(BatchCache):
    def __init__(self, types: list[str]):
        # A linear-attention state is per row: no shared prompts (shared.py).
        super().__init__(len(types), shared=False,
                         layers=[LinearAttentionLayer() if t == LINEAR else _Layer(self) for t in types])

    def _linear(self) -> list[tuple[int, LinearAttentionLayer]]:
        return [(i, layer) for i, layer in enumerate(self.layers) if isinstance(layer, LinearAttentionLayer)]

    def join(self, prefilled: list[tuple[DynamicCache, int]], max_tokens: list[int]) -> None:
        old_rows = self.rows
        super().join(prefilled, max_tokens)  # the full-attention layers' KV columns
        for i, layer in self._linear():
            convs, recurrents = [], []
            if old_rows:
                convs.append(layer.conv_states[0])
                recurrents.append(layer.recurrent_states[0])
            for cache, n in prefilled:
                conv, recurrent = _states(cache.layers[i])  # [1, C, K], [1, Hv, Dk, Dv]
                convs.append(conv.expand(n, -1, -1))
                recurrents.append(recurrent.expand(n, -1, -1, -1))
            self._set(layer, torch.cat(convs), torch.cat(recurrents))

    def keep(self, rows: list[int]) -> None:
        if len(rows) == self.rows:
            return
        super().keep(rows)
        for _, layer in self._linear():
            idx = torch.tensor(rows, dtype=torch.long, device=layer.conv_states[0].device)
            self._set(layer, layer.conv_states[0][idx], layer.recurrent_states[0][idx])

    @staticmethod
    def _set(layer: LinearAttentionLayer, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        # Fresh contiguous tensors: the decode step updates the conv state in place, row by row.
        layer.conv_states[0] = conv.contiguous()
        layer.recurrent_states[0] = recurrent.contiguous()
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.dtype, layer.device = conv.dtype, conv.device
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True
