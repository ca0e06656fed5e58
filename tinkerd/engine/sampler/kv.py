"""The decode batch's KV cache: rows of different lengths that join and leave between steps.

Layout: per layer one keys and one values buffer [B, KV, C, D] (B rows, KV key/value heads, C
column capacity, D head dim). All rows share `width` W used columns; row r's `lengths[r]` cached
positions sit right-aligned in columns [W - len_r, W), and the columns before them are zero padding
that the attention mask hides (zeros, not garbage: a masked NaN would still poison 0 * V). Each
decode step writes one column in place, where transformers' DynamicCache concatenates the whole
cache every token (at 8 rows x 300 tokens on SmolLM2-135M that is 110 MB copied per step). Joining
or leaving rows rebuilds the buffers once, so a row costs at most two cache copies in its life.

Prompts are prefilled outside (prefill.py), chunk by chunk, into a DynamicCache of one row;
`join` copies that row in n times: num_samples completions share one prefill.
"""

from __future__ import annotations

import os

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from tinkerd.engine.sampler.shared import SharedPrefixes

# Spare columns allocated on each rebuild: max(64, W / 2), so growth copies are amortised O(1)
# per step while an idle batch does not hold much more than it uses; never more than the rows can
# still fill (their max_tokens), which is what the KV budget (budget.py) counted for them.
_MIN_SPARE_COLUMNS = 64


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one cached position of one row holds over all layers: keys and values, every kv head.

    SmolLM2-135M: 30 x 2 x 3 x 64 x 4 B = 45 KiB; Qwen3-0.6B: 28 x 2 x 8 x 128 x 4 B = 224 KiB, so 64
    rows of 3k tokens are 44 GB in fp32.
    """
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # A hybrid model's linear-attention layers cache no keys/values (sampler/hybrid.py counts their
    # per-row state): only its attention layers grow with the sequence. Sliding-window layers
    # (gpt-oss) keep every position too: the window is a mask here (window_masks), not a ring buffer.
    layer_types = getattr(config, "layer_types", None)
    layers = sum(t != "linear_attention" for t in layer_types) if layer_types else config.num_hidden_layers
    return layers * 2 * kv_heads * head_dim * dtype.itemsize


def default_kv_budget(device: torch.device) -> int:
    """The decode batch's KV cache budget when none is configured: a quarter of the device's memory.

    The cache is the one part of sampling whose size a request chooses (num_samples x (prompt +
    max_tokens)); past the machine's memory the engine would be killed, and every tenant's work with it.
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total) // 4


SLIDING = "sliding_attention"


def sliding_window(config) -> int | None:
    """The window of a model whose layers include sliding-window attention (gpt-oss), else None."""
    types = getattr(config, "layer_types", None) or ()
    return int(config.sliding_window) if SLIDING in types and getattr(config, "sliding_window", None) else None


def prefill_cache(config) -> DynamicCache:
    """A one-row cache for a prompt's prefill. With sliding-window layers every layer keeps every
    position (plain DynamicLayers): transformers' sliding layer would keep only the last window - 1,
    while the decode batch stores all columns of every layer and applies the window as a mask, and
    HF's own masks apply it in the prefill's forwards (from absolute positions)."""
    return DynamicCache() if sliding_window(config) else DynamicCache(config=config)


def window_masks(mask: torch.Tensor, width: int, window: int, dtype: torch.dtype, additive: bool) -> dict:
    """A decode step's masks by layer type, as HF's decoder takes them in a dict, for a model with
    sliding-window layers. mask [B, 1, 1, W + 1] (step_inputs); the new token sits in column W, so
    with the window's rule (a key at most window - 1 positions back) it sees columns > W - window.
    `additive`: 0 / dtype-min floats, as eager attention (gpt-oss: sinks) adds them to its scores."""
    columns = torch.arange(mask.shape[-1], device=mask.device)
    masks = {"full_attention": mask, SLIDING: mask & (columns > width - window)}
    if additive:
        masks = {k: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
                 for k, m in masks.items()}
    return masks


