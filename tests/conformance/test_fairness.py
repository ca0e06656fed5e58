"""One tenant's long queue does not starve another's single op (round-robin across training runs)."""

from __future__ import annotations

import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY, logged_ops


def test_single_step_of_b_overtakes_fifty_queued_steps_of_a(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    a = sc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    b = sc.create_lora_training_client(base_model=TINY, rank=8, seed=2).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 48))),
                        loss_fn_inputs={"target_tokens": list(range(2, 49))})
    a_futures = [a.forward_backward([datum], "cross_entropy") for _ in range(50)]
    b_result = b.forward_backward([datum], "cross_entropy").result()
    assert b_result.metrics["loss:sum"] > 0
    for f in a_futures:
        f.result()
    # Order of completion from the server's own log of futures: while B's op waited, A may finish
    # the op already running and at most one more before B's turn comes round.
    rows = [(r.target, r.created_at, r.completed_at) for m in (a.model_id, b.model_id)
            for r in logged_ops(server.data_dir, m, "ForwardBackward")]
    (b_created, b_done), = [(c, d) for t, c, d in rows if t == b.model_id]
    a_done_while_b_waited = [d for t, _, d in rows if t == a.model_id and b_created <= d <= b_done]
    assert len(a_done_while_b_waited) <= 2, len(a_done_while_b_waited)
    assert sum(1 for t, _, d in rows if t == a.model_id and d > b_done) >= 40  # A's queue really was long
