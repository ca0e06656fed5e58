"""The data directory fills up in the middle of an SDK training loop (a 64 MiB tmpfs and a ballast
file): new work (a session, an op, a sampler) is refused with a 503 that names the full disk, the
readiness probe says so, work accepted before finishes, and once the ballast goes the loop completes with the losses of an
uninterrupted run, no future left pending and no partial checkpoint files.

The server's models directory is a link out of the tmpfs: the converted tiny model (~86 MB) would
not fit, and it is not what this test fills. Needs root to mount the tmpfs; skipped elsewhere.
"""

from __future__ import annotations

import sqlite3
import time

import httpx
import tinker
from tinker import types

from tests.chaos import assert_nothing_stranded
from tests.serverproc import API_KEY, start_server
from tests.tmpfs import fill, free_bytes, small_tmpfs

TINY = "tinkerd/tiny-qwen3"
STEPS = 4
DATA = [types.Datum(model_input=types.ModelInput.from_ints(list(range(3, 3 + n))),
                    loss_fn_inputs={"target_tokens": list(range(4, 4 + n)), "weights": [1.0] * n})
        for n in (7, 11)]


def _client(tc_service):
    # rank 4 without the unembedding: ~0.2 MB per snapshot, so results and snapshots fit the reserve.
    return tc_service.create_lora_training_client(base_model=TINY, rank=4, seed=7, train_unembed=False).result()


def _step(tc) -> float:
    fb = tc.forward_backward(DATA, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return fb.result().metrics["loss:sum"]


def _stored(data, request_type: str) -> int:
    db = sqlite3.connect(data / "tinkerd.sqlite")
    try:
        return db.execute("SELECT count(*) FROM futures WHERE request_type = ?", (request_type,)).fetchone()[0]
    finally:
        db.close()


def _until_stored(data, request_type: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        have = _stored(data, request_type)
        if have >= n:
            return
        assert time.monotonic() < deadline, f"{have} {request_type} futures stored, expected {n}"
        time.sleep(0.02)


def _sampling_session(http, session_id: str, seq: int):
    return http.post("/api/v1/create_sampling_session", json={
        "session_id": session_id, "sampling_session_seq_id": seq, "base_model": TINY})


def test_a_full_disk_refuses_new_work_and_the_loop_resumes_exactly(tmp_path, models_dir):
    with small_tmpfs(tmp_path / "data", "64m") as data:
        (data / "models").symlink_to(models_dir, target_is_directory=True)
        srv = start_server(data, [TINY], ["--threads", "1", "--engine", "thread"])
        try:
            _run(srv, data)
        finally:
            srv.stop()


def _run(srv, data):
    service = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
    http = httpx.Client(base_url=srv.url, headers={"X-API-Key": API_KEY}, timeout=30)
    assert http.get("/api/v1/readyz").json()["status"] == "ok"

    reference = _client(service)
    expected = [_step(reference) for _ in range(STEPS)]

    tc = _client(service)
    losses = [_step(tc) for _ in range(2)]
    session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()
    sampler = _sampling_session(http, session["session_id"], 0)
    assert sampler.status_code == 200, sampler.text
    accepted = tc.forward_backward(DATA, "cross_entropy")
    _until_stored(data, "ForwardBackward", STEPS + 3)  # the SDK sends it from its own thread: accepted now
    reserve = http.get("/api/v1/readyz").json()["storage"]["reserve_bytes"]
    assert reserve == int(64 * 2**20 * 0.05)  # the default on a small disk: 5% of it
    fill(data / "ballast", leave_bytes=reserve // 2)  # under the reserve, with room for results

    refused = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "10"
    body = refused.json()
    assert body["category"] == "server" and body["error"].startswith("server storage is full: "), body
    assert str(data) in body["error"]
    # A new sampler is new work too: refused before anything is stored. A re-send of one made
    # before the disk filled is not new work: it answers its sampler.
    refused = _sampling_session(http, session["session_id"], 1)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "10", refused.text
    assert refused.json()["error"].startswith("server storage is full: "), refused.text
    assert _sampling_session(http, session["session_id"], 0).json() == sampler.json()
    ready = http.get("/api/v1/readyz")
    assert ready.status_code == 503 and ready.json()["storage"]["ok"] is False
    assert "storage under its free-space reserve" in ready.json()["reasons"]

    loss_3 = accepted.result().metrics["loss:sum"]  # accepted work finishes on the reserve
    optim = tc.optim_step(types.AdamParams(learning_rate=2e-2))  # refused for now; the SDK retries the 503
    time.sleep(2.0)
    assert free_bytes(data) < reserve
    assert _stored(data, "OptimStep") == STEPS + 2  # refused before it was accepted, SDK still retrying
    (data / "ballast").unlink()
    optim.result(timeout=60)
    losses.append(loss_3)
    losses.append(_step(tc))
    assert losses == expected  # bit-identical to the uninterrupted run

    assert http.get("/api/v1/readyz").status_code == 200
    assert _sampling_session(http, session["session_id"], 1).status_code == 200
    assert_nothing_stranded(srv.url, data)  # nothing stranded or failed; every result retrievable
    debris = [p for p in data.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
    assert not debris
    log = "".join(srv.lines)
    assert log.count("is under its free-space reserve") == 1, log  # said once, not per request
    assert log.count("has room again") == 1, log
