"""Sampling throughput: tinkerd's decode batch against HF `generate`, and fused adapters against sequential.

One run, one model, the same prompts, interleaved A B A B (docs/performance.md): absolute times
on a shared machine are noise, the ratio of neighbours is the result. Printed per case: generated
tokens per second of each side, the ratio, and the CPU seconds other processes used meanwhile
(from /proc/stat), since a busy neighbour slows 2-thread runs by 3-100x.

    python benchmarks/sampling.py --threads 1 --repeats 3

Cases (greedy, `stop=[]` / min_new_tokens so both sides generate exactly --new-tokens per row):
  b1        one prompt: HF generate, batch 1   vs  tinkerd, one request
  b8        8 prompts of different lengths: HF generate, batch 8 (left-padded)  vs  tinkerd, 8 requests
  adapters  4 requests, each through its own rank-32 LoRA adapter: tinkerd one after another
            vs  tinkerd all 4 fused into one decode batch
  sdk       the b8 requests: tinkerd's engine in this process  vs  the official SDK against a
            `tinkerd serve` subprocess (HTTP, control, engine process) with the same thread count;
            what the whole path costs (docs/performance.md: within a few percent)
Targets (docs/performance.md): b8 >= 2x HF; fused adapters >= 1.8x sequential.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "Write a short poem about the sea.",
    "Explain, step by step, how a bicycle stays upright while it moves forward and why the rider "
    "rarely has to think about balance once the wheels are turning at a reasonable speed.",
    "Q: What is the capital of France?\nA:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "List three facts about the Moon:",
    "In machine learning, overfitting happens when a model learns the training data too well, including its noise, so that",
]


def cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (all cores, /proc/stat)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


# Processes working for this benchmark (the `sdk` case's server and its engine): their CPU is ours.
OWN_PIDS: list[int] = []


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children so far (0 once gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(_tree_cpu_s(int(c)) for c in children)


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime + sum(_tree_cpu_s(pid) for pid in OWN_PIDS)


def measure(fn) -> tuple[float, float, int]:
    """(wall seconds, other processes' CPU seconds, tokens) of one call of fn() -> tokens."""
    busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.perf_counter()
    tokens = fn()
    wall = time.perf_counter() - t0
    other = max(0.0, (cpu_busy_s() - busy0) - (own_cpu_s() - own0))
    return wall, other, tokens


class HF:
    def __init__(self, models_dir: Path):
        from transformers import AutoTokenizer

        from tinkerd.engine.model.registry import load_model

        loaded = load_model(MODEL, models_dir)
        self.model = loaded.model.eval()
        self.tok = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token

    def generate(self, prompts: list[list[int]], new_tokens: int) -> int:
        batch = self.tok.pad({"input_ids": prompts}, return_tensors="pt")
        with torch.inference_mode():
            out = self.model.generate(
                **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=self.tok.pad_token_id,
            )
        return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


class Tinkerd:
    def __init__(self, models_dir: Path, rank: int):
        from tinkerd.engine.engine import Engine
        from tinkerd.types import LoraSpec

        self.engine = Engine(models_dir)
        self.rt = self.engine.load_base_model(MODEL)
        self.adapters = []
        gen = torch.Generator().manual_seed(0)
        for i in range(4):
            a = self.rt.pool.create(f"bench-{i}", LoraSpec(rank=rank, alpha=32, seed=i), trainable=False)
            with torch.no_grad():
                for _, b in a.weights.values():
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
            self.adapters.append(a)

    def run(self, prompts: list[list[int]], new_tokens: int, adapters: list | None = None) -> int:
        """All prompts as concurrent requests (one decode batch); each through adapters[i] if given."""
        from tinkerd.engine.sampler import sample as sample_mod
        from tinkerd.types import SampleOp, SamplingParams, StepBatch

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, stop_at_eos=False)
        ops = []
        for i, p in enumerate(prompts):
            path = adapters[i].key if adapters else None
            ops.append((f"r{i}", SampleOp(MODEL, path, np.array(p), params)))
        real = sample_mod.acquire_adapter
        # The adapters live in the pool already (no checkpoint files): hand them out by key.
        sample_mod.acquire_adapter = lambda rt, path, max_idle: rt.pool.acquire(path) if path else None
        try:
            out = self.engine.step(StepBatch(admit=ops, decode=True))
            done = list(out.done)
            while out.active_rows:
                out = self.engine.step(StepBatch(decode=True))
                done.extend(out.done)
        finally:
            sample_mod.acquire_adapter = real
        results = [r for _, r in done]
        assert all(hasattr(r, "sequences") for r in results), results
        return sum(len(s.tokens) for r in results for s in r.sequences)


