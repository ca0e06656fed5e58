"""retrieve_futures, join_sampling_session and cancel_future through the unmodified tinker 0.38.0 SDK.

tinkerd's client config turns on the SDK's `sample_use_retrieve_futures` (one long poll per sampling
client for all its requests), `sample_join_sampling_session` (server-allocated clone ids for
unpickled clients) and its dynamic `sample_cancel_enabled` (an abandoned sample is stopped at once).
Each is shown through the SDK's own code path, and on the wire: cursors, clone blocks, ownership,
bad input as `user` 400s.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
import tinker
from sqlalchemy import select
from tinker import types
from tinker.resources.futures import AsyncFuturesResource

from tests.conformance.conftest import TINY
from tests.conformance.test_ownership import _key
from tests.serverproc import API_KEY
from tinkerd.control.store.db import Store
from tinkerd.control.store.tables import FutureRow, UsageRow

PROMPT = [9707, 11, 1879, 0, 220, 3555, 13, 1416]
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])


def _post(url: str, path: str, body: dict, key: str = API_KEY) -> httpx.Response:
    return httpx.post(f"{url}/api/v1{path}", json=body, headers={"X-API-Key": key}, timeout=60)


def _rows(server, target: str) -> list[FutureRow]:
    store = Store.sqlite(server.data_dir / "tinkerd.sqlite")
    return store.query(select(FutureRow).where(FutureRow.target == target).order_by(FutureRow.seq_id))


@pytest.fixture(scope="module")
def sampler(sc):
    return sc.create_sampling_client(base_model=TINY).result()


def test_samples_complete_through_the_session_poller(sc, sampler, monkeypatch):
    polls: list[types.FuturesRetrieveRequest] = []
    real = AsyncFuturesResource.retrieve_multi

    async def spy(self, *, request, **kw):
        polls.append(request)
        return await real(self, request=request, **kw)

    monkeypatch.setattr(AsyncFuturesResource, "retrieve_multi", spy)
    fresh = sc.create_sampling_client(base_model=TINY).result()
    futures = [fresh.sample(types.ModelInput.from_ints(PROMPT[:n]), 2, GREEDY) for n in range(3, 9)]
    got = [f.result(timeout=120) for f in futures]
    alone = [sampler.sample(types.ModelInput.from_ints(PROMPT[:n]), 1, GREEDY).result() for n in range(3, 9)]
    assert [[s.tokens for s in r.sequences] for r in got] == [[a.sequences[0].tokens] * 2 for a in alone]
    mine = [p for p in polls if p.target.sampling_session_id == fresh._sampling_session_id]
    assert fresh._futures_poller is not None and mine  # the SDK waited on the poller, not per request
    assert mine[-1].prev_cursor > 0


def test_cursor_clone_blocks_and_failures_on_the_wire(server, sc):
    url = server.url
    sid = sc.create_sampling_client(base_model=TINY).result()._sampling_session_id

    def sample(seq_id: int, max_tokens: int = 3) -> str:
        body = {"sampling_session_id": sid, "seq_id": seq_id, "num_samples": 1, "prompt": {"chunks": [
            {"type": "encoded_text", "tokens": PROMPT}]}, "sampling_params": {"max_tokens": max_tokens}}
        r = _post(url, "/asample", body)
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    ok, big, other_clone = sample(0), sample(1, max_tokens=4096), sample(3_000_000_000)
    assert big  # prompt + max_tokens over the context length: the sampler fails it (a failed future, reported as failed)

    def poll(clone: int, cursor: int, timeout: float | None = None) -> dict:
        body = {"target": {"sampling_session_id": sid, "cloned_sampler_id": clone}, "prev_cursor": cursor}
        if timeout is not None:
            body["timeout"] = timeout
        r = _post(url, "/retrieve_futures", body)
        assert r.status_code == 200, r.text
        return types.FuturesRetrieveResponse.model_validate(r.json()).model_dump()

    seen, cursor = {}, 0
    while len(seen) < 2:
        answer = poll(0, cursor)
        cursor = answer["cursor"]
        seen.update({c["request_id"]: c for c in answer["completions"]})
    assert seen[ok]["state"] == "finished" and seen[ok]["response_payload_uncompressed_size"] > 0
    assert seen[big]["state"] == "failed" and set(seen) == {ok, big}
    assert poll(0, cursor, timeout=0)["completions"] == []  # nothing new after the cursor
    clone3 = poll(3, 0)
    assert [c["request_id"] for c in clone3["completions"]] == [other_clone]
    # A fetched result is not reported again, even from cursor 0.
    _post(url, "/retrieve_future", {"request_id": ok})
    assert ok not in {c["request_id"] for c in poll(0, 0, timeout=0)["completions"]}

    for bad in ({"target": {"sampling_session_id": sid}, "prev_cursor": -1},
                {"target": {"sampling_session_id": sid}, "prev_cursor": 2**62},
                {"target": {"sampling_session_id": sid, "cloned_sampler_id": -2}},
                {"target": {"sampling_session_id": sid}, "timeout": -1},
                {"target": {"sampling_session_id": sid}, "prev_cursor": "x"}, {}):
        r = _post(url, "/retrieve_futures", bad)
        assert r.status_code == 400 and r.json()["category"] == "user", (bad, r.text)
    r = _post(url, "/retrieve_futures", {"target": {"sampling_session_id": "nope:sample:0"}})
    assert r.status_code == 404 and r.json()["category"] == "user"


def test_unpickled_clients_get_distinct_clone_ids_from_the_server(server, sc):
    original = sc.create_sampling_client(base_model=TINY).result()
    handle = original.get_sampler_handle()
    clones = [tinker.SamplingClient.from_sampler_handle(handle, api_key=API_KEY) for _ in range(2)]
    outs = [c.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result(timeout=120) for c in clones]
    ref = original.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result(timeout=120)
    assert all(o.sequences[0].tokens == ref.sequences[0].tokens for o in outs)
    assert sorted(c._cloned_sampler_id for c in clones) == [1, 2]
    blocks = sorted(r.seq_id // 1_000_000_000 for r in _rows(server, original._sampling_session_id))
    assert blocks == [0, 1, 2]


def test_join_is_owned_and_checked(server, sc):
    sid = sc.create_sampling_client(base_model=TINY).result()._sampling_session_id
    assert _post(server.url, "/join_sampling_session", {"sampling_session_id": sid}).json()["client_counter"] == 1
    other = _key(server.data_dir, "futures-other")
    for key, body in ((other, {"sampling_session_id": sid}), (API_KEY, {"sampling_session_id": "no:sample:1"})):
        r = _post(server.url, "/join_sampling_session", body, key)
        assert r.status_code == 404 and r.json()["category"] == "user", r.text
        r = _post(server.url, "/retrieve_futures", {"target": body}, key)
        assert r.status_code == 404 and r.json()["category"] == "user", r.text
    r = _post(server.url, "/join_sampling_session", {"sampling_session_id": 5})
    assert r.status_code == 400 and r.json()["category"] == "user"


def test_a_held_poll_answers_with_the_completion_that_woke_it(server, sc):
    sid = sc.create_sampling_client(base_model=TINY).result()._sampling_session_id
    body = {"target": {"sampling_session_id": sid, "cloned_sampler_id": 5}, "prev_cursor": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(_post, server.url, "/retrieve_futures", body)  # nothing yet: it holds
        time.sleep(1.0)  # orders the sample after the poll's first read (no time is asserted)
        r = _post(server.url, "/asample", {"sampling_session_id": sid, "seq_id": 5 * 10**9, "num_samples": 1,
                                           "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                                           "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200, r.text
        answer = held.result(timeout=120)
    assert answer.status_code == 200, answer.text
    assert [c["request_id"] for c in answer.json()["completions"]] == [r.json()["request_id"]]


def test_an_abandoned_sample_is_cancelled_in_the_engine(server, sc, sampler):
    slow = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, types.SamplingParams(max_tokens=3000, stop=[]))
    with pytest.raises((TimeoutError, concurrent.futures.TimeoutError)):
        slow.result(timeout=1.0)
    assert slow.future().cancel()  # the user gives up on it: the SDK sends cancel_future
    deadline = time.monotonic() + 120  # bounds the wait; nothing is asserted on the time
    while time.monotonic() < deadline:
        rows = _rows(server, sampler._sampling_session_id)
        cancelled = [r for r in rows if r.status == "failed" and "cancel" in (r.error or "")]
        if cancelled:
            break
        time.sleep(0.2)
    assert cancelled and cancelled[0].error_category == "user"
    # The engine is free again and nothing was billed for the cancelled request.
    assert sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result(timeout=120).sequences
    usage = Store.sqlite(server.data_dir / "tinkerd.sqlite").query(
        select(UsageRow).where(UsageRow.request_id == cancelled[0].request_id))
    assert usage == [] and cancelled[0].result is None


def test_cancel_future_on_the_wire(server, sc):
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    fb = tc.forward(
        [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})],
        "cross_entropy")
    fb.result()
    rid = [r.request_id for r in _rows(server, tc.model_id) if r.request_type == "Forward"][0]
    r = _post(server.url, "/cancel_future", {"request_id": rid})
    assert r.status_code == 204, r.text  # finished: nothing to stop
    other = _key(server.data_dir, "cancel-other")
    for key, body in ((other, {"request_id": rid}), (API_KEY, {"request_id": "req-none"})):
        r = _post(server.url, "/cancel_future", body, key)
        assert r.status_code == 404 and r.json()["category"] == "user", r.text
    for bad in ({}, {"request_id": 5}, {"request_id": ""}):
        r = _post(server.url, "/cancel_future", bad)
        assert r.status_code == 400 and r.json()["category"] == "user", r.text
