"""The core Tinker loop through whichever `tinker` SDK this interpreter imports, for the SDK-version
conformance test (tests/conformance/test_sdk_versions.py): it runs unchanged under 0.36 and 0.38,
against `TINKER_BASE_URL` with `TINKER_API_KEY`, and prints one JSON object as its last stdout line.

Supervised steps (forward_backward cross_entropy + optim_step), sampling through a saved sampler
path and an ephemeral sampler (greedy sample, compute_logprobs), checkpoints (save_state;
create_training_client_from_state and ..._with_optimizer, each followed by a forward; RestClient
list_checkpoints, list_user_checkpoints, get_weights_info, get_training_run, external weights
URLs). TrainingClient.load_state is left out: both versions deprecate it (logging an ERROR), and
0.36's create_training_client_from_state sends the same model_id-addressed load_weights itself.
The test compares the numbers; this script only reports them, with the requests sent, every
`tinker` log record at WARNING+ and every warning raised while it ran.

usage: python sdk_loop.py <base_model> <seed>
"""

from __future__ import annotations

import json
import logging
import os
import sys
import urllib.request
import warnings

import httpx
import tinker
from tinker import types

# 0.38 made the client-creating methods return a future of the client (`.result()` it); 0.36
# returns the client itself. Using 0.38's future as the client still works but warns, so branch.
CREATE_RETURNS_FUTURE = tuple(int(p) for p in tinker.__version__.split(".")[:2]) >= (0, 38)

TOKENS = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30, 100, 200, 300, 400]
PROMPT = TOKENS[:8]
STEPS = 4
ADAM = types.AdamParams(learning_rate=5e-3)  # falls every step on the tiny models, fast
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _record_requests(sink: list[dict]) -> None:
    """Every request the SDK sends, as the server sees it: method, path, JSON body fields, x-sdk-*
    headers. Both SDK versions send through httpx.AsyncClient whatever the transport, so the test can
    tell which wire path each version took (e.g. 0.36's weights_info + legacy load_weights)."""
    send = httpx.AsyncClient.send

    async def recording_send(self, request: httpx.Request, *args, **kwargs):
        try:
            body = json.loads(request.content) if request.content else {}
        except ValueError:  # zstd- or protobuf-encoded: only the route and headers are of interest
            body = None
        sink.append({"method": request.method, "path": request.url.path,
                     "fields": sorted(body) if isinstance(body, dict) else None,
                     "model_id_set": isinstance(body, dict) and body.get("model_id") is not None,
                     "sdk_headers": {k: v for k, v in request.headers.items() if k.startswith("x-sdk-")}})
        return await send(self, request, *args, **kwargs)

    httpx.AsyncClient.send = recording_send


def _client(created):
    return created.result() if CREATE_RETURNS_FUTURE else created


def _datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})


def _step(tc) -> float:
    # Both submitted before either is awaited: the pipelined pattern both SDKs document.
    fb = tc.forward_backward([_datum()], "cross_entropy")
    opt = tc.optim_step(ADAM)
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return loss


def _forward(tc) -> dict:
    out = tc.forward([_datum()], "cross_entropy").result()
    return {"loss": out.metrics["loss:sum"], "logprobs": out.loss_fn_outputs[0]["logprobs"].tolist()}


def _sample(scl) -> dict:
    seq = scl.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0]
    # The server's own reference for the sampled tokens' logprobs: a prefill of prompt + completion.
    ref = scl.compute_logprobs(types.ModelInput.from_ints(PROMPT + list(seq.tokens))).result()
    return {"tokens": list(seq.tokens), "logprobs": list(seq.logprobs), "reference": ref[len(PROMPT):]}


def run(base_model: str, seed: int) -> dict:
    sc = tinker.ServiceClient(base_url=os.environ["TINKER_BASE_URL"], api_key=os.environ["TINKER_API_KEY"])
    # Constructed directly: both versions deprecate ServiceClient.create_rest_client().
    rest = tinker.RestClient(base_url=os.environ["TINKER_BASE_URL"], api_key=os.environ["TINKER_API_KEY"])
    tc = _client(sc.create_lora_training_client(base_model=base_model, rank=8, seed=seed))
    info = tc.get_info()
    out: dict = {"model_id": tc.model_id, "info_base_model": info.model_data.model_name,
                 "losses": [_step(tc) for _ in range(STEPS)]}

    state_path = tc.save_state("state").result().path
    out["saved"] = _forward(tc)
    sampler_path = tc.save_weights_for_sampler("sampler").result().path
    out["sample_saved"] = _sample(_client(sc.create_sampling_client(model_path=sampler_path)))
    out["sample_ephemeral"] = _sample(_client(tc.save_weights_and_get_sampling_client()))
    # One step past the checkpoint: the optimizer state that ..._with_optimizer must restore.
    _step(tc)
    out["saved_next"] = _forward(tc)

    out["from_state"] = _forward(_client(sc.create_training_client_from_state(state_path)))
    with_opt = _client(sc.create_training_client_from_state_with_optimizer(state_path))
    _step(with_opt)
    out["from_state_with_optimizer_next"] = _forward(with_opt)

    weights_info = rest.get_weights_info_by_tinker_path(state_path).result()
    out["weights_info"] = {"base_model": weights_info.base_model, "lora_rank": weights_info.lora_rank}
    out["training_run_base_model"] = rest.get_training_run(tc.model_id).result().base_model
    out["state_path"], out["sampler_path"] = state_path, sampler_path
    out["listed"] = sorted(c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints)
    out["listed_user"] = sorted(c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints)

    external_path = tc.save_weights_external("export").result().path
    urls = rest.get_external_weights_urls(external_path).result().urls
    out["external_files"] = sorted(urls)
    with urllib.request.urlopen(urls[min(urls)], timeout=30) as resp:
        out["external_first_file_bytes"] = len(resp.read())
    return out


def main() -> None:
    requests: list[dict] = []
    _record_requests(requests)
    records = _Records()
    logging.getLogger("tinker").addHandler(records)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Both SDKs leave pooled sockets to the garbage collector; that is no protocol matter.
        warnings.simplefilter("ignore", ResourceWarning)
        out = run(sys.argv[1], int(sys.argv[2]))
    out["sdk_version"] = tinker.__version__
    out["sdk_file"] = tinker.__file__
    out["log_records"] = records.lines
    out["requests"] = requests
    out["warnings"] = [f"{w.category.__name__} {w.filename}:{w.lineno}: {w.message}" for w in caught]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
