"""Datums that start with the same tokens share those tokens' work in a forward_backward (and a forward).

GRPO, the cookbook's RL, trains on groups of samples of one prompt: 8 datums of 256 prompt + 64
completion tokens repeat the prompt 8 times, and a causal model computes the same hidden states for
the same leading tokens whatever follows them. So the prompt goes through the decoder once per group
and each sample's own tokens after it, reading the prompt's keys and values; the body runs 256 + 8 x 64
positions instead of 8 x 320 (3.3x fewer), and the head about as many rows.

How (`hidden`), in two decoder calls, or one more per extra length bucket of the suffixes:
1. The groups' shared prefixes, right-padded to the longest, with a KV cache (transformers'
   DynamicCache, its tensors still in the autograd graph).
2. The datums' suffixes, each with its group's cached prefix keys and values (the cache's rows
   selected per datum; the prefix padding masked out), at positions after its prefix. Suffixes of
   very different lengths go in length buckets (engine/buckets.py's plan), each with its own selection.
   Their attention reads the cached keys and values with the key/value heads grouped, not widened
   to the query heads as HF's masked call does (engine/causal.py: _reads_cached_prefix).

The head runs once per distinct row: a group's leading prefix positions whose targets all its datums
agree on are one row (all but its last position, usually: that one's target is each sample's first
token), every other position its datum's own row. The logprobs are then given out per datum position
(`Rows.index`), the loss runs on the datums as ever, and the gradient of a shared row is the sum of its
datums' (an index_add_ back, then the head's and the body's backward as for one batch). So this is the
plain pass's arithmetic reordered: equal within fp32 rounding, not to the bit (the shared rows' sums
and the prefix attention round in another order), and exact against itself: the plan is a function of
the op's tokens and targets alone, so a replay after a crash runs the same calls.

Where: dense full-attention text models only (buckets.eligible's reason: an MoE layer counts routing
over one padded batch's mask; a vision body places image features by the batch's layout; sliding
windows would crop the cache; a vision-language model's text decoder takes multimodal rotary
positions), not on ranks (engine/sharding.py splits datums), and only when the
prefix sharing saves at least MIN_SAVED of the positions the plain pass would run (padded or
bucketed). An op planned here runs alone, never in a pass shared with other runs (engine/cotrain.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tinkerd.engine import buckets

if TYPE_CHECKING:
    from tinkerd.engine.engine import ModelRuntime
    from tinkerd.types import Datum

# Fewest tokens a group's datums must share for the group to be worth a prefix.
MIN_PREFIX = 16
# Share of the plain pass's decoder positions the plan must save.
MIN_SAVED = 0.25


@dataclass(frozen=True)
class Group:
    """Datums (indices into the op's data) that share their first `prefix` tokens; each has more."""

    prefix: int
    members: tuple[int, ...]


@dataclass
class Rows:
    """The head's rows of a prefix-shared pass: `index` [M] maps each datum position (datum 0's first)
    to its row, `first` [R] each row to one datum position it stands for (whose target it takes)."""

    index: torch.Tensor
    first: torch.Tensor


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def plan(data: list["Datum"]) -> list[Group] | None:
    """Groups of datums sharing a prefix (every datum in one group; groups and their members in datum order),
    or None when sharing saves too little (module docstring). Sorted by tokens, consecutive datums
    join a group while that does not shrink what the group saves ((size - 1) x prefix)."""
    tokens = [np.asarray(d.tokens) for d in data]
    if len(tokens) < 2 or min(t.shape[0] for t in tokens) < 2:
        return None
    order = sorted(range(len(tokens)), key=lambda i: tokens[i].tolist())
    groups: list[tuple[int, list[int]]] = []  # (prefix, members)
    for prev, i in zip([None, *order], order):
        if prev is not None:
            shared = min(_common(tokens[prev], tokens[i]), tokens[i].shape[0] - 1)
            prefix, members = groups[-1]
            if len(members) == 1:
                prefix = min(prefix, tokens[members[0]].shape[0] - 1)
            joined = min(prefix, shared)
            if joined >= MIN_PREFIX and len(members) * joined >= (len(members) - 1) * prefix:
                groups[-1] = (joined, members + [i])
                continue
        groups.append((1 << 62, [i]))
    widest = max((p for p, m in groups if len(m) > 1), default=0)
    if widest == 0:
        return None
    # A datum alone splits where it adds no prefix padding: its suffix takes the rest.
    out = sorted((Group(p if len(m) > 1 else min(widest, tokens[m[0]].shape[0] - 1), tuple(sorted(m))) for p, m in groups),
                 key=lambda g: g.members[0])
    lengths = [t.shape[0] for t in tokens]
    plain = _positions(lengths)
    suffixes = [lengths[i] - g.prefix for g in out for i in g.members]
    shared = len(out) * max(g.prefix for g in out) + _positions(suffixes)
    return out if shared <= (1 - MIN_SAVED) * plain else None


def _positions(lengths: list[int]) -> int:
    """Decoder positions of these rows' pass: padded to the longest, or in buckets if buckets.plan cuts them."""
    cut = buckets.plan(lengths)
    if cut is None:
        return len(lengths) * max(lengths)
    return sum(len(b) * lengths[b[0]] for b in cut)


def eligible(rt: "ModelRuntime", data: list["Datum"]) -> bool:
    # Not a vision-language model's text either: its decoder takes multimodal rotary positions.
    return buckets.eligible(rt, data) and rt.loaded.vision is None


def hidden(rt: "ModelRuntime", data: list["Datum"], groups: list[Group], targets: torch.Tensor,
           run_decoder) -> tuple[torch.Tensor, Rows]:
    """The head's rows [R, H] of the datums' last hidden states, and where each datum position reads
    its row. `targets` [M] / [M, K] in datum order; `run_decoder(**kwargs)` calls the decoder
    (training._hidden's arguments) and returns its last hidden state [B, T, H]."""
    from transformers import DynamicCache

    device = targets.device
    starts = np.cumsum([0] + [len(d.tokens) for d in data])
    widest = max(g.prefix for g in groups)
    # 1. The prefixes, one row per group.
    ids = torch.zeros(len(groups), widest, dtype=torch.long)
    mask = torch.zeros(len(groups), widest, dtype=torch.long)
    for row, g in enumerate(groups):
        ids[row, : g.prefix] = torch.from_numpy(np.array(data[g.members[0]].tokens[: g.prefix], dtype=np.int64))
        mask[row, : g.prefix] = 1
    owner = {i: (row, g.prefix) for row, g in enumerate(groups) for i in g.members}
    datums = [i for g in groups for i in g.members]
    suffix_len = [len(data[i].tokens) - owner[i][1] for i in datums]
    cut = buckets.plan(suffix_len) or [sorted(range(len(datums)), key=lambda k: -suffix_len[k])]
    widths = [max(suffix_len[k] for k in bucket) for bucket in cut]
    # The calls' positions and the keys the suffixes' caches hold, for engine/recompute.py's plan.
    extent = (ids.numel() + sum(len(b) * t for b, t in zip(cut, widths)),
              ids.numel() + sum(len(b) * (widest + t) for b, t in zip(cut, widths)))
    with rt.recompute.whole_pass(*extent):
        cache = DynamicCache(config=rt.model.config)
        h_prefix = run_decoder(input_ids=ids.to(device), attention_mask=mask.to(device), cache=cache,
                               use_cache=True)  # [G, P, H]
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        h_suffix = _suffixes(data, owner, datums, suffix_len, cut, widest, layers, device, run_decoder)
    # 3. The head's rows: a group's agreed prefix positions once, the rest per datum.
    pieces, index, first = [], torch.empty(int(starts[-1]), dtype=torch.long), []
    at = 0
    for row, g in enumerate(groups):
        agreed = _agreed(targets, [int(starts[i]) for i in g.members], g.prefix)
        if agreed:
            pieces.append(h_prefix[row, :agreed])
            first.extend(range(int(starts[g.members[0]]), int(starts[g.members[0]]) + agreed))
            for i in g.members:
                index[starts[i] : starts[i] + agreed] = torch.arange(at, at + agreed)
            at += agreed
        for i in g.members:
            own = len(data[i].tokens) - agreed
            pieces.append(h_prefix[row, agreed : g.prefix])
            pieces.append(h_suffix[i])
            first.extend(range(int(starts[i]) + agreed, int(starts[i + 1])))
            index[starts[i] + agreed : starts[i + 1]] = torch.arange(at, at + own)
            at += own
    rows = Rows(index.to(device), torch.tensor(first, dtype=torch.long, device=device))
    return torch.cat(pieces), rows


def _suffixes(data: list["Datum"], owner: dict[int, tuple[int, int]], datums: list[int], suffix_len: list[int],
              cut: list[list[int]], widest: int, layers, device, run_decoder) -> dict[int, torch.Tensor]:
    """2. The datums' suffixes, by length bucket, each reading its group's cached prefix: datum -> [n, H]."""
    from transformers import DynamicCache

    h_suffix: dict[int, torch.Tensor] = {}
    for bucket in cut:
        members = [datums[k] for k in bucket]
        t = max(suffix_len[k] for k in bucket)
        ids = torch.zeros(len(members), t, dtype=torch.long)
        sees = torch.zeros(len(members), widest + t, dtype=torch.long)
        positions = torch.zeros(len(members), t, dtype=torch.long)
        for row, i in enumerate(members):
            _, p = owner[i]
            n = len(data[i].tokens) - p
            ids[row, :n] = torch.from_numpy(np.array(data[i].tokens[p:], dtype=np.int64))
            sees[row, :p] = 1
            sees[row, widest : widest + n] = 1
            positions[row] = torch.arange(p, p + t)
        pick = torch.tensor([owner[i][0] for i in members], device=device)
        selected = DynamicCache(ddp_cache_data=[(k.index_select(0, pick), v.index_select(0, pick)) for k, v in layers])
        out = run_decoder(input_ids=ids.to(device), attention_mask=sees.to(device), position_ids=positions.to(device),
                          cache=selected, use_cache=True)  # [b, t, H]
        for row, i in enumerate(members):
            h_suffix[i] = out[row, : len(data[i].tokens) - owner[i][1]]
    return h_suffix


def _agreed(targets: torch.Tensor, starts: list[int], prefix: int) -> int:
    """How many leading positions of the prefix have the same target(s) in every datum of the group."""
    first = targets[starts[0] : starts[0] + prefix]
    same = torch.ones(prefix, dtype=torch.bool, device=targets.device)
    for s in starts[1:]:
        eq = targets[s : s + prefix] == first
        same &= eq if eq.dim() == 1 else eq.all(-1)
    differ = torch.nonzero(~same)
    return int(differ[0, 0]) if differ.numel() else prefix
