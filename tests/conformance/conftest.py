import pytest
import tinker

from tests.serverproc import API_KEY, start_server

TINY = "tinkerd/tiny-qwen3"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    # A 10 MiB KV cache budget: ~20k positions of the tiny models, far above what the tests sample
    # together, so that test_sdk_sampling can send one request over it.
    srv = start_server(tmp_path_factory.mktemp("tinkerd-data"), [TINY, "tinkerd/tiny-llama"],
                       ["--threads", "2", "--sample-kv-cache-gb", "0.01"])
    yield srv
    srv.stop()


@pytest.fixture
def service_client(server):
    client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield client


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory, pg_server_url):
    """`server` on PostgreSQL (`tinkerd serve --db-url`, a fresh database on the session's cluster,
    tests/postgres.py), for the tests parametrized over the store with `store_server`. On a fixed
    port, so that test_postgres.py can kill -9 and restart it in place."""
    import socket

    from tests.postgres import fresh_database

    url = fresh_database(pg_server_url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    args = ["--threads", "2", "--sample-kv-cache-gb", "0.01", "--db-url", url, "--port", port]
    srv = start_server(tmp_path_factory.mktemp("tinkerd-pg-data"), [TINY], args, env={"TINKERD_DB_URL": url})
    srv.args = args  # for a restart in place (test_postgres.py)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def replicas_server(tmp_path_factory):
    """Two `--role api` replicas behind HAProxy and a `--role worker`, on a PostgreSQL of their own
    (tests/replicas.py): one start for the session, shared by every module that runs a test through
    it (test_replicas, and those parametrized by `store_server` and test_quotas' `minute_server`).
    Its `url` is the load balancer's."""
    from tests.replicas import topology

    with topology(tmp_path_factory.mktemp("replicas-data"), [TINY]) as top:
        yield top


STORES = {"sqlite": "server", "postgresql": "pg_server", "replicas": "replicas_server"}


@pytest.fixture(scope="module", params=list(STORES))
def store_server(request):
    """The shared server on each store: SQLite (the default), PostgreSQL, and two API replicas on
    PostgreSQL behind a load balancer."""
    return request.getfixturevalue(STORES[request.param])


@pytest.fixture(scope="module")
def sc(server):
    """One ServiceClient (one server session) per test module, on the module's `server`."""
    return tinker.ServiceClient(base_url=server.url, api_key=API_KEY)


# Timers that are long by default, short on one shared server for the tests of what they do
# (test_quotas' minute-window tests, test_openai's quota test, test_stable_reinforce's expiry,
# test_checkpoints_rest's sweeper): one start instead of four (~10-15 s each). Every test on it
# uses its own account or session.
RECORDED_SEQUENCE_TTL_S = 6.0


@pytest.fixture(scope="session")
def timers_server(tmp_path_factory):
    """--threads 1; a 1 s long-poll hold (so a paused op is seen on the wire within a second),
    recorded sequences kept RECORDED_SEQUENCE_TTL_S, the checkpoint sweeper every 0.2 s."""
    srv = start_server(tmp_path_factory.mktemp("timers-data"), [TINY], [
        "--threads", "1", "--retrieve-future-timeout-s", "1", "--recorded-sequence-ttl-s", str(RECORDED_SEQUENCE_TTL_S),
        "--checkpoint-sweep-interval-s", "0.2"])
    yield srv
    srv.stop()