class _Layer(CacheLayerMixin):
    """One layer's buffers; `update` writes this step's columns and returns the used ones."""

    is_sliding = False

    def __init__(self, owner: BatchCache):
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.owner.shared is not None and self.owner.shared.count:
            raise RuntimeError("a batch cache with shared prompts is read by the fused decode step only")
        w, q = self.owner.width, key_states.shape[2]  # key_states [B, KV, q, D]
        self.keys[:, :, w : w + q] = key_states
        self.values[:, :, w : w + q] = value_states
        return self.keys[:, :, : w + q], self.values[:, :, : w + q]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return -1


def kv_layers(cache: Cache) -> list:
    """The layers of `cache` that hold keys and values, in order: all of them but a hybrid model's
    linear-attention layers, which hold a conv and a recurrent state instead (sampler/hybrid.py)."""
    return [layer for layer in cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)]


class BatchCache(Cache):
    def __init__(self, num_layers: int, shared: bool = False, layers: list | None = None):
        super().__init__(layers=layers or [_Layer(self) for _ in range(num_layers)])
        self.width = 0  # W: columns in use
        self.lengths = torch.zeros(0, dtype=torch.long)  # [B] cached positions per row
        # [B] own columns each row may reach (prompt held in its row + max_tokens); the spare
        # columns of a rebuild stop there.
        self.reach = torch.zeros(0, dtype=torch.long)
        # Prompts several rows share, stored once (shared.py); their rows' own columns then hold
        # only what they generate. Only the fused decode step reads them (decode.py).
        self.shared = SharedPrefixes(num_layers) if shared else None

    @property
    def prefix_lengths(self) -> torch.Tensor:
        """[B] positions each row reads from its shared segment (0 for a row without one)."""
        if self.shared is None:
            return torch.zeros_like(self.lengths)
        return self.shared.prefix_lengths()

    def kv_layers(self) -> list[_Layer]:
        return kv_layers(self)

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        first = self.kv_layers()[0]
        return 0 if first.keys is None else int(first.keys.shape[2])

    def join(self, prefilled: list[tuple[DynamicCache, int]], max_tokens: list[int]) -> None:
        """Append, for each (one-row prefilled cache, n), n copies of that row to the batch; each
        part's rows generate at most its `max_tokens`.

        All requests whose prefill finished in a step join in one rebuild: the copy is per join,
        and 8 requests joining one by one made 8 copies of the growing cache.
        """
        parts = [([layer.keys for layer in kv_layers(c)], [layer.values for layer in kv_layers(c)], n) for c, n in prefilled]
        prompts = [int(keys[0].shape[2]) for keys, _, _ in parts]  # P of each part
        shared = SharedPrefixes.shared_parts(prefilled) if self.shared is not None else [False] * len(parts)
        lengths = [0 if s else p for s, p in zip(shared, prompts)]  # own columns of each part's rows
        reach = [own + m for own, m in zip(lengths, max_tokens)]
        old_rows, old_width = self.rows, self.width
        width = max([old_width, *lengths])

        def fill(old: torch.Tensor | None, out: torch.Tensor, i: int, name: str) -> None:
            # Old rows keep their right alignment at the (maybe wider) new width; new rows follow.
            # Padding is zeroed, not left as garbage: a masked NaN would still poison 0 * V.
            if old is not None and old_rows:
                out[:old_rows, :, : width - old_width].zero_()
                out[:old_rows, :, width - old_width : width] = old[:, :, :old_width]
            row = old_rows
            for (keys, values, n), p in zip(parts, lengths):
                out[row : row + n, :, : width - p].zero_()
                if p:
                    out[row : row + n, :, width - p : width] = (keys if name == "keys" else values)[i]  # [1, KV, P, D]
                row += n

        own = torch.cat([self.lengths - self.prefix_lengths, *(torch.full((n,), p) for (_, _, n), p in zip(parts, lengths))])
        reach = torch.cat([self.reach, *(torch.full((n,), r) for (_, _, n), r in zip(parts, reach))])
        self._rebuild(old_rows + sum(n for _, _, n in parts), width, fill, own, reach, like=parts[0][:2])
        self.reach = reach
        self.lengths = torch.cat([self.lengths, *(torch.full((n,), p, dtype=torch.long) for (_, _, n), p in zip(parts, prompts))])
        self.width = width
        if self.shared is not None:
            layers = [[(keys[i], values[i]) for keys, values, _ in parts] for i in range(len(parts[0][0]))]
            self.shared.join(prefilled, shared, layers)

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the batch, in order); drops now-unused leading columns."""
        if len(rows) == self.rows:
            return
        idx = torch.tensor(rows, dtype=torch.long)
        own = (self.lengths - self.prefix_lengths)[idx]
        width = int(own.max()) if rows else 0  # the longest own columns
        start = self.width - width

        def fill(old: torch.Tensor, out: torch.Tensor, i: int, name: str) -> None:
            # The old padding comes along (zeros), so no column of the new buffer is left unset.
            out[:, :, :width] = old[idx.to(old.device), :, start : self.width]

        self._rebuild(len(rows), width, fill, own, self.reach[idx])
        self.lengths, self.reach = self.lengths[idx], self.reach[idx]
        self.width = width
        if self.shared is not None:
            self.shared.keep(idx)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids [B, 1] and the attention mask [B, 1, 1, W + 1] for one new token per row.

        Row r's new token sits at position len_r (its own count, not the padded column), and it
        may attend to its cached columns and itself: columns >= W - len_r, or with a shared prompt
        of p_r positions (shared.py) its len_r - p_r own columns, W - (len_r - p_r) on.
        """
        if self.width + 1 > self.capacity:
            width = self.width

            def fill(old: torch.Tensor, out: torch.Tensor, i: int, name: str) -> None:
                out[:, :, :width] = old[:, :, :width]

            self._rebuild(self.rows, width, fill, self.lengths - self.prefix_lengths, self.reach)
        device = self.kv_layers()[0].keys.device
        columns = torch.arange(self.width + 1, device=device)  # [W + 1]
        first = (self.width - self.lengths + self.prefix_lengths).to(device)  # [B] first own column of each row
        mask = columns[None, :] >= first[:, None]  # [B, W + 1] bool, True = attend
        return self.lengths[:, None].to(device), mask[:, None, None, :]

    def advance(self) -> None:
        """Every row appended one token (after a body forward with step_inputs)."""
        self.width += 1
        self.lengths += 1

    def _rebuild(self, rows: int, width: int, fill, own: torch.Tensor, reach: torch.Tensor,
                 like: tuple[list, list] | None = None) -> None:
        """New buffers [rows, KV, C, D] per layer with spare columns; `fill` sets columns [0, width).
        `own`, `reach` [rows]: each row's own columns now and at most (BatchCache.reach); all rows
        advance together, so the widest the batch can get is W + the most columns any row has left.
        The caller updates its row state only after this returned (a failed rebuild changes none).

        torch.empty, not zeros: a fresh 500 KB buffer's memset cost ~0.36 ms (page faults) per
        layer tensor, 60 per rebuild on SmolLM2; `fill` writes every used column once anyway
        (padding as zeros), and columns past `width` are written by a step before any read.
        """
        left = int((reach - own).max()) if rows else 0
        capacity = width + max(1, min(max(_MIN_SPARE_COLUMNS, width // 2), left))
        for i, layer in enumerate(self.kv_layers()):
            for j, name in enumerate(("keys", "values")):
                old = getattr(layer, name)
                ref = old if old is not None else like[j][i]
                out = ref.new_empty(rows, ref.shape[1], capacity, ref.shape[3])
                fill(old, out, i, name)
                setattr(layer, name, out)
