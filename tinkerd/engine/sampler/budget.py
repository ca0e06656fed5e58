"""The decode batch's KV cache budget: whether a request may be admitted, and when it may start.

Split from sample.py: the Sampler refuses at admission a request that alone would need more than
the budget (`KvBudget.check`), and starts an admitted one only when it fits beside the rows in
flight (`KvBudget.room`), in admission order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tinkerd.engine.sampler.hybrid import state_bytes_per_row
from tinkerd.engine.sampler.kv import default_kv_budget, kv_bytes_per_token
from tinkerd.engine.sampler.rows import Request, Row
from tinkerd.errors import UserError
from tinkerd.types import SampleOp


@dataclass(frozen=True)
class KvBudget:
    token_bytes: int  # one cached position of one row, over all layers (kv.kv_bytes_per_token)
    state_bytes: int  # a hybrid model's linear-attention states, per row whatever its length (hybrid.py)
    limit: int  # bytes the decode batch's KV cache may reach (SamplerConfig.kv_cache_bytes)
    # The batch keeps a num_samples > 1 request's prompt once (shared.py): its rows' own columns
    # reach max_tokens only. Followers of one prefill (prefix.py) are still counted as copies.
    shared: bool = False

    @classmethod
    def of(cls, text_config, dtype: torch.dtype, device: torch.device, limit: int | None,
           shared: bool = False) -> KvBudget:
        """The budget of a model's text config; `limit` None: a quarter of the device's memory."""
        return cls(kv_bytes_per_token(text_config, dtype), state_bytes_per_row(text_config, dtype),
                   limit or default_kv_budget(device), shared)

    def shape(self, op: SampleOp) -> tuple[int, int, int]:
        """(rows, positions each row's own columns may reach, prompt positions held once or 0)."""
        prompt, rows = int(op.prompt.shape[0]), op.num_samples
        if self.shared and rows >= 2:
            return rows, op.params.max_tokens, prompt
        return rows, prompt + op.params.max_tokens, 0

    def check(self, op: SampleOp) -> None:
        """Refuse (UserError) a request whose rows alone would take more than the budget."""
        rows, own, once = self.shape(op)
        need = rows * (own * self.token_bytes + self.state_bytes) + once * self.token_bytes
        if need > self.limit:
            state = f", + {_size(self.state_bytes)} of linear-attention state each" if self.state_bytes else ""
            what = (f"the prompt's {once} positions once + {rows} samples x {own} max_tokens positions" if once else
                    f"{rows} samples x {own} prompt + max_tokens positions")
            raise UserError(
                f"this request's KV cache would take {_size(need)} ({what} x {_size(self.token_bytes)}{state}), "
                f"more than the sampler's {_size(self.limit)}: lower num_samples or max_tokens, or split the request"
            )

    def room(self, rows: list[Row], joining: list[Request], held=None) -> Callable[[Request], bool]:
        """A check, for unstarted requests in admission order, of whether each fits the KV budget
        beside the rows decoding and the requests already prefilling (and those it said yes to).

        The bound is rows x the widest own columns among them (rows share one cache width, which
        can grow to the longest row's prompt + max_tokens, or max_tokens for a prompt held once),
        plus the prompts held once, each as wide as the widest (shared.py pads them alike). A
        request alone always fits (admission refused it otherwise), so the batch never waits on an
        empty engine. `held` (a PrefixCache) gives way: its least recently used entries are evicted
        for a request that fits without them.
        """
        now = self._in_flight(rows, joining)

        def fits(req: Request) -> bool:
            nonlocal now
            n, own, once = self.shape(req.op)
            after = (now[0] + n, max(now[1], own), now[2] + (once > 0), max(now[3], once))
            need = self._bytes(*after)
            if now[0] and need > self.limit:
                return False
            if held is not None:
                held.shrink(self.limit - need)
            now = after
            return True

        return fits

    def spare(self, rows: list[Row], joining: list[Request]) -> int:
        """Bytes of the budget the rows in flight (decoding, prefilling, following) cannot reach."""
        return max(0, self.limit - self._bytes(*self._in_flight(rows, joining)))

    def _bytes(self, rows: int, own: int, prompts: int, prompt_width: int) -> int:
        return rows * (own * self.token_bytes + self.state_bytes) + prompts * prompt_width * self.token_bytes

    def _in_flight(self, rows: list[Row], joining: list[Request]) -> tuple[int, int, int, int]:
        """(rows, widest own columns, prompts held once, widest of those) of the requests in flight."""
        # Followers of another request's prefill (prefix.py) are admitted to the budget too.
        started = [req for req in joining if req.prefill.done > 0 or req.leader is not None]
        requests = {id(row.request): row.request for row in rows} | {id(req): req for req in started}
        shapes = [self.shape(req.op) for req in requests.values()]
        n = len(rows) + sum(len(req.rows) for req in started)
        once = [o for _, _, o in shapes if o]
        return n, max((own for _, own, _ in shapes), default=0), len(once), max(once, default=0)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
