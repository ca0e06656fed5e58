"""The sampler's two oneDNN packings of a linear weight (lora/layers.py), side by side.

SmolLM2-135M's shapes, random fp32 weights: its 30 layers' body linears (q|k|v, o, gate|up, down
as the sampler stacks them, 425 MB, streamed from memory as in a decode step) and its 49k-row head,
at M rows per call, through the 1x1-convolution packing and the inner-product packing, interleaved
(A B A B); best of --repeats per side. A ratio above 1 means the convolution is faster.

    python benchmarks/packing.py --threads 1 --rows 1,2,8,32,128

Run it as the engine runs, on 2 MB pages: GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (engine/malloc.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sampling import cpu_busy_s  # noqa: E402
from tinkerd.engine.lora.layers import _pack, packed_linear_2d  # noqa: E402

HIDDEN, INNER, HEADS_DIM, KV_DIM, LAYERS, VOCAB = 576, 1536, 576, 192, 30, 49152
BODY = [(HEADS_DIM + 2 * KV_DIM, HIDDEN), (HIDDEN, HEADS_DIM), (2 * INNER, HIDDEN), (HIDDEN, INNER)]


def best_of(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return min(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,8,32,128")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    dense = [[torch.randn(shape, generator=gen) * 0.02 for shape in BODY] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02
    packed = {conv: ([[_pack(w, conv) for w in layer] for layer in dense], _pack(head, conv)) for conv in (True, False)}
    body_mb = sum(w.numel() for layer in dense for w in layer) * 4 / 1e6
    print(f"threads {args.threads}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}, "
          f"body {body_mb:.0f} MB, head {head.numel() * 4 / 1e6:.0f} MB")
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k, generator=gen) for _, k in BODY}
        times, busy0, own0 = {}, cpu_busy_s(), time.process_time()
        for conv in (True, False, True, False):  # A B A B: first pair warms (primitive creation)
            body, head_packed = packed[conv]

            def body_pass():
                for layer in body:
                    for w in layer:
                        packed_linear_2d(inputs[w.shape[1]], w, None)

            times[conv] = (best_of(body_pass, args.repeats),
                           best_of(lambda: packed_linear_2d(inputs[HIDDEN], head_packed, None), args.repeats))
        other = max(0.0, cpu_busy_s() - busy0 - (time.process_time() - own0))
        (cb, ch), (ib, ih) = times[True], times[False]
        print(f"rows {m:4d}: body conv {cb * 1e3:7.1f} ms  inner product {ib * 1e3:7.1f} ms  -> {ib / cb:.2f}x | "
              f"head conv {ch * 1e3:6.2f} ms  inner product {ih * 1e3:6.2f} ms  -> {ih / ch:.2f}x  "
              f"(other processes {other:.2f} CPU-s)")


if __name__ == "__main__":
    main()
