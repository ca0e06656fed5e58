"""Metering: known token counts in, the same counts out of AdminClient.get_billing_usage, the `tinker billing`
CLI and `tinkerd usage`; queue wait is recorded apart and never billed. On SQLite, on PostgreSQL, and
through two API replicas behind a load balancer (`store_server`), where each replica reports the same
totals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.conftest import TINY
from tinkerd.config import ServerConfig
from tinkerd.control.accounts import Accounts
from tinkerd.control.metering import Meter
from tinkerd.control.store.db import Store

ACCOUNT = "meter-acct"
QUEUED = 4  # forward_backward calls sent at once: the last waits for the others


def _datum(n_targets: int) -> types.Datum:
    tokens = list(range(1, n_targets + 1))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": tokens[1:] + [1]})


def _tinkerd(data_dir, *args, env: dict | None = None) -> str:
    return subprocess.run([sys.executable, "-m", "tinkerd.cli.main", *args[:1], "--data-dir", str(data_dir), *args[1:]],
                          capture_output=True, text=True, check=True, env=env).stdout


@pytest.fixture(scope="module")
def metered(store_server):
    server = store_server  # on SQLite, on PostgreSQL, and through replicas
    out = _tinkerd(server.data_dir, "keys", "create", "--name", "meter", "--account", ACCOUNT, env=server.cli_env())
    key = out.split("TINKER_API_KEY=")[1].split()[0]
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    tc.forward_backward([_datum(5), _datum(7)], "cross_entropy").result()  # 12 trained tokens
    sampler = sc.create_sampling_client(base_model=TINY).result()
    res = sampler.sample(types.ModelInput.from_ints([1, 2, 3, 4, 5, 6]), 2,
                         types.SamplingParams(max_tokens=4, stop=[])).result()  # 6 prefill, 8 sampled
    assert [len(s.tokens) for s in res.sequences] == [4, 4]
    futures = [tc.forward_backward([_datum(3)], "cross_entropy") for _ in range(QUEUED)]  # 4 x 3 more
    for f in futures:
        f.result()
    store = Store.open(ServerConfig(data_dir=server.data_dir, db_url=server.env.get("TINKERD_DB_URL")))
    account_id = Accounts(store).account_id(ACCOUNT, create=False)
    return dict(key=key, url=server.url, data_dir=server.data_dir, rows=Meter(store).rows(account_id),
                account_id=account_id, env=server.cli_env(), doors=getattr(server, "doors", [server.url]))


TRAINED, PREFILL, SAMPLED = 12 + 3 * QUEUED, 6, 8


def _window() -> tuple[datetime, datetime]:
    start = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    return start, start + timedelta(hours=3)


def _sums(events) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        info = e["event_info"] if isinstance(e, dict) else e.event_info.model_dump()
        out[info["type"]] = out.get(info["type"], 0) + info.get("token_count", info.get("count", 0))
    return out


def test_usage_rows_count_tokens_and_keep_queue_wait_apart(metered):
    rows = metered["rows"]
    assert sum(r.trained_tokens for r in rows) == TRAINED
    assert sum(r.prefill_tokens for r in rows) == PREFILL and sum(r.sampled_tokens for r in rows) == SAMPLED
    fbs = [r for r in rows if r.request_type == "ForwardBackward"]
    assert [r.trained_tokens for r in fbs] == [12] + [3] * QUEUED
    assert all(r.compute_s > 0 and r.queue_wait_s >= 0 for r in rows)
    assert {r.session_id for r in rows} and all(r.account_id == metered["account_id"] for r in rows)
    # The last of the burst waited behind the others' compute; that wait is recorded, not billed.
    assert fbs[-1].queue_wait_s > 0


def test_admin_client_billing_usage(metered):
    start, end = _window()
    for url in metered["doors"]:  # the server, or each replica: the same totals
        usage = tinker.AdminClient(base_url=url, api_key=metered["key"]).get_billing_usage(start, end).result()
        sums = _sums(usage.data)
        assert sums["training"] == TRAINED and sums["sampling_prefill"] == PREFILL and sums["sampling_sample"] == SAMPLED
    admin = tinker.AdminClient(base_url=metered["url"], api_key=metered["key"])
    config = ServerConfig()
    for e in usage.data:
        if e.event_info.type == "training":
            # Priced by tokens alone: queue wait (and compute time) add nothing.
            assert e.estimated_cost_usd == pytest.approx(config.price_train_usd_per_mtok * e.event_info.token_count / 1e6)
        assert e.user_id == metered["account_id"] and e.session_id in usage.sessions
    storage = admin.get_current_checkpoint_storage_usage().result()
    assert storage.data == []  # this account saved no checkpoints
    # The SDK's own validation and ours: windows are hour-aligned.
    r = httpx.get(f"{metered['url']}/api/v1/billing/usage/events", headers={"X-API-Key": metered["key"]},
                  params={"starting_on": "2026-01-01T00:30:00Z", "ending_before": "2026-01-01T02:00:00Z"})
    assert r.status_code == 400 and r.json()["category"] == "user"


def test_other_accounts_see_none_of_it(metered):
    from tests.serverproc import API_KEY

    start, end = _window()
    usage = tinker.AdminClient(base_url=metered["url"], api_key=API_KEY).get_billing_usage(start, end).result()
    assert metered["account_id"] not in {e.user_id for e in usage.data}


def test_tinker_billing_cli(metered):
    start, end = _window()
    env = {**os.environ, "TINKER_BASE_URL": metered["url"], "TINKER_API_KEY": metered["key"], "TINKER_TELEMETRY": "0"}
    fmt = lambda d: d.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    proc = subprocess.run([sys.executable, "-m", "tinker.cli", "--format", "json", "billing", "usage", fmt(start), fmt(end)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    sums = _sums(out["data"])
    assert sums["training"] == TRAINED and sums["sampling_prefill"] == PREFILL and sums["sampling_sample"] == SAMPLED


def test_tinkerd_usage_cli(metered):
    out = _tinkerd(metered["data_dir"], "usage", "--account", ACCOUNT, env=metered["env"])
    lines = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:] if line.startswith("  ")}
    assert out.startswith(f"account {ACCOUNT}")
    assert int(lines["trained_tokens"]) == TRAINED and int(lines["prefill_tokens"]) == PREFILL
    assert int(lines["sampled_tokens"]) == SAMPLED and float(lines["queue_wait_s"]) > 0
    assert "(not billed)" in out
    # The server's --price-* options, here too: $3 more per million trained tokens adds exactly that.
    dearer = _tinkerd(metered["data_dir"], "usage", "--account", ACCOUNT, "--price-train-usd-per-mtok", "6",
                      env=metered["env"])
    estimate = lambda text: float(text.splitlines()[0].rsplit("$", 1)[1])  # noqa: E731
    assert estimate(dearer) == pytest.approx(estimate(out) + 3 * TRAINED / 1e6, abs=2e-6)


def _usage(metered, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinkerd.cli.main", "usage", "--data-dir", str(metered["data_dir"]),
                           *args], capture_output=True, text=True, env=metered["env"])


def test_tinkerd_usage_time_window_and_errors(metered):
    recent = _usage(metered, "--account", ACCOUNT, "--since", "2h")
    assert recent.returncode == 0 and recent.stdout.startswith("usage from ")
    lines = {line.split()[0]: line.split()[1] for line in recent.stdout.splitlines() if line.startswith("  ")}
    assert int(lines["trained_tokens"]) == TRAINED
    first = min(r.completed_at for r in metered["rows"])
    # A window that ends before the first op, in ISO form (naive = UTC), holds nothing.
    before = _usage(metered, "--account", ACCOUNT, "--until", (first - timedelta(seconds=1)).isoformat())
    assert before.returncode == 0 and "no usage recorded" in before.stdout
    for args, message in ((["--account", "nobody"], "no account named 'nobody'"),
                          (["--since", "yesterday"], "--since 'yesterday': expected an ISO 8601 time"),
                          (["--since", "1h", "--until", "2h"], "must be after --since")):
        proc = _usage(metered, *args)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_checkpoint_storage_is_billed_in_gigabyte_hours(server):
    """A checkpoint stored from `time` until deleted: size_bytes / 1e9 * hours, as storage events."""
    key = _tinkerd(server.data_dir, "keys", "create", "--name", "storage", "--account", "storage-acct")
    key = key.split("TINKER_API_KEY=")[1].split()[0]
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    path = tc.save_state("kept").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=key)
    [ckpt] = rest.list_checkpoints(tc.model_id).result().checkpoints
    deleting = datetime.now(timezone.utc)
    rest.delete_checkpoint_from_tinker_path(path).result()
    deleted = datetime.now(timezone.utc)
    start, end = _window()
    usage = tinker.AdminClient(base_url=server.url, api_key=key).get_billing_usage(start, end).result()
    storage = [e for e in usage.data if e.event_info.type == "storage"]
    gb_hours = sum(e.event_info.gigabyte_hours for e in storage)
    gb = ckpt.size_bytes / 1e9
    # Its end lies between the two clocks read around the delete call.
    lo = gb * (deleting - ckpt.time).total_seconds() / 3600
    hi = gb * (deleted - ckpt.time).total_seconds() / 3600
    assert lo * (1 - 1e-9) <= gb_hours <= hi * (1 + 1e-9) and gb_hours > 0
    rate = ServerConfig().price_storage_usd_per_gb_month
    for e in storage:
        assert e.session_id is None and e.base_model == TINY and e.effective_rate_usd_per_gigabyte_month == rate
        assert e.estimated_cost_usd == pytest.approx(rate * e.event_info.gigabyte_hours / 720)
    out = _tinkerd(server.data_dir, "usage", "--account", "storage-acct")
    lines = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("  ")}
    assert float(lines["storage_gb_hours"]) == pytest.approx(gb_hours, abs=1e-9)
