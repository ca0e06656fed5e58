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
