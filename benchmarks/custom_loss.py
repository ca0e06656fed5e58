"""Custom loss step time: server-side (create_custom_loss, one forward+backward on the server) vs
the SDK's client-side path (a forward, the loss on the client, then a forward+backward).

One server, two training runs of the same seed, interleaved A B A B so machine noise hits both
alike; each step is forward_backward_custom + optim_step through the official SDK, with a DPO-style
per-datum loss. Prints the median step time and tokens/s of each side, and how much CPU other
processes used meanwhile (the machine is shared).

    python benchmarks/custom_loss.py                       # tiny-qwen3, 4 x 128 tokens, 1 thread
    python benchmarks/custom_loss.py --model HuggingFaceTB/SmolLM2-135M-Instruct --threads 2

Measured (branch customloss, default arguments: tiny-qwen3, 4 x 128
tokens, rank 16, 1 thread, 8 steps per side, on the shared 2-core machine with load average 10-12;
other processes used 229 CPU-s over the 134 s run, so absolute times are inflated):

    server-side (1 pass)           median step   6732.7 ms       76.0 tokens/s
    client-side (SDK, 2 passes)    median step   9598.4 ms       53.3 tokens/s
    speed-up server-side / client-side: 1.43x     (losses identical on both sides, |diff| 0)

The expected ratio is (forward + forward/backward) / forward/backward, about 1.3-1.5x; the
server-side path also saves one round trip and the client-side loss evaluation.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.training import interleave  # noqa: E402
from tests.serverproc import API_KEY, start_server  # noqa: E402


def dpo(logprobs, weights, ref_logprobs, beta):
    margin = beta * (weights * (logprobs - ref_logprobs)).sum()
    return -F.logsigmoid(margin), {"custom/margin:mean": margin.detach()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tinkerd/tiny-qwen3")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench-custom-loss")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    server = start_server(Path(args.data_dir), [args.model], ["--threads", str(args.threads)])
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        handle = sc.create_custom_loss(dpo, {"logprobs": 1, "weights": 1, "ref_logprobs": 1, "beta": 0}).result()
        assert handle.loss_id is not None, "the server did not take the loss server-side"
        rng = np.random.default_rng(0)
        data = []
        for _ in range(args.rows):
            tokens = rng.integers(0, 50_000, args.tokens + 1)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(tokens[1:].astype(np.int64)),
                "weights": types.TensorData.from_numpy(rng.choice([-1.0, 1.0], args.tokens).astype(np.float32)),
                "ref_logprobs": types.TensorData.from_numpy((-rng.random(args.tokens) * 10).astype(np.float32)),
                "beta": types.TensorData(data=[0.1], dtype="float32", shape=[]),
            }))
        sides = {
            "server-side (1 pass)": (sc.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result(),
                                     handle),
            "client-side (SDK, 2 passes)": (sc.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result(),
                                            dataclasses.replace(handle, loss_id=None)),
        }

        def step(tc, loss) -> float:
            fb = tc.forward_backward_custom(data, loss)
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
            value = fb.result().metrics["loss:sum"]
            opt.result()
            return value

        run = interleave({name: functools.partial(step, tc, loss) for name, (tc, loss) in sides.items()},
                         args.rounds, args.steps, {}, shared_pids=(server.proc.pid,))
    finally:
        server.stop()

    print(f"model={args.model} batch={args.rows}x{args.tokens} rank={args.rank} threads={args.threads} "
          f"steps/side={args.rounds * args.steps} cpus={os.cpu_count()}")
    print(f"CPU used by other processes during the run: {run.other_cpu_s:.1f} s over {run.wall_s:.1f} s wall")
    a, b = run.results.values()
    print(f"same losses on both sides: max |diff| {max(abs(x - y) for x, y in zip(a, b)):.2e}")
    server_rate, client_rate = run.print_rates(args.rows * args.tokens, 30).values()
    print(f"speed-up server-side / client-side: {server_rate / client_rate:.2f}x")


if __name__ == "__main__":
    main()
