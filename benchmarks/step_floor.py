"""The floor of a LoRA training step on this machine: its GEMMs, attention and AdamW alone.

What any implementation of a Llama-shaped model's LoRA step runs, whatever it does around it,
timed here with nothing in between, on the model's own shapes, through the GEMM functions the
engine calls (engine/gemm.py: oneDNN's for the base weights where it is on):

- body: every decoder linear's forward GEMM and the GEMM of its input gradient (none for layer 0's
  q/k/v, whose input is the frozen embedding), and each adapter's products forward and back as the
  fused LoRA node makes them (engine/lora/fused.py): x A^T, then u B^T summed into the base output;
  d^T u, d B, (d B)^T x, and (d B) A summed into the input gradient (not for layer 0's q/k/v), the
  ones that write a fresh tensor through gemm.lora_mm / lora_b_grad (oneDNN's from
  gemm.LORA_MIN_ROWS rows), the sums through gemm.add_lora (the same from LORA_MIN_ROWS rows, addmm_ below);
- head: the unembedding's GEMMs over the vocabulary tiles the engine uses (engine/head.py),
  forward and input gradient, with the head LoRA's products when it trains one;
- attention: the causal attention kernel as the engine calls it (engine/causal.py), forward and
  backward, per layer;
- AdamW: torch's fused step over the adapter's parameters.

Not in it: norms, activations, rotary embeddings, residual adds, the loss, autograd's
bookkeeping, the wire. So `step / floor` is what a step spends beyond the work it cannot skip, and
`HF step / floor` bounds the ratio any server reaching the floor could show against that HF loop
(benchmarks/training.py prints both). Each part is the best of `repeats` timings.

    python benchmarks/step_floor.py                  # SmolLM2-135M, 2 x 256, rank 32, 1 and 2 threads
    python benchmarks/step_floor.py --train-unembed --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tinkerd.engine import causal, gemm, head  # noqa: E402


def linears(config) -> list[tuple[int, int]]:
    """(in, out) of each adapted linear of one layer: q, k, v, o, gate, up, down."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


