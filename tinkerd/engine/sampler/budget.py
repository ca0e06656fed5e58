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

    @classmethod
    def of(cls, text_config, dtype: torch.dtype, device: torch.device, limit: int | None) -> KvBudget:
        """The budget of a model's text config; `limit` None: a quarter of the device's memory."""
        return cls(kv_bytes_per_token(text_config, dtype), state_bytes_per_row(text_config, dtype),
                   limit or default_kv_budget(device))

    def check(self, op: SampleOp) -> None:
        """Refuse (UserError) a request whose rows alone would take more than the budget."""
        tokens = int(op.prompt.shape[0]) + op.params.max_tokens
        need = op.num_samples * (tokens * self.token_bytes + self.state_bytes)
        if need > self.limit:
            state = f", + {_size(self.state_bytes)} of linear-attention state each" if self.state_bytes else ""
            raise UserError(
                f"this request's KV cache would take {_size(need)} ({op.num_samples} samples x {tokens} prompt + "
                f"max_tokens positions x {_size(self.token_bytes)}{state}), more than the sampler's {_size(self.limit)}: "
                f"lower num_samples or max_tokens, or split the request"
            )

    def room(self, rows: list[Row], joining: list[Request], held=None) -> Callable[[Request], bool]:
        """A check, for unstarted requests in admission order, of whether each fits the KV budget
        beside the rows decoding and the requests already prefilling (and those it said yes to).

        The bound is rows x the widest final length among them: rows share one cache width, which
        can grow to the longest row's prompt + max_tokens. A request alone always fits (admission
        refused it otherwise), so the batch never waits on an empty engine. `held` (a PrefixCache)
        gives way: its least recently used entries are evicted for a request that fits without them.
        """
        n, width = self._in_flight(rows, joining)

        def fits(req: Request) -> bool:
            nonlocal n, width
            new_rows, new_width = n + len(req.rows), max(width, req.final_len)
            need = new_rows * (new_width * self.token_bytes + self.state_bytes)
            if n and need > self.limit:
                return False
            if held is not None:
                held.shrink(self.limit - need)
            n, width = new_rows, new_width
            return True

        return fits

    def spare(self, rows: list[Row], joining: list[Request]) -> int:
        """Bytes of the budget the rows in flight (decoding, prefilling, following) cannot reach."""
        n, width = self._in_flight(rows, joining)
        return max(0, self.limit - n * (width * self.token_bytes + self.state_bytes))

    @staticmethod
    def _in_flight(rows: list[Row], joining: list[Request]) -> tuple[int, int]:
        # Followers of another request's prefill (prefix.py) are admitted to the budget too.
        started = [req for req in joining if req.prefill.done > 0 or req.leader is not None]
        n = len(rows) + sum(len(req.rows) for req in started)
        width = max([row.request.final_len for row in rows] + [req.final_len for req in started], default=0)
        return n, width


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
