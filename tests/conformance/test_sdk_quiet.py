"""The happy path is quiet, and a newer SDK's unknown request fields are ignored, not refused.

- An op that finishes inside retrieve_future's long-poll hold is answered once, with its result: the
  SDK logs nothing (it logs "Retrying request ... because of try_again" at WARNING for every
  try_again it receives as a 200).
- An op that outlives the hold is answered try_again as a 408, which the SDK re-polls quietly.
- A field the server's schema (SDK 0.38) does not know is dropped and named once in the log;
  create_session says so in its warning_message; a wrong type is still a 400.
"""

from __future__ import annotations

import logging
import re
import warnings

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY, start_server

HEADERS = {"X-API-Key": API_KEY}


def _loop(service_client) -> list[float]:
    """A small SL loop with a checkpoint and sampling: every kind of future the quickstart waits on."""
    tc = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    tokens = list(range(5, 30))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:]})
    # Pipelined, as the quickstart and the cookbook do: polls wait on ops still queued, which is when
    # a result landing during the hold must be answered at once.
    pending = []
    for _ in range(6):
        pending.append(tc.forward_backward([datum], "cross_entropy"))
        pending.append(tc.optim_step(types.AdamParams(learning_rate=2e-2)))
    losses = [f.result().metrics["loss:sum"] for f in pending[::2]]
    for f in pending[1::2]:
        f.result()
    tc.save_state("quiet").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(types.ModelInput.from_ints(tokens[:5]), 2, types.SamplingParams(max_tokens=6, temperature=0)).result()
    assert [len(s.tokens) for s in out.sequences] == [6, 6]
    return losses


def _quiet_run(service_client, caplog) -> list[float]:
    caplog.set_level(logging.INFO, logger="tinker")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _loop(service_client)
    ours = service_client.holder.get_session_id()
    # The SDK's clients share one logger and one background thread: clients that earlier tests left
    # open keep heart-beating at servers long gone and log it, naming their own sessions.
    loud = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records
            if r.name.startswith("tinker") and r.levelno >= logging.WARNING
            and set(re.findall(r"sess-[0-9a-f]+", r.getMessage())) <= {ours}]
    assert loud == [], loud
    # ResourceWarnings are Python's hidden-by-default kind (here: sockets of earlier tests' clients,
    # collected meanwhile); every other warning would reach a user's terminal.
    assert [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)] == []
    assert losses[-1] < losses[0], losses
    return losses


class Polls(list):
    """The HTTP status of every retrieve_future answer the SDK gets, in order."""

    def __enter__(self):
        real_send = httpx.AsyncClient.send
        polls = self

        async def counting_send(client, request, *args, **kwargs):
            response = await real_send(client, request, *args, **kwargs)
            if request.url.path.endswith("/retrieve_future"):
                polls.append(response.status_code)
            return response

        self._mp = pytest.MonkeyPatch()
        self._mp.setattr(httpx.AsyncClient, "send", counting_send)
        return self

    def __exit__(self, *exc):
        self._mp.undo()


def test_ops_finishing_inside_the_hold_are_answered_at_once_and_log_nothing(service_client, caplog):
    with Polls() as polls:
        _quiet_run(service_client, caplog)
    # Every op here takes well under the 20 s hold: each poll is answered with its result, none is a
    # try_again (a result landing during the hold was once answered try_again from a stale read).
    assert polls and set(polls) == {200}, polls


@pytest.fixture(scope="module")
def short_hold_server(tmp_path_factory):
    # A 50 ms hold: nearly every op outlives it, so nearly every poll before a result is a try_again.
    # Otherwise the session server's flags: its losses are compared bit for bit with this one's, and
    # a GEMM on 1 thread and on 2 need not round alike (on some CPUs they do not).
    srv = start_server(tmp_path_factory.mktemp("short-hold"), [TINY],
                       ["--threads", "2", "--sample-kv-cache-gb", "0.01", "--retrieve-future-timeout-s", "0.05"])
    yield srv
    srv.stop()


def test_ops_outliving_the_hold_are_re_polled_quietly_with_the_same_results(short_hold_server, service_client, caplog):
    short = tinker.ServiceClient(base_url=short_hold_server.url, api_key=API_KEY)
    with Polls() as polls:
        held = _quiet_run(short, caplog)
    assert 408 in polls, polls  # the hold did pass, and those answers did not reach the log
    assert set(polls) <= {200, 408}, polls
    caplog.clear()
    assert held == _quiet_run(service_client, caplog)  # the same seed and data on a 20 s hold


# -- a newer SDK's fields ------------------------------------------------------------------------


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/{path}", json=body, headers=HEADERS, timeout=60)


def test_unknown_fields_are_ignored_and_named_and_wrong_types_still_fail(server):
    session = {"tags": [], "user_metadata": None, "sdk_version": "9.9.0", "type": "create_session",
               "field_from_the_future": {"nested": [1, 2]}}
    r = _post(server, "create_session", session)
    assert r.status_code == 200, r.text
    answer = types.CreateSessionResponse.model_validate(r.json())
    assert "9.9.0" in answer.warning_message and "field_from_the_future" in answer.warning_message
    session_id = answer.session_id

    r = _post(server, "create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": TINY,
                                       "lora_config": {"rank": 4, "new_lora_knob": True}, "another_new_field": 1})
    assert r.status_code == 200, r.text
    model_id = r.json()["model_id"]
    created = _post(server, "retrieve_future", {"request_id": r.json()["request_id"], "poll_hint": "new"})
    assert created.status_code == 200 and created.json()["model_id"] == model_id, created.text

    r = _post(server, "get_info", {"model_id": model_id, "extra_info_wanted": True})
    assert r.status_code == 200 and r.json()["model_data"]["model_name"] == TINY, r.text

    # Still refused: a wrong type beside an unknown field, named in a user error (400, not retried).
    r = _post(server, "create_model", {"session_id": session_id, "model_seq_id": 1, "base_model": TINY,
                                       "lora_config": {"rank": "eight"}, "another_new_field": 1})
    assert r.status_code == 400 and r.json()["category"] == "user", r.text
    assert "lora_config.rank" in r.json()["error"]

    # Each new field is logged once however often it comes.
    _post(server, "get_info", {"model_id": model_id, "extra_info_wanted": True})
    logged = [line for line in server.lines if "ignoring unknown field GetInfoRequest.extra_info_wanted" in line]
    assert len(logged) == 1, logged


def test_a_current_sdk_gets_no_session_warning(server):
    r = _post(server, "create_session", {"tags": [], "user_metadata": None, "sdk_version": tinker.__version__})
    assert r.status_code == 200 and "warning_message" not in r.json(), r.text
