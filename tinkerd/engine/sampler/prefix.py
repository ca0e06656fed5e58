"""The prefix cache: prefilled prompts kept across requests, so a prompt seen again is not prefilled again.

GRPO samples a group of completions of one prompt. `num_samples=n` in one request already shares
its prefill (kv.BatchCache.join copies one prefilled row n times), but the cookbook's RL loop sends
the group as n concurrent requests of `num_samples=1` (completers.TinkerTokenCompleter), and every
prompt of a task may open with the same system prompt. Here a finished prefill is kept, keyed by

    (adapter_path, the adapter's checkpoint fingerprint)  and the prompt's tokens,

so that a later request with that key and prompt joins the decode batch from it without running
the body (a hit), and one whose prompt starts with a kept prompt's first m tokens prefills only its
remaining tokens (a prefix hit, non-hybrid models only: a linear-attention layer's recurrent state
cannot be cut back to m tokens). The sampler also lets a request follow another one still
prefilling the same key and prompt (sample.py), which is the cookbook's case: n requests arriving
together.

Identity: a key names weights, not a name. A re-saved checkpoint gets a new fingerprint from the
artifact store (adapters.acquire_adapter), so entries of the old weights are never read again and are
dropped as soon as the new weights are seen. An adapter without a fingerprint (a live training
adapter used directly, in tests) is never cached: nothing says when its weights change.

Bound: entries hold their prompts' keys and values (P x kv_bytes_per_token + a hybrid row's states)
inside the sampler's KV budget (budget.py): the decode batch's room comes first, and entries are
evicted least recently used whenever the rows need their bytes or there are more than `max_entries`.

A hit's samples are exactly those of the request that made the entry had it been asked again
(same keys and values, same last hidden state): the cached prefill is the one computed, not a
recomputation. A prefix hit's remaining tokens run as one more prefill chunk after the kept ones,
as a long prompt's chunks already do.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch
from transformers import DynamicCache

from tinkerd.engine.sampler.kv import kv_layers
from tinkerd.engine.sampler.rows import Request

# Shorter shared prefixes are not worth a lookup's copy (and a one-token "prefix" is just BOS).
MIN_PREFIX_TOKENS = 16


@dataclass
class Entry:
    prompt: np.ndarray  # [P] int64
    cache: DynamicCache  # the one-row prefill cache of the whole prompt; read, never written
    last_hidden: torch.Tensor  # [1, H] the body's output at position P - 1
    nbytes: int


def cache_key(req: Request) -> Hashable | None:
    """Which weights a request's prefill depends on, or None where it must not be cached: an
    adapter without a checkpoint fingerprint, or a prompt with images (its tokens are placeholders)."""
    if req.op.images:
        return None
    if req.adapter is None:
        return ("base",)
    fingerprint = req.adapter.extra.get("fingerprint")
    return None if fingerprint is None else (req.op.adapter_path, fingerprint)


def prefix_name(req: Request) -> tuple[Hashable, bytes] | None:
    """(weights key, prompt bytes) of a request that may use the cache, else None. A request asking
    for prompt scores needs the prompt's hidden states, which a hit skips: it prefills."""
    key = cache_key(req)
    if key is None or req.prefill.scores:
        return None
    return key, req.prefill.prompt.cpu().numpy().tobytes()


