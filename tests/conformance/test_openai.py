"""The OpenAI-compatible endpoints (/v1) through the official `openai` client against a live tinkerd.

Pinned against the tinker SDK's own `sample` on the same server: a trained adapter's sampler path
answers /v1/chat/completions and /v1/completions with exactly the tokens (and logprobs) `sample`
gives for the same prompt tokens, seed and settings, greedy and seeded; a stream carries the same
tokens and text, sent as they are decoded (also across an engine restart, and through an API
replica behind a load balancer, tests/replicas.py, where the driver's engine decodes them); stop strings cut the
text where OpenAI does; usage is metered like asample's; another account's checkpoint is a 404 and
bad parameters are 400s, both in OpenAI's error shape.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import httpx
import openai
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.conformance.conftest import TINY
from tests.conformance.sft import train_on
from tests.conformance.test_ownership import _key
from tests.serverproc import API_KEY, logged_ops, start_server

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
TEXT = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30]


def _world(server) -> dict:
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    train_on(tc, TEXT, 3, learning_rate=2e-2)
    path = tc.save_weights_for_sampler("oai").result().path
    info = tc.get_info()
    tok = AutoTokenizer.from_pretrained(info.model_data.tokenizer_id)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    return dict(sc=sc, path=path, tok=tok, client=client, sampler=sc.create_sampling_client(model_path=path).result(),
                url=server.url, data_dir=server.data_dir, db_url=server.env.get("TINKERD_DB_URL"))


@pytest.fixture(scope="module")
def world(server):
    return _world(server)


@pytest.fixture(scope="module")
def replica_world(replicas_server):
    """The same through the load balancer: each request lands on an api replica, which has no engine."""
    return _world(replicas_server)


# The stream tests run on the embedded server and through the replicas.
WORLDS = pytest.mark.parametrize("where", ["world", "replica_world"], ids=["embedded", "replicas"])


def _sdk(world, prompt: list[int], n: int, **params):
    res = world["sampler"].sample(types.ModelInput.from_ints(prompt), n, types.SamplingParams(**params)).result()
    return res.sequences


def _ids(logprobs_content) -> list[int]:
    return [int(e.token.removeprefix("token_id:")) for e in logprobs_content]


def _chat_prompt(tok) -> list[int]:
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.parametrize("settings", [dict(temperature=0.0, seed=None), dict(temperature=0.9, seed=11)],
                         ids=["greedy", "seeded"])
def test_chat_equals_sdk_sample(world, settings):
    tok = world["tok"]
    prompt = _chat_prompt(tok)
    want = _sdk(world, prompt, 2, max_tokens=10, **settings)
    r = world["client"].chat.completions.create(
        model=world["path"], messages=MESSAGES, max_tokens=10, n=2, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True}, **{k: v for k, v in settings.items() if v is not None})
    assert r.object == "chat.completion" and r.model == world["path"] and len(r.choices) == 2
    for choice, seq in zip(r.choices, want):
        assert _ids(choice.logprobs.content) == list(seq.tokens)
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(seq.logprobs, abs=1e-5)
        assert choice.message.role == "assistant"
        assert choice.message.content == tok.decode(seq.tokens, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if seq.stop_reason == "stop" else "length")
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == sum(len(s.tokens) for s in want)


@WORLDS
def test_chat_stream_yields_the_same_tokens(request, where):
    world = request.getfixturevalue(where)
    kw = dict(model=world["path"], messages=MESSAGES, max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3,
              extra_body={"return_tokens_as_token_ids": True})
    full = world["client"].chat.completions.create(**kw)
    chunks = list(world["client"].chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    want = _sdk(world, _chat_prompt(world["tok"]), 1, max_tokens=12, temperature=0.0)[0]
    tokens = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert _ids(tokens) == list(want.tokens) == _ids(full.choices[0].logprobs.content)
    assert [len(e.top_logprobs) for e in tokens] == [3] * len(tokens)
    assert tokens[0].top_logprobs[0].logprob == pytest.approx(want.logprobs[0], abs=1e-5)  # greedy: the top one
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)


@WORLDS
def test_chat_stream_sends_tokens_while_decoding(request, where):
    """A live stream: its first content chunk reaches the client before the server has finished the
    request (the future's completed_at, as stored), and the streamed text and tokens equal the
    non-streamed greedy answer and the SDK's `sample`, token for token. Through a replica too: the
    tokens cross from the driver as they are decoded (store/listen.py: tinkerd_tokens)."""
    from tinkerd.control.store.db import utcnow

    world = request.getfixturevalue(where)
    kw = dict(model=world["path"], messages=[{"role": "user", "content": "Count on and on."}],
              temperature=0.0, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    kw["max_tokens"] = 48
    full = world["client"].chat.completions.create(**kw)
    prompt = list(world["tok"].apply_chat_template(kw["messages"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
    want = _sdk(world, prompt, 1, max_tokens=48, temperature=0.0)[0]
    # The answer is long (47 decode steps after the first token): room for the stream to be early.
    assert full.usage.completion_tokens == len(want.tokens) == 48
    arrivals, ticks, chunks = [], [], []
    for c in world["client"].chat.completions.create(stream=True, **kw):
        arrivals.append(utcnow())
        ticks.append(time.monotonic())
        chunks.append(c)
    row = max(logged_ops(world["data_dir"], request_type="Sample", db_url=world["db_url"]), key=lambda r: r.created_at)
    assert row.status == "complete"
    token_at = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].logprobs]
    assert arrivals[token_at[0]] < row.completed_at  # without live streaming every chunk comes after this
    # Token by token, not in bursts: a decode step is ~5 ms here, so most chunks come >= 2 ms apart.
    # A proxy that corks the stream (HAProxy without http-no-delay) delivers them in two or three
    # bursts of chunks < 1 ms apart, the first still before completed_at.
    gaps = [ticks[b] - ticks[a] for a, b in zip(token_at, token_at[1:])]
    assert sum(g >= 0.002 for g in gaps) >= len(gaps) // 4, [round(g * 1000, 1) for g in gaps]
    tokens = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert _ids(tokens) == list(want.tokens) == _ids(full.choices[0].logprobs.content)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content


def test_completions_equal_sdk_sample(world):
    tok = world["tok"]
    text = "The capital of France is"
    want = _sdk(world, tok.encode(text), 1, max_tokens=8, temperature=0.0)[0]
    r = world["client"].completions.create(model=world["path"], prompt=text, max_tokens=8, temperature=0.0, logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert [int(t.removeprefix("token_id:")) for t in lp.tokens] == list(want.tokens)
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert r.choices[0].text == tok.decode(want.tokens, skip_special_tokens=True)
    # Token-id prompts and batches: one choice per prompt, in order; the stream's text is the same.
    batch = world["client"].completions.create(model=world["path"], prompt=[TEXT, tok.encode(text)], max_tokens=8,
                                               temperature=0.0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[1].text == r.choices[0].text
    assert batch.choices[0].text == tok.decode(_sdk(world, TEXT, 1, max_tokens=8, temperature=0.0)[0].tokens,
                                               skip_special_tokens=True)
    stream = world["client"].completions.create(model=world["path"], prompt=text, max_tokens=8, temperature=0.0,
                                                stream=True)
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text


def test_stop_string_cuts_the_text(world):
    client, tok = world["client"], world["tok"]
    kw = dict(model=TINY, prompt=TEXT, max_tokens=10, temperature=0.0)
    full = client.completions.create(logprobs=0, extra_body={"return_tokens_as_token_ids": True}, **kw).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in full.logprobs.tokens]
    stop = next(s for s in (tok.decode([i]) for i in ids[3:]) if s.strip() and "\ufffd" not in s)
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    # OpenAI leaves the stop string out; generation ended at it.
    assert cut.text == full.text[:full.text.find(stop)] and cut.finish_reason == "stop"


def test_models_lists_base_models_and_own_checkpoints(world):
    ids = [m.id for m in world["client"].models.list().data]
    assert TINY in ids and world["path"] in ids
    other = openai.OpenAI(base_url=f"{world['url']}/v1", api_key=_key(world["data_dir"], "oai-b"), max_retries=0)
    other_ids = [m.id for m in other.models.list().data]
    assert TINY in other_ids and world["path"] not in other_ids


def test_foreign_checkpoint_is_404(world):
    other = openai.OpenAI(base_url=f"{world['url']}/v1", api_key=_key(world["data_dir"], "oai-b2"), max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        other.chat.completions.create(model=world["path"], messages=MESSAGES, max_tokens=2)
    missing = world["path"].rsplit("/", 1)[0] + "/never-saved"
    with pytest.raises(openai.NotFoundError) as e2:
        other.chat.completions.create(model=missing, messages=MESSAGES, max_tokens=2)
    # Another account's checkpoint answers exactly like one that does not exist.
    assert e.value.body["message"].replace(world["path"], "X") == e2.value.body["message"].replace(missing, "X")
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model="no/such-model", prompt="hi", max_tokens=2)


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(n=0), "n"),
    (dict(top_p=0), "top_p"),
    (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(max_tokens=100000), None),  # over the context: refused by the same checks as asample
    (dict(messages=[]), "messages"),
])
def test_bad_params_are_400_in_openai_shape(world, kwargs, param):
    kw = {"model": TINY, "messages": MESSAGES, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        world["client"].chat.completions.create(**kw)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]
    if param is not None:
        assert e.value.body["param"] == param


def test_error_shape_on_the_wire(world):
    url = f"{world['url']}/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url, json={"model": TINY, "messages": MESSAGES}, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{world['url']}/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 404 and "error" in r.json() and "message" in r.json()["error"]


def test_usage_is_metered_like_asample(world):
    key = _key(world["data_dir"], "oai-meter")
    client = openai.OpenAI(base_url=f"{world['url']}/v1", api_key=key, max_retries=0)
    r = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=5, n=2, temperature=0.0)
    start = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    usage = tinker.AdminClient(base_url=world["url"], api_key=key).get_billing_usage(start, start + timedelta(hours=3))
    sums: dict[str, int] = {}
    for e in usage.result().data:
        sums[e.event_info.type] = sums.get(e.event_info.type, 0) + e.event_info.token_count
    assert sums == {"sampling_prefill": r.usage.prompt_tokens, "sampling_sample": r.usage.completion_tokens}


def test_a_multi_turn_chat_loop_equals_sample_on_the_whole_history(world):
    """A plain chat loop: each reply is appended to the history, and every turn's answer is what
    `sample` gives on the chat template of the whole history so far."""
    tok, history = world["tok"], [{"role": "user", "content": "Hello."}]
    for user_turn in ("And again?", "Once more."):
        prompt = list(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False))
        want = _sdk(world, prompt, 1, max_tokens=6, temperature=0.0)[0]
        r = world["client"].chat.completions.create(model=world["path"], messages=history, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == tok.decode(want.tokens, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(prompt)
        history += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": user_turn}]


def test_a_v1_request_waits_on_its_accounts_quota_like_asample(timers_server):
    """The same quotas as asample: over its tokens per minute, an account's /v1 request is queued and
    paused (retrieve_future says paused_rate_limit for its future), never failed; lifting the quota
    lets it run. On the shared timers server (conftest.py: a 1 s long-poll hold)."""
    from sqlalchemy import select

    from tests.conformance.test_quotas import _key as quota_key
    from tests.conformance.test_quotas import _tinkerd
    from tinkerd.control.store.db import Store
    from tinkerd.control.store.tables import AccountRow, FutureRow

    srv = timers_server
    key = quota_key(srv, "oai-tpm", "--max-tokens-per-minute", "40")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=300)
    kw = dict(model=TINY, prompt=list(range(1, 21)), max_tokens=8, temperature=0.0)  # 28 tokens charged
    first = client.completions.create(**kw)
    assert first.choices[0].text is not None
    box: list = []
    waiter = threading.Thread(target=lambda: box.append(client.completions.create(**kw)))
    waiter.start()
    store = Store.sqlite(srv.data_dir / "tinkerd.sqlite")
    [account] = store.query(select(AccountRow).where(AccountRow.name == "oai-tpm"))
    mine = select(FutureRow).where(FutureRow.status == "pending", FutureRow.account_id == account.account_id)
    for _ in range(600):  # bounded wait for the second request's future to be stored
        pending = store.query(mine)
        if pending:
            break
        time.sleep(0.05)
    [row] = pending
    r = httpx.post(f"{srv.url}/api/v1/retrieve_future", json={"request_id": row.request_id},
                   headers={"X-API-Key": key}, timeout=30)
    assert r.status_code == 408 and r.json()["queue_state"] == "paused_rate_limit", r.text
    assert waiter.is_alive() and not box
    lifted = _tinkerd(srv.data_dir, "accounts", "set-quota", "oai-tpm", "--max-tokens-per-minute", "unlimited")
    assert lifted.returncode == 0
    waiter.join(timeout=300)
    assert box and box[0].choices[0].text == first.choices[0].text


def test_a_stream_goes_on_across_an_engine_restart(tmp_path):
    """The engine process is SIGKILLed after the stream's first token: control restarts it and runs
    the request again from its first token; greedy repeats the tokens already sent, so the stream
    skips them and goes on, and its text equals the non-streamed answer."""
    import os
    import signal

    from tests.chaos import engine_pid

    srv = start_server(tmp_path, [TINY], ["--threads", "1"])
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        kw = dict(model=TINY, messages=[{"role": "user", "content": "Count on and on."}], max_tokens=48,
                  temperature=0.0)
        full = client.chat.completions.create(**kw)
        assert full.usage.completion_tokens == 48
        text, killed = "", False
        for c in client.chat.completions.create(stream=True, **kw):
            if c.choices and c.choices[0].delta.content and not killed:
                os.kill(engine_pid(srv.proc.pid), signal.SIGKILL)
                killed = True
            text += (c.choices[0].delta.content or "") if c.choices else ""
        assert killed and text == full.choices[0].message.content
        # The engine did restart with the request in flight (control logs what it re-queued).
        assert any("engine recovered" in line and "re-queued 1" in line for line in srv.lines), srv.lines[-20:]
    finally:
        srv.stop()
