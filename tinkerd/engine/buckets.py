"""Datums of very different lengths in one forward_backward: the body runs over length buckets, not
one batch padded to the longest datum.

A right-padded batch costs every linear of the body B x T positions for M real ones, and attention
B x T^2. A cookbook SFT batch mixes short and long conversations (NoRobots: tens to thousands of
tokens), so most of a padded batch can be padding. Here the datums are sorted by length and cut into
buckets whose own padding stays under SLACK of their positions; the decoder runs once per bucket
(a bucket of equal lengths needs no padding mask at all, so SDPA takes its causal fast path), and
the buckets' hidden states are put back in datum order before the head. The head, the loss and its
gradient then run on [M, H] exactly as for one batch (engine/training.py), and one backward goes
through every bucket's graph.

The numbers are the padded batch's within fp32 rounding, not to the bit: SDPA blocks its softmax by
the key length (engine/cotrain.py), and a LoRA weight's gradient sums each bucket's positions
separately. So an op is bucketed only when padding is a large share of the batch in absolute terms
too (MIN_PADDING positions: the small ragged batches of the tests and of most RL steps run as one
batch, unchanged), a bucketed op never shares a pass with other runs (cotrain.pass_key), and a
replay runs the same buckets (the plan depends on the lengths alone), so recovery stays exact.

Only dense full-attention text models are bucketed: an MoE layer counts its routing over the padded
batch's mask, DeltaNet's chunked scan runs over the padded width, and a vision-language body places
image features by the batch's layout; those keep one padded batch, as do ranks (engine/sharding.py),
whose blocks of datums are already split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime

# Most padding a bucket may hold, as a share of its B x T positions.
SLACK = 0.125
# Bucket only when one padded batch would hold at least this many padding positions, and at least
# a quarter of its positions: below that the padding costs little and one batch is kept.
MIN_PADDING = 1024
MIN_SHARE = 0.25


def dense_full_attention(rt: "ModelRuntime") -> bool:
    """No routed experts and no linear-attention layers (also what a shared pass needs: engine/cotrain.py)."""
    family = rt.loaded.family
    return family.experts_class is None and family.layer_types == frozenset({"full_attention"})


def eligible(rt: "ModelRuntime", data) -> bool:
    return dense_full_attention(rt) and not any(d.images for d in data)


def plan(lengths: list[int]) -> list[list[int]] | None:
    """Datum indices by bucket (the longest datums first; within a bucket, longest first), or None
    when one padded batch wastes little (module docstring)."""
    if not lengths:
        return None
    padding = len(lengths) * max(lengths) - sum(lengths)
    if padding < MIN_PADDING or padding < MIN_SHARE * len(lengths) * max(lengths):
        return None
    buckets: list[list[int]] = []
    total = 0  # real positions of the last bucket
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if buckets:
            widest = lengths[buckets[-1][0]]
            positions = widest * (len(buckets[-1]) + 1)
            if positions - (total + lengths[i]) <= SLACK * positions:
                buckets[-1].append(i)
                total += lengths[i]
                continue
        buckets.append([i])
        total = lengths[i]
    return buckets if len(buckets) > 1 else None