class SDK:
    """The same requests through the official SDK against a real `tinkerd serve` (started lazily)."""

    def __init__(self, models_dir: Path, threads: int):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import tinker

        from tests.serverproc import API_KEY, start_server

        data_dir = Path(tempfile.mkdtemp(prefix="tinkerd-bench-"))
        (data_dir / "models").symlink_to(models_dir.resolve())  # the weights already on disk
        self.server = start_server(data_dir, [MODEL], ["--threads", str(threads)])
        OWN_PIDS.append(self.server.proc.pid)
        service = tinker.ServiceClient(base_url=self.server.url, api_key=API_KEY)
        client = service.create_sampling_client(base_model=MODEL)
        self.client = client.result() if hasattr(client, "result") else client

    def run(self, prompts: list[list[int]], new_tokens: int) -> int:
        from tinker import types

        params = types.SamplingParams(max_tokens=new_tokens, temperature=0.0, stop=[])
        futures = [self.client.sample(types.ModelInput.from_ints(p), 1, params) for p in prompts]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--models-dir", type=Path, default=Path("~/.tinkerd/models").expanduser())
    ap.add_argument("--cases", default="b1,b8,adapters")
    ap.add_argument("--huge-pages", choices=["on", "off"], default="on",
                    help="malloc on 2 MB pages, as the engine process runs (engine/malloc.py); both sides "
                         "run in this one process, so the baseline gets them too")
    args = ap.parse_args()
    from tinkerd.engine.malloc import with_huge_pages

    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (args.huge_pages == "on") != ("glibc.malloc.hugetlb" in tunables):
        # glibc reads its tunables at process start only: start this benchmark again, with or without.
        env = dict(os.environ)
        kept = ":".join(t for t in tunables.split(":") if t and not t.startswith("glibc.malloc.hugetlb"))
        env.pop("GLIBC_TUNABLES", None)
        if kept:
            env["GLIBC_TUNABLES"] = kept
        os.execve(sys.executable, [sys.executable, *sys.argv], with_huge_pages(env) if args.huge_pages == "on" else env)
    torch.set_num_threads(args.threads)

    hf = HF(args.models_dir)
    td = Tinkerd(args.models_dir, args.rank)
    prompts = [hf.tok.encode(t) for t in TEXTS]
    n = args.new_tokens
    sdk = SDK(args.models_dir, args.threads) if "sdk" in args.cases.split(",") else None
    cases = {
        "b1": ("HF generate b1", lambda: hf.generate(prompts[:1], n), "tinkerd b1", lambda: td.run(prompts[:1], n)),
        "b8": ("HF generate b8", lambda: hf.generate(prompts, n), "tinkerd b8", lambda: td.run(prompts, n)),
        "adapters": (
            "4 adapters sequential",
            lambda: sum(td.run([prompts[i]], n, [td.adapters[i]]) for i in range(4)),
            "4 adapters fused",
            lambda: td.run(prompts[:4], n, td.adapters),
        ),
        "sdk": ("tinkerd engine b8", lambda: td.run(prompts, n), "SDK -> tinkerd serve b8", lambda: sdk.run(prompts, n)),
    }
    print(f"model {MODEL}, threads {args.threads}, {n} new tokens per row, repeats {args.repeats}, "
          f"prompt lengths {[len(p) for p in prompts]}, LoRA rank {args.rank}, "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    summary = []
    try:
        _run_cases(args, cases, summary)
    finally:
        if sdk is not None:
            sdk.server.stop()
    print("\n".join(summary))


def _run_cases(args, cases: dict, summary: list[str]) -> None:
    for name in args.cases.split(","):
        a_name, a_fn, b_name, b_fn = cases[name]
        a_fn(), b_fn()  # warm-up: packing, allocator, first-call paths
        rates = {a_name: [], b_name: []}
        for rep in range(args.repeats):
            for label, fn in ((a_name, a_fn), (b_name, b_fn)):
                wall, other, tokens = measure(fn)
                rates[label].append(tokens / wall)
                print(f"  {name} rep {rep}: {label:24s} {tokens / wall:7.1f} tok/s  ({tokens} tokens, {wall:.2f} s, "
                      f"other processes {other:.2f} CPU-s)")
        a_med, b_med = float(np.median(rates[a_name])), float(np.median(rates[b_name]))
        pairs = [b / a for a, b in zip(rates[a_name], rates[b_name])]
        summary.append(f"{name}: {b_name} {b_med:.1f} tok/s vs {a_name} {a_med:.1f} tok/s -> "
                       f"{b_med / a_med:.2f}x (per-pair ratios {', '.join(f'{r:.2f}' for r in pairs)})")


if __name__ == "__main__":
    main()
