"""Prompts that several decode rows share, kept once in the batch cache (cascade attention).

A GRPO group is n samples of one prompt: `num_samples=n` in one request, or the cookbook's n
requests following one prefill (prefix.py). Copied into every row (kv.BatchCache without this),
the prompt's keys and values are read n times per layer per decode step; at 32 rows of 256-token
prompts on SmolLM2-135M that is ~470 MB a step, and the two attention GEMMs took ~80 of a ~240 ms
step on one core. Here each such prompt is one *segment*: its keys/values stored once,
[S, Hk, Pmax, D] per layer (left-aligned, zero padding masked), and its rows hold only the tokens
they generate in the batch's own columns. A row's attention is one softmax over its segment's
columns followed by its own (scores gathered into [B, ...]), so the math is the unshared step's up
to summation order: the value product runs as two GEMMs (segment columns, own columns), summed.

Which prompts become segments: in one `join`, a prefill cache (the same object) whose parts bring
two rows or more. A single-row prompt stays in its row's own columns, as without this module, and
a batch with no segment runs exactly the unshared step. Only the fused decode step (decode.py)
reads segments; the sampler makes a shared cache only where that step runs.

Shapes: B rows, S segments, N the most rows of one segment, Hk key/value heads, G query heads per
key/value head, D head dim, P the longest segment prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transformers import DynamicCache


@dataclass(frozen=True)
class _Plan:
    """Where each row's queries go in the segments' [S, N] slots, memoised while membership holds."""

    segments: int  # S
    width: int  # N: slots per segment (the largest segment's rows)
    slot_rows: torch.Tensor  # [S * N] the batch row in each slot (padding slots repeat row 0)
    row_slot: torch.Tensor  # [B] each row's slot, S * N (a sentinel) for rows without a segment
    members: torch.Tensor  # [m] rows with a segment
    member_slots: torch.Tensor  # [m] their slots
    bias: torch.Tensor  # [S * Hk, 1, P] 0 for a segment's prompt columns, -inf for its padding


class SharedPrefixes:
    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # [S, Hk, P, D]
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(0, dtype=torch.long)  # [S] each segment's prompt length
        self.of_row = torch.zeros(0, dtype=torch.long)  # [B] each row's segment, -1 for none
        self._plan: _Plan | None = None

    @property
    def count(self) -> int:
        return int(self.lengths.shape[0])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    @staticmethod
    def shared_parts(prefilled: list[tuple[DynamicCache, int]]) -> list[bool]:
        """Which of a join's (prefill cache, n) parts become segments: those whose cache brings two
        rows or more in this join (one request's num_samples, or a leader and its followers)."""
        rows: dict[int, int] = {}
        for cache, n in prefilled:
            rows[id(cache)] = rows.get(id(cache), 0) + n
        return [rows[id(cache)] >= 2 for cache, _ in prefilled]

    def join(self, prefilled: list[tuple[DynamicCache, int]], shared: list[bool], layers: list[list]) -> None:
        """Append rows for a join's parts (in order): a shared part's rows point at its cache's
        segment (one per cache object), the others at none. `layers[i]` is the keys and values of
        layer i of each part's cache, [1, Hk, P, D] each."""
        new: dict[int, int] = {}  # cache id -> its new segment's index
        of_row, lengths, take = [self.of_row], [self.lengths], []
        for j, ((cache, n), is_shared) in enumerate(zip(prefilled, shared)):
            if not is_shared:
                of_row.append(torch.full((n,), -1, dtype=torch.long))
                continue
            if id(cache) not in new:
                new[id(cache)] = self.count + len(take)
                take.append(j)
                lengths.append(torch.tensor([layers[0][j][0].shape[2]]))
            of_row.append(torch.full((n,), new[id(cache)], dtype=torch.long))
        self.of_row = torch.cat(of_row)
        self._plan = None
        if not take:
            return
        self.lengths = torch.cat(lengths)
        for i, per_part in enumerate(layers):
            self.keys[i] = self._stack(self.keys[i], [per_part[j][0] for j in take])
            self.values[i] = self._stack(self.values[i], [per_part[j][1] for j in take])

    def _stack(self, old: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor:
        """[S_old + len(parts), Hk, P, D]: the old segments and these [1, Hk, P_j, D] prompts,
        left-aligned, padding zeroed (a masked NaN would still poison 0 * V)."""
        width = int(self.lengths.max())
        ref = parts[0]
        out = ref.new_zeros(self.count, ref.shape[1], width, ref.shape[3])
        s = 0
        if old is not None:
            out[: old.shape[0], :, : old.shape[2]] = old
            s = old.shape[0]
        for p in parts:
            out[s : s + 1, :, : p.shape[2]] = p
            s += 1
        return out

    def keep(self, idx: torch.Tensor) -> None:
        """Keep these rows (indices into the batch, in order); drop segments no row reads."""
        self.of_row = self.of_row[idx]
        self._plan = None
        used = sorted(set(self.of_row[self.of_row >= 0].tolist()))
        if len(used) == self.count:
            return
        renumber = torch.full((self.count + 1,), -1, dtype=torch.long)  # [-1] stays -1
        renumber[torch.tensor(used, dtype=torch.long)] = torch.arange(len(used))
        self.of_row = renumber[self.of_row]
        self.lengths = self.lengths[used]
        width = int(self.lengths.max()) if used else 0
        for i in range(len(self.keys)):
            if not used:
                self.keys[i] = self.values[i] = None
                continue
            sel = torch.tensor(used, dtype=torch.long, device=self.keys[i].device)
            self.keys[i] = self.keys[i][sel, :, :width].contiguous()
            self.values[i] = self.values[i][sel, :, :width].contiguous()

    def prefix_lengths(self) -> torch.Tensor:
        """[B] positions each row reads from its segment, 0 for a row without one."""
        return torch.where(self.of_row >= 0, self.lengths[self.of_row.clamp(min=0)] if self.count else 0, 0)

    def plan(self) -> _Plan | None:
        """The step's gather/scatter indices (None when no row has a segment)."""
        if self.count == 0:
            return None
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> _Plan:
        device, dtype = self.keys[0].device, self.keys[0].dtype
        s, hk, p = self.count, self.keys[0].shape[1], self.keys[0].shape[2]
        of_row = self.of_row.tolist()
        by_segment: list[list[int]] = [[] for _ in range(s)]
        for b, seg in enumerate(of_row):
            if seg >= 0:
                by_segment[seg].append(b)
        n = max(len(rows) for rows in by_segment)
        slot_rows = torch.zeros(s * n, dtype=torch.long)
        row_slot = torch.full((len(of_row),), s * n, dtype=torch.long)
        for seg, rows in enumerate(by_segment):
            for j, b in enumerate(rows):
                slot_rows[seg * n + j] = b
                row_slot[b] = seg * n + j
        members = (self.of_row >= 0).nonzero().flatten()
        columns = torch.arange(p)
        bias = torch.zeros(s, 1, p, dtype=dtype).masked_fill_(columns >= self.lengths[:, None, None], float("-inf"))
        return _Plan(s, n, slot_rows.to(device), row_slot.to(device), members.to(device),
                     row_slot[members].to(device), bias.repeat_interleave(hk, dim=0).to(device))

    def attend(self, i: int, q: torch.Tensor, own_scores: torch.Tensor, own_values: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """Attention output [B * Hk, G, D] of layer i for queries q [B * Hk, G, D] whose scores
        against the rows' own columns are own_scores [B * Hk, G, W + 1] (masked, scaled), with
        values own_values [B * Hk, W + 1, D]: one softmax over segment then own columns."""
        plan = self.plan()
        keys, values = self.keys[i], self.values[i]
        s, n = plan.segments, plan.width
        hk, p, d = keys.shape[1], keys.shape[2], keys.shape[3]
        b, g = own_scores.shape[0] // hk, q.shape[1]
        # Segment queries: every slot's rows and heads side by side, [S * Hk, N * G, D].
        qs = q.view(b, hk, g, d).index_select(0, plan.slot_rows).view(s, n, hk, g, d).transpose(1, 2)
        scores = torch.baddbmm(plan.bias, qs.reshape(s * hk, n * g, d), keys.view(s * hk, p, d).transpose(1, 2),
                               alpha=scaling)  # [S * Hk, N * G, P]
        # By slot, [S * N + 1, Hk, G, P], in one copy; the last slot, all -inf, is read by rows without a segment.
        by_slot = scores.new_empty(s * n + 1, hk, g, p)
        by_slot[: s * n].view(s, n, hk, g, p).copy_(scores.view(s, hk, n, g, p).transpose(1, 2))
        by_slot[s * n].fill_(float("-inf"))
        both = torch.cat((by_slot.index_select(0, plan.row_slot).view(b * hk, g, p), own_scores), dim=-1)
        probs = torch.softmax(both, dim=-1)  # [B * Hk, G, P + W + 1]
        out = torch.bmm(probs.narrow(-1, p, own_scores.shape[-1]), own_values)  # [B * Hk, G, D]
        # The segment columns' probabilities back into slots (padding slots stay 0), times its values.
        seg_probs = probs.new_zeros(s * n, hk, g, p)
        seg_probs.index_copy_(0, plan.member_slots, probs.narrow(-1, 0, p).view(b, hk, g, p).index_select(0, plan.members))
        seg_probs = seg_probs.view(s, n, hk, g, p).transpose(1, 2).reshape(s * hk, n * g, p)
        seg_out = torch.bmm(seg_probs, values.view(s * hk, p, d))  # [S * Hk, N * G, D]
        seg_out = seg_out.view(s, hk, n, g, d).transpose(1, 2).reshape(s * n, hk, g, d)
        out.view(b, hk, g, d).index_add_(0, plan.members, seg_out.index_select(0, plan.member_slots))
        return out
