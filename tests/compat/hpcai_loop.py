"""The core loop through HPC-AI's `hpcai` 0.2.0 client, unmodified, for tests/conformance/test_hpcai.py.

Runs in the client's own venv (it pins numpy<2), against `HPCAI_BASE_URL` with `HPCAI_API_KEY`, and
prints one JSON object as its last stdout line; the test pins the numbers. Steps: an uninterrupted
run of STEPS supervised steps; a second run from the same seed that saves its state halfway, then
goes on in a new client made from that state (create_training_client_from_state); forward at the
trained weights; a sampler checkpoint, sampled from and scored (compute_logprobs); the REST
listings; the archive download of that checkpoint (bytes in the body); a name saved as both kinds
(archive and delete of the bare name); unload_model, last.

Optimizer: Adam with beta1 = beta2 = 0. hpcai's load_state loads weights only (its LoadWeightsRequest
has no optimizer field; docs/compatibility.md), and with zero betas the optimizer keeps no state
from step to step, so a resumed run must give the uninterrupted run's losses exactly: any
difference is in the weights the server saved and loaded.

usage: python hpcai_loop.py <base_model> <seed>
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
import tarfile

import hpcai
from hpcai import types

TOKENS = [9707, 11, 1879, 0, 220, 3555, 13, 1416, 2585, 525, 498, 30, 100, 200, 300, 400]
PROMPT = TOKENS[:8]
STEPS = 4
ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.0, beta2=0.0, eps=1e-8)
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _datum() -> types.Datum:
    n = len(TOKENS) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=TOKENS[1:], dtype="int64", shape=[n]),
                                       "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n])})


def _loss(out) -> float:
    logprobs = out.loss_fn_outputs[0]["logprobs"].tolist()
    return -sum(logprobs) / len(logprobs)


def _step(tc) -> float:
    fb = tc.forward_backward([_datum()], "cross_entropy")
    opt = tc.optim_step(ADAM)
    loss = _loss(fb.result())
    opt.result()
    return loss


def _members(archive: bytes) -> dict[str, str]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        return {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest() for m in tar.getmembers() if m.isfile()}


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # the client's own exception types; the test reads the message
        return f"{type(e).__name__}: {e}"
    return None


def main(base_model: str, seed: int) -> dict:
    records = _Records()
    logging.getLogger("hpcai").addHandler(records)
    service = hpcai.ServiceClient(base_url=os.environ["HPCAI_BASE_URL"], api_key=os.environ["HPCAI_API_KEY"])
    out: dict = {"hpcai_version": hpcai.__version__ if hasattr(hpcai, "__version__") else None,
                 "capabilities": [m.model_name for m in service.get_server_capabilities().supported_models]}

    # An uninterrupted run.
    whole = service.create_lora_training_client(base_model=base_model, rank=8, seed=seed)
    out["model_id"] = whole.model_id
    out["info_model_name"] = whole.get_info().model_name
    out["losses"] = [_step(whole) for _ in range(STEPS)]

    # The same run, saved halfway and resumed in a new client.
    first = service.create_lora_training_client(base_model=base_model, rank=8, seed=seed)
    out["second_model_id"] = first.model_id
    half = [_step(first) for _ in range(STEPS // 2)]
    state_path = first.save_state("half").result().path
    resumed = service.create_training_client_from_state(state_path)
    out["state_path"] = state_path
    out["resumed_model_id"] = resumed.model_id
    out["resumed_losses"] = half + [_step(resumed) for _ in range(STEPS - STEPS // 2)]

    # forward at the trained weights: the logprobs a forward_backward would compute there.
    fwd = whole.forward([_datum()], "cross_entropy").result()
    out["forward_loss"] = _loss(fwd)
    out["forward_output_type"] = fwd.loss_fn_output_type

    # Sampling from saved weights: greedy, then the sequence scored by compute_logprobs.
    sampler_path = whole.save_weights_for_sampler("w1").result().path
    out["sampler_path"] = sampler_path
    sampler = service.create_sampling_client(model_path=sampler_path, base_model=base_model)
    sample = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + list(sample.tokens))).result()
    out["sample"] = {"tokens": list(sample.tokens), "logprobs": list(sample.logprobs),
                     "stop_reason": sample.stop_reason, "scored": list(scored)}
    out["prompt_logprobs_bug"] = _error(lambda: sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY,
                                                               include_prompt_logprobs=True).result())

    # REST, as the client validates it (checkpoint_path on every checkpoint).
    rest = service.create_rest_client()
    run = rest.get_training_run(whole.model_id).result()
    out["run"] = {"id": run.training_run_id, "base_model": run.base_model, "lora_rank": run.lora_rank,
                  "last_sampler_path": run.last_sampler_checkpoint.checkpoint_path}
    out["run_by_path"] = rest.get_training_run_by_checkpoint_path(sampler_path).result().training_run_id
    out["listed_runs"] = [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    out["second_checkpoints"] = [(c.checkpoint_id, c.checkpoint_type, c.checkpoint_path)
                                 for c in rest.list_checkpoints(first.model_id).result().checkpoints]

    # The archive: the checkpoint's files in a tar.gz, in the body.
    out["archive_w1"] = _members(rest.download_checkpoint_archive(whole.model_id, "w1").result())
    out["archive_w1_by_path"] = _members(rest.download_checkpoint_archive_by_checkpoint_path(sampler_path).result())

    # A name saved as both kinds (the cookbook's kind="both"): the bare name's archive is the sampler
    # copy; its delete is refused; a name of one kind is deleted.
    whole.save_state("both").result()
    whole.save_weights_for_sampler("both").result()
    out["archive_both"] = _members(rest.download_checkpoint_archive(whole.model_id, "both").result())
    out["delete_both_error"] = _error(lambda: rest.delete_checkpoint(whole.model_id, "both").result())
    whole.save_weights_for_sampler("w2").result()
    rest.delete_checkpoint(whole.model_id, "w2").result()
    listed = rest.list_checkpoints(whole.model_id).result().checkpoints
    out["checkpoints_after_delete"] = sorted(c.checkpoint_id for c in listed)

    out["unloaded"] = whole.unload_model().result().model_id
    out["log_records"] = records.lines
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
