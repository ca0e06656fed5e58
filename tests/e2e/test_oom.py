"""A request too big for memory, through the SDK, with the kernel's OOM killer for real: the server
runs in a 5 GiB memory cgroup and the sampler's KV budget and sample cap are lifted, so a 4096-sample
request gets the engine process OOM-killed when its rows join the decode batch (each row's own
columns are allocated up to its max_tokens, 64 positions: ~11 GiB of SmolLM2 KV cache). The samples share their 2000-token
prompt's keys and values (engine/sampler/shared.py), so it is the row count, not the prompt, that
does not fit. It must fail
alone, with a `user` error, once it has killed the engine running alone (two or three kills), while
another client's requests return exactly what they return on a quiet server, and the server goes on.

Needs a writable cgroup memory controller (root; v1 or v2); skipped where there is none.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.chaos import recoveries
from tests import serverproc
from tests.serverproc import API_KEY, start_server

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LIMIT = 5 * 2**30  # server + engine with SmolLM2 and its packed weights: ~3 GiB


def _memory_cgroup(limit: int) -> Path | None:
    """A fresh memory cgroup limited to `limit` bytes, or None where none can be made."""
    name = f"tinkerd-test-{uuid.uuid4().hex[:8]}"
    for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"), (Path("/sys/fs/cgroup"), "memory.max")):
        if not (root / "cgroup.procs").exists() or not (root / limit_file).parent.exists():
            continue
        try:
            path = root / name
            path.mkdir()
            (path / limit_file).write_text(str(limit))
            return path
        except OSError:
            continue
    return None


@pytest.fixture
def cgroup(request):
    path = _memory_cgroup(getattr(request, "param", LIMIT))
    if path is None:
        pytest.skip("no writable cgroup memory controller here")
    yield path
    for _ in range(100):  # the server's processes may still be exiting
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)


@pytest.mark.slow
def test_a_request_that_gets_the_engine_oom_killed_fails_alone(tmp_path, cgroup):
    launcher = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]
    srv = start_server(tmp_path, [MODEL], ["--threads", "2", "--sample-kv-cache-gb", "100", "--max-num-samples", "4096"], launcher=launcher)
    try:
        sc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        victim = sc.create_sampling_client(base_model=MODEL).result()
        attacker = sc.create_sampling_client(base_model=MODEL).result()
        greedy = types.SamplingParams(max_tokens=16, temperature=0.0, stop=[])
        prompt = types.ModelInput.from_ints(list(range(100, 140)))
        want = victim.sample(prompt, 1, greedy).result().sequences[0].tokens

        huge = types.ModelInput.from_ints([(i * 7) % 40000 + 100 for i in range(2000)])
        big = attacker.sample(huge, 4096, types.SamplingParams(max_tokens=64, stop=[]))
        victims = [victim.sample(prompt, 1, greedy) for _ in range(4)]
        with pytest.raises(tinker.RequestFailedError) as info:
            big.result(timeout=300)  # without the poison rule it is re-queued after every kill, forever
        assert info.value.category == "user"
        assert "OOM killer" in str(info.value) and "the last time alone" in str(info.value)
        assert [v.result().sequences[0].tokens for v in victims] == [want] * 4
        assert victim.sample(prompt, 1, greedy).result().sequences[0].tokens == want
        # Killed twice, the second time alone; or, if the victims were admitted beside it the first
        # time, three times (the first suspects are re-run together once). Never more.
        assert 2 <= len(recoveries(srv.lines)) <= 3
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def _grpo_batch(prompts: int = 4, samples: int = 8, prompt_len: int = 256,
                completion: int = 64) -> list[tuple[list[int], dict[str, np.ndarray]]]:
    """The cookbook's RL batch: `samples` completions of each prompt, (tokens, importance_sampling's inputs)."""
    rng = np.random.default_rng(0)
    data = []
    for _ in range(prompts):
        prompt = rng.integers(100, 40000, prompt_len).tolist()
        for _ in range(samples):
            seq = prompt + rng.integers(100, 40000, completion).tolist()
            n = len(seq) - 1
            advantages = np.zeros(n, np.float32)
            advantages[prompt_len - 1 :] = rng.normal()
            data.append((seq[:-1], {"target_tokens": np.array(seq[1:], np.int64), "advantages": advantages,
                                     "logprobs": rng.normal(-2, 0.5, n).astype(np.float32)}))
    return data


TRAIN_LIMIT = 4 * 2**30


@pytest.mark.slow
@pytest.mark.parametrize("cgroup", [TRAIN_LIMIT], indirect=True)
def test_a_forward_backward_too_big_for_memory_recomputes_its_activations_with_the_same_numbers(tmp_path, cgroup):
    """The cookbook's RL batch on SmolLM2 (4 prompts of 256 tokens, 8 samples of 64 each) holds ~5 GB
    of activations for its backward, more than a 4 GiB cgroup leaves the engine. Told to keep them
    (--activation-memory-gb 64), the engine is OOM-killed and the op fails alone; by default the
    pass plans its decoder calls against the memory left and recomputes the layers that would not
    fit in the backward (engine/recompute.py: here ~19 of 30), and the step trains with no engine
    restart, to the bits of the same steps in a process with memory to spare (this test's, keeping
    every activation). (Measured: the default trains this batch down to a 2.75 GiB cgroup.)"""
    launcher = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]
    rows = _grpo_batch()
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs) for tokens, inputs in rows]
    adam = types.AdamParams(learning_rate=1e-3)

    srv = start_server(tmp_path / "keep", [MODEL], ["--threads", "2", "--activation-memory-gb", "64"], launcher=launcher)
    try:
        tc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY).create_lora_training_client(MODEL, rank=32, seed=3).result()
        with pytest.raises(tinker.RequestFailedError) as info:
            tc.forward_backward(data, "importance_sampling").result(timeout=600)
        assert info.value.category == "user" and "OOM killer" in str(info.value)
    finally:
        srv.stop()

    srv = start_server(tmp_path / "auto", [MODEL], ["--threads", "2"], launcher=launcher)
    try:
        tc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY).create_lora_training_client(MODEL, rank=32, seed=3).result()
        got = tc.forward_backward(data, "importance_sampling").result(timeout=600)
        tc.optim_step(adam).result(timeout=120)
        after = tc.forward(data, "importance_sampling").result(timeout=600)
        assert recoveries(srv.lines) == [] and srv.proc.poll() is None
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        replayed = float(re.search(r"^tinkerd_recomputed_layers_total (\S+)$", metrics, re.M).group(1))
        assert replayed > 0  # the layers that would not fit were recomputed, not just lucky
    finally:
        srv.stop()

    want, want_after = _in_this_process(rows, adam.learning_rate)
    assert got.metrics["loss:sum"] == want.metrics["loss:sum"]
    for a, b in zip(got.loss_fn_outputs, want.loss_fn_outputs):
        assert np.array_equal(a["logprobs"].to_numpy(), b["logprobs"])
    assert after.metrics["loss:sum"] == want_after.metrics["loss:sum"]  # the step's gradient, to the bit


def _in_this_process(rows, learning_rate: float):
    """The same steps in an engine in this process, which has memory to keep every activation."""
    import torch

    from tinkerd.engine.engine import Engine
    from tinkerd.types import AdamParams, CreateModelOp, Datum, ForwardBackwardOp, LoraSpec, OptimStepOp

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(serverproc._shared_models_dir)
        engine.load_base_model(MODEL)
        engine.runtime(MODEL).recompute.budget = 10**15
        mine = [Datum(tokens=np.array(tokens, np.int64), loss_fn_inputs=inputs) for tokens, inputs in rows]

        def run(op):
            (result,) = engine.run_ops([op])
            assert not isinstance(result, Exception), result
            return result

        run(CreateModelOp("m", MODEL, LoraSpec(rank=32, alpha=32.0, seed=3)))
        want = run(ForwardBackwardOp("m", mine, "importance_sampling"))
        run(OptimStepOp("m", AdamParams(learning_rate=learning_rate)))
        return want, run(ForwardBackwardOp("m", mine, "importance_sampling", forward_only=True))
    finally:
        torch.set_num_threads(threads)
