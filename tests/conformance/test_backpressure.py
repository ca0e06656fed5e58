"""Back-pressure through the official SDK: a server whose per-run queue budget is 1 op answers a
pipelined training loop's extra ops with 429 + Retry-After; the SDK backs off and sends them again,
every op completes, and the losses equal, bit for bit, those of the same run sent one op at a time
(which never finds an op waiting, so is never refused). The refusals are counted from the server's
own /metrics (tinkerd_ops_refused_total), not inferred from timings.
"""

from __future__ import annotations

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY, start_server

STEPS = 4


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("backpressure-data"), [TINY],
                       ["--threads", "1", "--max-queued-ops-per-model", "1"])
    yield srv
    srv.stop()


def _refused(srv) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tinkerd_ops_refused_total" and s.labels.get("scope") == "target")


def _batch(step: int) -> list[types.Datum]:
    out = []
    # ~150 positions over the tiny model's 151k-token head: a forward_backward takes long enough
    # that the loop's next two ops arrive while it runs, one of them finding the other waiting.
    for n in (45 + step, 60, 50 - step % 2):
        tokens = [(7 * i + 3 * step + n) % 500 + 1 for i in range(n + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:]}))
    return out


def _client(srv) -> tinker.TrainingClient:
    sc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
    return sc.create_lora_training_client(base_model=TINY, rank=4, seed=11).result()


def test_a_pipelined_loop_over_the_budget_is_throttled_and_loses_nothing(tight_server):
    adam = types.AdamParams(learning_rate=1e-2)

    refused_before = _refused(tight_server)
    alone = _client(tight_server)
    one_at_a_time = []
    for step in range(STEPS):
        one_at_a_time.append(alone.forward_backward(_batch(step), "cross_entropy").result().metrics["loss:sum"])
        alone.optim_step(adam).result()
    assert _refused(tight_server) == refused_before  # nothing waited, so nothing was refused

    piped = _client(tight_server)
    futures = []
    for step in range(STEPS):  # every op sent before any result is read: up to 2 * STEPS waiting
        futures.append(piped.forward_backward(_batch(step), "cross_entropy"))
        futures.append(piped.optim_step(adam))
    results = [f.result() for f in futures]
    pipelined = [r.metrics["loss:sum"] for r in results[::2]]

    assert _refused(tight_server) > refused_before, "the loop never went over the budget"
    assert pipelined == one_at_a_time