class PrefixCache:
    def __init__(self, token_bytes: int, state_bytes: int, partial: bool, max_entries: int = 64):
        self.token_bytes = token_bytes
        self.state_bytes = state_bytes
        self.partial = partial  # prefix hits allowed (no linear-attention layers)
        self.max_entries = max_entries
        self.entries: OrderedDict[tuple[Hashable, bytes], Entry] = OrderedDict()  # LRU first
        self.nbytes = 0
        self.hits = self.prefix_hits = 0  # for tests and logs

    def __len__(self) -> int:
        return len(self.entries)

    # -- lookup ----------------------------------------------------------------------------------

    def start(self, req: Request, leaders: dict) -> bool:
        """Start an unstarted request from the cache, or make it follow a joining request that
        prefills the same weights and prompt (`leaders`, by prefix_name, which this extends with
        requests that prefill); False when neither applies and it prefills from its first token."""
        name = prefix_name(req)
        if name is None:
            return False
        leader = leaders.get(name)
        if leader is not None:
            req.leader = leader
            return True
        saved = self.seed(req)
        if not req.prefill.finished:
            leaders[name] = req  # it prefills (the rest): those after it with its prompt follow it
        return saved > 0

    def followers_of(self, ready: list[Request], joining: list[Request]) -> list[Request]:
        """The joining requests following one of `ready` (whose prefills finished now), started
        from their leaders' caches: they join the batch in the same step, as num_samples rows would."""
        leading = {id(req) for req in ready}
        out = []
        for req in joining:
            if req.leader is not None and id(req.leader) in leading:
                pf, src = req.prefill, req.leader.prefill
                pf.cache, pf.last_hidden, pf.done = src.cache, src.last_hidden, src.done
                pf.cached = pf.done
                req.leader = None
                self.hits += 1
                out.append(req)
        return out

    def seed(self, req: Request) -> int:
        """Start an unstarted request's prefill from the cache; returns the prompt tokens it saved.

        A whole-prompt hit leaves the prefill finished; a prefix hit leaves it at m tokens done,
        its cache holding a copy of the kept prompt's first m positions.
        """
        name = prefix_name(req)
        pf = req.prefill
        if name is None or pf.done:
            return 0
        key = name[0]
        self._drop_stale(key)
        prompt = pf.prompt.cpu().numpy()
        entry = self.entries.get(name)
        if entry is not None:
            self.entries.move_to_end(name)
            pf.cache, pf.last_hidden, pf.done = entry.cache, entry.last_hidden, len(prompt)
            pf.cached = pf.done
            self.hits += 1
            return len(prompt)
        if not self.partial:
            return 0
        best, m = None, 0
        for (k, _), e in self.entries.items():
            if k == key:
                n = _common_prefix(e.prompt, prompt)
                if n > m:
                    best, m = e, n
        m = min(m, len(prompt) - 1)  # the last position's hidden state is needed: run at least one token
        if best is None or m < MIN_PREFIX_TOKENS:
            return 0
        self.entries.move_to_end(next(k for k, e in self.entries.items() if e is best))
        for i, layer in enumerate(kv_layers(best.cache)):
            # The unstarted prefill's cache is empty, and update() on an empty layer copies: the
            # entry's tensors stay as they are.
            pf.cache.update(layer.keys[:, :, :m], layer.values[:, :, :m], i)
        pf.done = pf.cached = m
        pf.chunk_calls.append(0)  # a visible mark, for tests: this prefill started from the cache
        self.prefix_hits += 1
        return m

    # -- insertion and eviction -------------------------------------------------------------------

    def add(self, req: Request, room: int) -> None:
        """Keep a finished prefill if it fits in `room` bytes beside the other entries (evicting LRU)."""
        key = cache_key(req)
        pf = req.prefill
        if key is None or pf.cache is None or pf.last_hidden is None:
            return
        prompt = pf.prompt.cpu().numpy()
        name = (key, prompt.tobytes())
        if name in self.entries:
            self.entries.move_to_end(name)
            return
        self._drop_stale(key)
        nbytes = len(prompt) * self.token_bytes + self.state_bytes
        if nbytes > room:
            return
        self.shrink(room - nbytes)
        while len(self.entries) >= self.max_entries:
            self._evict_oldest()
        self.entries[name] = Entry(prompt, pf.cache, pf.last_hidden, nbytes)
        self.nbytes += nbytes

    def shrink(self, to_bytes: int) -> None:
        """Evict least recently used entries until they hold at most `to_bytes`."""
        while self.entries and self.nbytes > to_bytes:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, entry = self.entries.popitem(last=False)
        self.nbytes -= entry.nbytes

    def _drop_stale(self, key: Hashable) -> None:
        """Forget entries of the same adapter path under another fingerprint: its weights changed."""
        if key == ("base",):
            return
        for name in [n for n in self.entries if n[0][0] == key[0] and n[0] != key]:
            self.nbytes -= self.entries.pop(name).nbytes


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