class Floor:
    def __init__(self, config, rows: int, tokens: int, rank: int, unembed: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.config, self.rows, self.tokens, self.dtype = config, rows, tokens, dtype
        gemm.onednn()  # its one-time check of the op runs here, not inside a timed part
        m = rows * tokens
        self.shapes = linears(config)
        self.layers = config.num_hidden_layers

        def new(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype).normal_(std=0.02)

        # Each layer its own weights, as a model streams them; activations are shared (they stay in cache anyway).
        self.w = [[new(o, i) for i, o in self.shapes] for _ in range(self.layers)]
        self.a = [[new(rank, i) for i, _ in self.shapes] for _ in range(self.layers)]
        self.b = [[new(o, rank) for _, o in self.shapes] for _ in range(self.layers)]
        dims = {d for shape in self.shapes for d in shape}
        self.x = {d: new(m, d) for d in dims}
        self.d = {d: new(m, d) for d in dims}
        self.head_w = new(config.vocab_size, config.hidden_size)
        self.head_lora = (new(rank, config.hidden_size), new(config.vocab_size, rank)) if unembed else None
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv = [new(rows, tokens, n, head_dim).transpose(1, 2).requires_grad_() for n in (heads, kv_heads, kv_heads)]
        self.g_attn = new(rows, tokens, heads, head_dim)
        self.attn_layer = type("Layer", (), {"is_causal": True, "num_key_value_groups": heads // kv_heads})()
        params = [t.to(torch.float32, copy=True).requires_grad_() for layer in (*self.a, *self.b) for t in layer]
        if self.head_lora is not None:
            params += [t.to(torch.float32, copy=True).requires_grad_() for t in self.head_lora]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        self.adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def body(self) -> None:
        kept = []  # each linear's x A^T, kept for its backward as the fused node keeps it
        m = self.rows * self.tokens
        for layer in range(self.layers):
            for k, (i, o) in enumerate(self.shapes):
                x = self.x[i]
                y = gemm.linear(x, self.w[layer][k])
                kept.append(gemm.lora_mm(x, self.a[layer][k].t(), m))
                gemm.add_lora(y, kept[-1], self.b[layer][k].t(), 1.0, m)  # the delta summed into the base output
        for layer in reversed(range(self.layers)):
            for k, (i, o) in reversed(list(enumerate(self.shapes))):
                x, d, u = self.x[i], self.d[o], kept.pop()
                frozen_input = layer == 0 and k < 3
                gemm.lora_b_grad(d, u, m)
                d_u = gemm.lora_mm(d, self.b[layer][k], m)
                gemm.lora_mm(d_u.t(), x, m)
                if not frozen_input:
                    gemm.add_lora(gemm.input_grad(d, self.w[layer][k]), d_u, self.a[layer][k], 1.0, m)

    def head(self) -> None:
        h = self.config.hidden_size
        x = self.x[h]
        u = x @ self.head_lora[0].t() if self.head_lora else None
        at = 0
        for n in head.row_blocks(x.shape[0]):
            xs, us = x[at:at + n], (u[at:at + n] if u is not None else None)
            g_x, g_u = torch.empty_like(xs), None
            for t, tile in enumerate(head.tiles(self.config.vocab_size)):
                z = gemm.linear(xs, self.head_w[tile])  # the logits tile, then (in the engine) d logits in its place
                if us is not None:  # the LoRA's products as the engine's head makes them (head.LORA_MIN_ROWS)
                    gemm.add_lora(z, us, self.head_lora[1][tile].t(), 1.0, n, head.LORA_MIN_ROWS)
                gemm.add_input_grad(g_x, z, self.head_w[tile], first=t == 0)
                if us is not None:
                    b_tile = self.head_lora[1][tile]
                    if g_u is None:
                        g_u = gemm.lora_mm(z, b_tile, n, head.LORA_MIN_ROWS)
                    else:
                        gemm.add_lora(g_u, z, b_tile, 1.0, n, head.LORA_MIN_ROWS)
                    if gemm.lora_on_onednn(z, n, head.LORA_MIN_ROWS):
                        gemm.lora_mm(us.t(), z, n, head.LORA_MIN_ROWS)  # B's gradient as the engine makes it
                    else:
                        z.t() @ us
            if g_u is not None:
                g_u.t() @ xs
                g_x.addmm_(g_u, self.head_lora[0])
            at += n

    def attention(self) -> None:
        q, k, v = self.qkv
        for _ in range(self.layers):
            out, _ = causal.sdpa_attention(self.attn_layer, q, k, v, None, scaling=q.shape[-1] ** -0.5,
                                           tinkerd_causal_blocks=True)
            out.backward(self.g_attn)

    def adam(self) -> None:
        self.adamw.step()

    def parts(self, repeats: int = 3) -> dict[str, float]:
        """Seconds of each part, best of `repeats` (after one warm-up), and their sum as "floor"."""
        fns = {"body": self.body, "head": self.head, "attention": self.attention, "adamw": self.adam}
        best = {name: float("inf") for name in fns}
        for r in range(repeats + 1):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                if r:
                    best[name] = min(best[name], time.perf_counter() - start)
        best["floor"] = sum(best.values())
        return best


def describe(parts: dict[str, float]) -> str:
    return f"floor {parts['floor'] * 1e3:.0f} ms (" + ", ".join(
        f"{k} {v * 1e3:.0f}" for k, v in parts.items() if k != "floor") + ")"


def main() -> None:
    from transformers import AutoConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench", help="where benchmarks/training.py converted the model")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--train-unembed", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from tinkerd.engine.malloc import keep_freed_memory
    from tinkerd.engine.model.registry import cache_dir_for

    keep_freed_memory()
    model_dir = cache_dir_for(args.model, Path(args.data_dir) / "models")
    config = AutoConfig.from_pretrained(str(model_dir) if model_dir.exists() else args.model)
    floor = Floor(config, args.rows, args.tokens, args.rank, args.train_unembed, getattr(torch, args.dtype))
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        print(f"{args.model} {args.rows} x {args.tokens} rank {args.rank} {args.dtype} threads {threads}: "
              + describe(floor.parts(args.repeats)))


if __name__ == "__main__":
    main()
