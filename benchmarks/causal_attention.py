"""Causal attention of an fp32 training pass: transformers' one SDPA call, the flash kernel in causal
query blocks (engine/causal.py) and oneDNN GEMMs in query blocks (engine/causal_gemm.py), in one run.

Two measurements, each alternating the sides so machine noise hits them alike:
- the attention alone, forward + backward of one layer's shapes (SmolLM2: 9 query heads, 3 key/value
  heads of 64), per width;
- a whole forward_backward + optim_step of SmolLM2-135M (rank 32) in an in-process engine, each side
  switched on in turn (HF SDPA: no blocks at all; flash blocks: the GEMM blocks off).

    python benchmarks/causal_attention.py                        # 1 thread, 2 x 256
    python benchmarks/causal_attention.py --threads 2 --tokens 512 --steps 6

The engine runs in this process with the engine process's malloc tuning (engine/malloc.py; run it
with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 for the huge pages the engine process gets too); the SDK
loop through a server is benchmarks/training.py.
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

import contextlib  # noqa: E402

from tinkerd.engine import causal, causal_gemm  # noqa: E402
from tinkerd.engine.malloc import keep_freed_memory  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


SIDES = ("HF SDPA", "flash blocks", "GEMM blocks")


@contextlib.contextmanager
def side(name: str):
    """The blocks `name` asks for, in every training pass inside the block."""
    fits, gemm_fits = causal._fits, causal_gemm.fits
    if name == "HF SDPA":
        causal._fits = lambda *a: False
    if name != "GEMM blocks":
        causal_gemm.fits = lambda *a: False
    try:
        yield
    finally:
        causal._fits, causal_gemm.fits = fits, gemm_fits


def attention(widths: list[int], repeats: int = 9) -> None:
    layer = SimpleNamespace(is_causal=True, num_key_value_groups=3)
    for t in widths:
        q, k, v = (torch.randn(2, t, h, 64).transpose(1, 2).requires_grad_() for h in (9, 3, 3))
        g = torch.randn(2, t, 9, 64)
        times: dict[str, list[float]] = {name: [] for name in SIDES}
        for i in range(repeats + 1):
            for name in SIDES:
                with side(name):
                    start = time.perf_counter()
                    causal.sdpa_attention(layer, q, k, v, None, scaling=0.125, tinkerd_causal_blocks=True)[0].backward(g)
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

    times: dict[str, list[float]] = {name: [] for name in SIDES}
    for i in range(steps + 1):
        for name in SIDES:
            with side(name):
                took = step()
            if i:  # the first round warms them up
                times[name].append(took)
    med = {name: median(x) for name, x in times.items()}
    print(f"engine step (forward_backward + optim_step), 2 x {tokens}, median of {steps}: "
          + ", ".join(f"{n} {m:.3f} s" for n, m in med.items())
          + f"; GEMM blocks / flash blocks {med['flash blocks'] / med['GEMM blocks']:.3f}x, "
          f"/ HF SDPA {med['HF SDPA'] / med['GEMM blocks']:.3f}x")


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
