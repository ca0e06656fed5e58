"""GET /metrics scraped while the unmodified SDK trains and samples: the ops are counted with the
right counts (accepted, completed, latency observations), tokens by kind equal what was metered,
queue and engine state are there, and the page needs no key and names no account or run."""

from __future__ import annotations

import threading

import httpx
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.conformance.conftest import TINY
from tests.serverproc import API_KEY

STEPS = 3
TOKENS = [5, 6, 7, 8, 9, 10, 11]


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{url}/metrics", timeout=30)  # no key: the scrape is unauthenticated by design
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _delta(before, after, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_an_sdk_loop(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:]})
    before = _scrape(server.url)
    scrapes, stop = [], threading.Event()

    def scraper():  # scraping during the loop neither fails nor disturbs it
        while not stop.is_set():
            scrapes.append(_scrape(server.url))
            stop.wait(0.2)

    t = threading.Thread(target=scraper)
    t.start()
    try:
        for _ in range(STEPS):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = sc.create_sampling_client(base_model=TINY).result()
        res = sampler.sample(types.ModelInput.from_ints([1, 2, 3, 4]), 2, types.SamplingParams(max_tokens=3, stop=[])
                             ).result()
    finally:
        stop.set()
        t.join()
    assert len(res.sequences) == 2
    after = _scrape(server.url)
    assert scrapes, "no scrape ran during the loop"
    for kind, n in (("ForwardBackward", STEPS), ("OptimStep", STEPS), ("Sample", 1)):
        lane = "sample" if kind == "Sample" else "train"
        assert _delta(before, after, "tinkerd_ops_accepted_total", type=kind, lane=lane) == n
        assert _delta(before, after, "tinkerd_ops_completed_total", type=kind, status="complete") == n
        assert _delta(before, after, "tinkerd_op_latency_seconds_count", type=kind) == n
        assert _delta(before, after, "tinkerd_op_engine_seconds_count", type=kind) == n
    # Every observation fell in some bucket: +Inf equals the count.
    assert after[("tinkerd_op_latency_seconds_bucket", (("le", "+Inf"), ("type", "ForwardBackward")))] == \
        after[("tinkerd_op_latency_seconds_count", (("type", "ForwardBackward"),))]
    assert _delta(before, after, "tinkerd_op_queue_wait_seconds_count", lane="sample") == 1
    # Tokens as metered: targets per forward_backward, the prompt once, 2 x 3 sampled.
    assert _delta(before, after, "tinkerd_tokens_total", kind="trained") == STEPS * (len(TOKENS) - 1)
    assert _delta(before, after, "tinkerd_tokens_total", kind="prefill") == 4
    assert _delta(before, after, "tinkerd_tokens_total", kind="sampled") == 6
    # State read at scrape time.
    assert after[("tinkerd_engine_state", (("state", "running"),))] == 1
    assert after[("tinkerd_queue_depth", (("lane", "train"),))] == 0
    assert after[("tinkerd_resident_adapters", (("kind", "training"),))] >= 1
    budget = after[("tinkerd_kv_cache_budget_bytes", ())]  # --sample-kv-cache-gb 0.01 per base model sampled
    assert budget > 0 and budget % int(0.01 * 2**30) == 0
    assert _delta(before, after, "tinkerd_db_statement_seconds_count", statement="insert") >= 2 * STEPS + 1
    assert _delta(before, after, "tinkerd_db_statement_seconds_count", statement="update") >= 2 * STEPS + 1
    # Nothing names an account, a run or a path.
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert tc.model_id not in text and "tinker://" not in text and API_KEY not in text


def test_prompt_tokens_served_from_the_prefix_cache_are_counted(server):
    """A prompt sampled again with the same weights is taken from the kept prefill (engine/sampler/
    prefix.py); /metrics counts those tokens, as the responses report them."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    sampler = sc.create_sampling_client(base_model=TINY).result()
    prompt = types.ModelInput.from_ints([917, 3, 41, 59, 26, 535, 89, 79])  # no other test's prompt
    params = types.SamplingParams(max_tokens=2, temperature=0.0, stop=[])
    before = _scrape(server.url)
    first = sampler.sample(prompt, 1, params).result()
    again = sampler.sample(prompt, 1, params).result()
    after = _scrape(server.url)
    assert (first.prompt_cache_hit_tokens, again.prompt_cache_hit_tokens) == (0, prompt.length)
    assert _delta(before, after, "tinkerd_prompt_cache_hit_tokens_total") == prompt.length
