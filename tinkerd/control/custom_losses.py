"""Server-side custom losses: store what create_custom_loss uploads, and resolve a forward_backward's
`loss_fn="custom"` to it.

A loss is data (tinkerd/lossgraph.py checks it; engine/losses/custom.py interprets it) and belongs
to the session that uploaded it: the SDK says its LossHandle works only with that session's
clients, so a run of another session, even of the same account, cannot use it. Rows are kept for
as long as the session's runs may be replayed from the log (recovery rebuilds their
forward_backward ops from the stored request, which names the loss by id), so they are never
deleted; they are small (a DPO loss is about 4 KB) and at most MAX_LOSSES_PER_SESSION per session.
"""

from __future__ import annotations

from tinkerd import lossgraph
from tinkerd.control.store.db import Store, utcnow
from tinkerd.control.store.sessions import CustomLossRepository
from tinkerd.control.store.tables import CustomLossRow
from tinkerd.errors import UserError
from tinkerd.types import CustomLoss


class CustomLosses:
    def __init__(self, store: Store):
        self.store = store
        self.losses = CustomLossRepository(store)

    def create(self, session_id: str, seq_id: int, name: str, inputs: list[tuple[str, int]], graph: dict) -> str:
        """Check and store one upload; returns its loss_id. Idempotent on (session, custom_loss_seq_id):
        a re-send of the same loss gets the same id, a different loss under a used seq_id is refused."""
        graph_json = lossgraph.check(name, inputs, graph)
        loss_id = f"{session_id}:loss:{seq_id}"
        existing = self.losses.get(loss_id)
        if existing is None:
            count = self.losses.count_of_session(session_id)
            if count >= lossgraph.MAX_LOSSES_PER_SESSION:
                raise UserError(f"session {session_id} already created {count} custom losses; at most "
                                f"{lossgraph.MAX_LOSSES_PER_SESSION} are allowed per session")
            row = CustomLossRow(loss_id=loss_id, session_id=session_id, name=name,
                                inputs=[[n, r] for n, r in inputs], graph_json=graph_json, created_at=utcnow())
            if self.losses.add(row):
                return loss_id
            existing = self.losses.get(loss_id)  # a concurrent identical upload won
        if (existing.name, existing.inputs, existing.graph_json) != (name, [[n, r] for n, r in inputs], graph_json):
            raise UserError(f"custom_loss_seq_id {seq_id} of session {session_id} already names a different loss "
                            f"({existing.name!r}); a new loss needs a new custom_loss_seq_id")
        return loss_id

    def resolve(self, loss_fn_config: dict, session_id: str) -> CustomLoss:
        """The stored loss a `loss_fn="custom"` forward_backward of `session_id`'s run names."""
        loss_id = loss_fn_config.get("loss_id")
        if not isinstance(loss_id, str):
            raise UserError("loss_fn 'custom' needs loss_fn_config['loss_id'], the id create_custom_loss returned")
        unknown = sorted(set(loss_fn_config) - {"loss_id"})
        if unknown:
            raise UserError(f"loss_fn_config keys {unknown} are not used by custom (accepted: loss_id)")
        row = self.losses.get(loss_id)
        if row is None or row.session_id != session_id:
            # Another session's loss answers like a missing one: ids are not secrets, but handles are per session.
            raise UserError(f"custom loss {loss_id!r} was not created by this training run's session "
                            f"({session_id}); create it with this session's ServiceClient")
        return CustomLoss(loss_id=row.loss_id, name=row.name, input_names=[n for n, _ in row.inputs],
                          input_ranks=[int(r) for _, r in row.inputs], graph_json=row.graph_json)
