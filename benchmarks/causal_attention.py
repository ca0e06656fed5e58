"""Causal query blocks (engine/causal.py) against transformers' one SDPA call, in one run.

Two measurements, each alternating the two sides so machine noise hits both alike:
- the attention alone, forward + backward of one layer's shapes (SmolLM2: 9 query heads, 3 key/value
  heads of 64), per width;
- a whole forward_backward + optim_step of SmolLM2-135M (rank 32) in an in-process engine, the
  blocks switched off for the other side (every call then goes to HF's SDPA).

    python benchmarks/causal_attention.py                        # 1 thread, 2 x 256
    python benchmarks/causal_attention.py --threads 2 --tokens 512 --steps 6

The engine runs in this process with the engine process's malloc tuning (engine/malloc.py); the
SDK loop through a server is benchmarks/training.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from tinkerd.engine import causal  # noqa: E402
from tinkerd.engine.malloc import keep_freed_memory  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def attention(widths: list[int], repeats: int = 9) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = SimpleNamespace(is_causal=True, num_key_value_groups=3)
    for t in widths:
        q, k, v = (torch.randn(2, t, h, 64).transpose(1, 2).requires_grad_() for h in (9, 3, 3))
        g = torch.randn(2, t, 9, 64)
        sides = {"HF SDPA": lambda: sdpa_attention_forward(layer, q, k, v, None, scaling=0.125)[0].backward(g),
                 "blocks": lambda: causal.sdpa_attention(layer, q, k, v, None, scaling=0.125,
                                                         tinkerd_causal_blocks=True)[0].backward(g)}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(repeats + 1):
            for name, f in sides.items():
                start = time.perf_counter()
                f()
                if i:
                    times[name].append(time.perf_counter() - start)
        print(f"attention fwd+bwd, 2 x {t}: " + ", ".join(f"{n} {median(x) * 1e3:.1f} ms" for n, x in times.items()))


def engine_steps(data_dir: Path, tokens: int, steps: int) -> None:
    from shared_pass import batch

    from tinkerd.engine.engine import Engine
    from tinkerd.engine.precision import Precision
    from tinkerd.types import AdamParams, CreateModelOp, ForwardBackwardOp, LoraSpec, OptimStepOp, StepBatch

    engine = Engine(data_dir / "models", precision=Precision("cpu", "float32"))
    rt = engine.load_base_model(MODEL)
    engine.run_ops([CreateModelOp("bench", MODEL, LoraSpec(rank=32, alpha=32.0, seed=0))])
    data = batch(0, 2, tokens, rt.vocab_size)

    def step() -> float:
        start = time.perf_counter()
        engine.step(StepBatch(run=[("fb", ForwardBackwardOp("bench", data, "cross_entropy"))]))
        engine.step(StepBatch(run=[("opt", OptimStepOp("bench", AdamParams(learning_rate=1e-4)))]))
        return time.perf_counter() - start

    fits = causal._fits
    times: dict[str, list[float]] = {"HF SDPA": [], "blocks": []}
    try:
        for i in range(steps + 1):
            for name in times:
                causal._fits = fits if name == "blocks" else (lambda *a: False)
                took = step()
                if i:  # the first round warms both up
                    times[name].append(took)
    finally:
        causal._fits = fits
    hf, blocks = median(times["HF SDPA"]), median(times["blocks"])
    print(f"engine step (forward_backward + optim_step), 2 x {tokens}, median of {steps}: "
          f"HF SDPA {hf:.3f} s, blocks {blocks:.3f} s, ratio {hf / blocks:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--widths", default="256,512,1024")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench", help="its models/ is reused, so a model is converted once")
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {' '.join(open('/proc/loadavg').read().split()[:3])}, "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    attention([int(w) for w in args.widths.split(",")])
    engine_steps(Path(args.data_dir), args.tokens, args.steps)


if __name__ == "__main__":
    main()
