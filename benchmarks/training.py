"""Training throughput: the official SDK through tinkerd vs a tuned in-process HF + PEFT loop.

Both sides train the same model with the same LoRA (rank, layers), batch, dtype and thread count,
with AdamW, interleaved A B A B in one run so machine noise hits both alike. The tinkerd side is
the whole path a user pays for: SDK -> HTTP -> control -> engine. The baseline gets what the engine
gets: glibc malloc tuned the same way (engine/malloc.py: freed memory kept, no block mapped, huge
pages asked for; HF's [tokens, vocabulary] logits were otherwise faulted in anew every step, and
every ratio this script printed before session 43 was against that slower baseline). Also the same torch thread count, torch's fused AdamW over the adapter only, as the engine runs it
(engine/adam.py; `--hf-adamw foreach` for the multi-tensor one), bf16 as PEFT does it (model loaded in bf16, step under autocast, fp32
adapters, logits upcast before the loss: docs/precision.md).

`--baseline-tree DIR` adds a third side, a server run from another checkout (main, say) with the
same arguments: before vs after of an engine change in one interleaved run.

Share of the FLOP ceiling. The work a LoRA step must do, with B rows of S tokens (N = B * S):

    F = N * (4 * P_mm + 6 * P_lora) + 3 * L * 4 * B * S^2 * n_heads * head_dim

P_mm: parameters of every matmul a token passes (each decoder linear and the LM head; not the
embedding lookup). Frozen, they cost 2 FLOPs per parameter forward and 2 for the gradient of their
input (no weight gradient). P_lora: the adapter's parameters, 2 + 2 + 2 (their weight gradient
too). Attention: Q K^T and A V, 2 * 2 * B * S^2 * n_heads * head_dim per layer forward, twice that
backward, counted over the full S x S (no causal halving). What either side recomputes (tinkerd's
head beyond KEEP_CELLS logits, engine/head.py) is not counted: F is the useful work. The ceiling is this
machine's GEMM rate at the run's dtype and thread count, measured in the same run on a
transformer-shaped matmul ([N, H] x [H, 4H], best of several) before and after the steps; the
share is F / median step / ceiling. On a loaded machine wall times inflate, so the same share is
also given per CPU-second: F / median CPU-seconds of a step (this process and the servers, the
engine included) / the GEMM's FLOP per CPU-second.

The floor. The same run also times the step's GEMMs, attention kernel and AdamW alone, on the
model's own shapes, with nothing between them (benchmarks/step_floor.py), after the steps. Each
side's step is printed as a multiple of it, and HF's step over the floor is the most any server
that does this work can show against that HF loop on this machine.

    python benchmarks/training.py                                  # SmolLM2-135M, 2 x 256, 1 thread, fp32
    python benchmarks/training.py --threads 1,2 --dtypes float32,bfloat16 --rounds 3
    python benchmarks/training.py --baseline-tree /work/main       # + the same server from main
    python benchmarks/training.py --train-unembed                  # LoRA on lm_head too, both sides
    python benchmarks/training.py --rows 8 --tokens 319 --group-size 8 --prompt-tokens 256 --threads 2
        # GRPO-shaped: 8 samples of one 256-token prompt. tinkerd runs the shared prompt once
        # (engine/prefixes.py); F and the % of ceiling still count every row's work, the work a
        # plain pass does, so they exceed what the machine could do without the sharing.

Concurrent tenants on one base model: benchmarks/training_tenants.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from step_floor import Floor, describe  # noqa: E402
from tests.serverproc import API_KEY, ServerProcess, share_models, start_server  # noqa: E402
from tinkerd.engine import gemm  # noqa: E402
from tinkerd.engine.malloc import keep_freed_memory, with_huge_pages  # noqa: E402
from tinkerd.engine.model.registry import own_memory  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def proc_jiffies(pid: int) -> int:
    parts = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(parts[11]) + int(parts[12])  # utime + stime


def tree_jiffies(pid: int) -> int:
    """CPU jiffies of a process and its children (the engine runs in a child of the server)."""
    total = proc_jiffies(pid)
    for tid in os.listdir(f"/proc/{pid}/task"):
        for child in open(f"/proc/{pid}/task/{tid}/children").read().split():
            total += tree_jiffies(int(child))
    return total


def load_average() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


# A server is done with a step once it used no CPU for this long (interleave).
QUIET_S, QUIET_MAX_S = 0.5, 10.0


@dataclass
class Interleaved:
    """An A B A B run: each side's step times and step results, and the CPU that other processes
    used meanwhile (the machine is shared, so absolute times are inflated by that much)."""

    times: dict[str, list[float]]
    # CPU seconds each step used in this process and the servers (engine included): less inflated
    # than wall time by other processes on the machine, as long as no side waits on a descheduled thread.
    cpu: dict[str, list[float]]
    results: dict[str, list]
    other_cpu_s: float
    wall_s: float


def interleave(sides: dict[str, Callable[[], object]], rounds: int, steps: int,
               server_pids: dict[str, int], shared_pids: tuple[int, ...] = ()) -> Interleaved:
    """`rounds` rounds in which each side runs `steps` steps in turn, so machine noise hits both
    alike; the caller warms each side up first. A step's CPU is this process's during the step plus
    its own server's (`server_pids`: side -> pid; none for an in-process side) from the step's start
    until that server is quiet again (no CPU for QUIET_S; the next side waits for it): work a server
    does after answering (a recovery snapshot written in the background) is charged to its own
    side, not to the side that runs next. A server several sides share (`shared_pids`) is charged
    to whichever side's step it ran in."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    results: dict[str, list] = {k: [] for k in sides}
    hz = os.sysconf("SC_CLK_TCK")

    def own() -> int:
        return proc_jiffies(os.getpid()) + sum(tree_jiffies(p) for p in (*server_pids.values(), *shared_pids))

    def in_step() -> int:
        return proc_jiffies(os.getpid()) + sum(tree_jiffies(p) for p in shared_pids)

    def server(name: str) -> int:
        return tree_jiffies(server_pids[name]) if name in server_pids else 0

    def quiet(name: str) -> int:
        """The server's jiffies once it used none for QUIET_S (at most QUIET_MAX_S of waiting)."""
        now, deadline = server(name), time.monotonic() + QUIET_MAX_S
        while name in server_pids and time.monotonic() < deadline:
            time.sleep(QUIET_S)
            if now == (now := server(name)):
                break
        return now

    busy0, total0 = cpu_jiffies()
    own0 = own()
    for _ in range(rounds):
        for name, step in sides.items():
            for _ in range(steps):
                s0, j0, t0 = server(name), in_step(), time.perf_counter()
                results[name].append(step())
                times[name].append(time.perf_counter() - t0)
                j1 = in_step()
                cpu[name].append((j1 - j0 + quiet(name) - s0) / hz)
    busy1, total1 = cpu_jiffies()
    own1 = own()
    wall_s = (total1 - total0) / os.cpu_count() / hz
    other_cpu_s = max(0, (busy1 - busy0) - (own1 - own0)) / hz
    return Interleaved(times, cpu, results, other_cpu_s, wall_s)


def engine_seconds(url: str) -> dict[str, tuple[float, float]]:
    """type -> (sum, count) of the server's tinkerd_op_engine_seconds: time in the engine per op."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name in ("tinkerd_op_engine_seconds_sum", "tinkerd_op_engine_seconds_count"):
                out.setdefault(s.labels["type"], [0.0, 0.0])[s.name.endswith("_count")] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def make_batch(vocab: int, rows: int, tokens: int, seed: int = 0, group: int = 1, prompt: int = 0) -> np.ndarray:
    """[rows, tokens + 1] random tokens; with `group` > 1 each `group` consecutive rows share their
    first `prompt` tokens (GRPO's samples of one prompt)."""
    rng = np.random.default_rng(seed)
    batch = rng.integers(0, vocab, size=(rows, tokens + 1))
    if group > 1:
        for start in range(0, rows, group):
            batch[start : start + group, :prompt] = batch[start, :prompt]
    return batch


def step_flops(config, rank: int, rows: int, tokens: int, unembed: bool = False) -> float:
    """F of the module docstring for a Llama-shaped config (SmolLM2, Qwen3); `unembed`: a LoRA on the head too."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * head_dim
    q = heads * head_dim
    # (in, out) of each adapted linear in one layer: q, k, v, o, gate, up, down.
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    p_mm = layers * sum(i * o for i, o in shapes) + h * config.vocab_size
    p_lora = layers * sum(rank * (i + o) for i, o in shapes) + (rank * (h + config.vocab_size) if unembed else 0)
    n = rows * tokens
    return n * (4 * p_mm + 6 * p_lora) + 3 * layers * 4 * rows * tokens**2 * heads * head_dim


def gemm_rate(n: int, h: int, dtype: torch.dtype, repeats: int = 5) -> tuple[float, float]:
    """Best FLOP per second of [n, h] x [h, 4h] in `dtype` at the current thread count, by wall
    time and by this process's CPU time (which a loaded machine inflates far less), through torch's
    default GEMM or the engine's (engine/gemm.py: oneDNN's), whichever is faster here."""
    x = torch.randn(n, h).to(dtype)
    w = torch.randn(4 * h, h).to(dtype)
    wall = cpu = float("inf")
    calls = 8  # per sample: the process's CPU clock takes in another thread's time late, a ms-long GEMM's not at all
    for linear in (torch.nn.functional.linear, gemm.linear):
        linear(x, w)
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                linear(x, w)
            wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return calls * 2 * n * h * 4 * h / wall, calls * 2 * n * h * 4 * h / cpu


class OneDNNLinear(torch.autograd.Function):
    """F.linear with its two GEMMs on the engine's (engine/gemm.py), for `--hf-onednn`: the HF +
    PEFT loop given the GEMMs tinkerd's engine runs. The weight gradient (PEFT's A and B) stays
    torch's, as in the engine."""

    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(x, w)
        ctx.bias = bias is not None
        return gemm.linear(x, w, bias)

    @staticmethod
    def backward(ctx, d):
        x, w = ctx.saved_tensors
        dx = gemm.input_grad(d, w) if ctx.needs_input_grad[0] else None
        dw = d.reshape(-1, d.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = d.reshape(-1, d.shape[-1]).sum(0) if ctx.bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def _onednn_linear(x, w, bias=None):
    return OneDNNLinear.apply(x, w, bias)


class HFPeft:
    def __init__(self, model_dir: str, rank: int, batch: np.ndarray, dtype: str, adamw: str, unembed: bool = False,
                 onednn: bool = False):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
        own_memory(model)  # as the engine's (engine/model/registry.py): not a view of the file's memory map
        # PEFT keeps the adapter fp32 on a bf16 model (autocast_adapter_dtype), as tinkerd does.
        targets = TARGETS + ["lm_head"] if unembed else TARGETS
        self.model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=targets, lora_dropout=0.0))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0,
                                     **{adamw: True})
        self.autocast = dtype == "bfloat16"
        self.linear = _onednn_linear if onednn else None
        self.input_ids = torch.from_numpy(batch[:, :-1]).long()
        self.labels = torch.from_numpy(batch[:, 1:]).long()

    def step(self) -> float:
        plain = torch.nn.functional.linear
        if self.linear is not None:  # nn.Linear looks F.linear up at every call
            torch.nn.functional.linear = self.linear
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else nullcontext():
                logits = self.model(input_ids=self.input_ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), self.labels.flatten(), reduction="sum")
            loss.backward()
        finally:
            torch.nn.functional.linear = plain
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


class TinkerdSDK:
    def __init__(self, url: str, model: str, rank: int, batch: np.ndarray, unembed: bool = False):
        import tinker
        from tinker import types

        self.types = types
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        self.tc = sc.create_lora_training_client(base_model=model, rank=rank, train_unembed=unembed, seed=0).result()
        self.data = [
            types.Datum(model_input=types.ModelInput.from_ints(row[:-1].tolist()), loss_fn_inputs={"target_tokens": row[1:].tolist()})
            for row in batch
        ]

    def step(self) -> float:
        fb = self.tc.forward_backward(self.data, "cross_entropy")
        opt = self.tc.optim_step(self.types.AdamParams(learning_rate=1e-4))
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return loss


_made: list[Path] = []  # the data dirs this run made, removed at its end


def serve(base: Path, label: str, model: str, args: list[str], tree: str | None) -> ServerProcess:
    """A server on a fresh data dir under `base` (models shared); from `tree` when given."""
    data_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=base))
    _made.append(data_dir)
    return start_server(data_dir, [model], args, launcher=["env", "-C", tree] if tree else ())


def run_config(args, base: Path, dtype: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    server_args = ["--threads", str(threads), "--engine", args.engine, "--dtype", dtype]
    with ExitStack() as stack:
        servers = {"tinkerd": serve(base, "tinkerd", args.model, server_args, None)}
        stack.callback(servers["tinkerd"].stop)
        if args.baseline_tree:
            servers["baseline"] = serve(base, "baseline", args.model, server_args, args.baseline_tree)
            stack.callback(servers["baseline"].stop)
        from transformers import AutoConfig

        from tinkerd.engine.model.registry import cache_dir_for

        model_dir = cache_dir_for(args.model, base / "models")
        model_dir = str(model_dir) if model_dir.exists() else args.model
        config = AutoConfig.from_pretrained(model_dir)
        batch = make_batch(config.vocab_size, args.rows, args.tokens, group=args.group_size, prompt=args.prompt_tokens)
        sides = {"tinkerd (SDK->HTTP->engine)": TinkerdSDK(servers["tinkerd"].url, args.model, args.rank, batch, args.train_unembed)}
        if "baseline" in servers:
            sides[f"tinkerd @ {args.baseline_tree}"] = TinkerdSDK(servers["baseline"].url, args.model, args.rank, batch,
                                                                         args.train_unembed)
        if args.hf_onednn and dtype == "float32":  # bf16's F.linear is oneDNN's already
            sides["HF+PEFT, linears on oneDNN"] = HFPeft(model_dir, args.rank, batch, dtype, args.hf_adamw,
                                                         args.train_unembed, onednn=True)
        sides["HF+PEFT in-process, tuned"] = HFPeft(model_dir, args.rank, batch, dtype, args.hf_adamw, args.train_unembed)
        load_before = load_average()
        probes = [gemm_rate(args.rows * args.tokens, config.hidden_size, DTYPES[dtype])]
        for side in sides.values():  # one warm-up step each: first-step allocations, lazy inits
            side.step()
        engine0 = {k: engine_seconds(srv.url) for k, srv in servers.items()}
        run = interleave({name: side.step for name, side in sides.items()}, args.rounds, args.steps,
                         {side: srv.proc.pid for side, srv in zip(sides, servers.values())})
        engine1 = {k: engine_seconds(srv.url) for k, srv in servers.items()}
        probes.append(gemm_rate(args.rows * args.tokens, config.hidden_size, DTYPES[dtype]))
        floor = Floor(config, args.rows, args.tokens, args.rank, args.train_unembed, DTYPES[dtype]).parts()
    ceiling, cpu_ceiling = (max(p[i] for p in probes) for i in (0, 1))
    flops = step_flops(config, args.rank, args.rows, args.tokens, args.train_unembed)
    tokens = args.rows * args.tokens
    shared = f" in groups of {args.group_size} sharing {args.prompt_tokens} tokens" if args.group_size > 1 else ""
    print(f"\n== dtype={dtype} threads={threads} model={args.model} engine={args.engine} batch={args.rows}x{args.tokens}{shared} "
          f"rank={args.rank}{' +lm_head' if args.train_unembed else ''} steps/side={args.rounds * args.steps} cpus={os.cpu_count()}")
    print(f"load average before: {load_before}, after: {load_average()}; CPU used by other processes during the "
          f"run: {run.other_cpu_s:.1f} s over {run.wall_s:.1f} s wall")
    print(f"F = {flops / 1e9:.1f} GFLOP per step; ceiling ({dtype} GEMM, {threads} threads) {ceiling / 1e9:.1f} GFLOP "
          f"per second of wall time, {cpu_ceiling / 1e9:.1f} per CPU-second")
    print(f"{describe(floor)}: this step's GEMMs, attention and AdamW alone (benchmarks/step_floor.py)")
    rates, cpu_rates = {}, {}
    for name, ts in run.times.items():
        med, cpu = float(np.median(ts)), float(np.median(run.cpu[name]))
        rates[name], cpu_rates[name] = tokens / med, tokens / cpu
        q1, q3 = np.percentile(ts, [25, 75]) * 1e3  # this VM's steps move 5-10% from run to run: the spread says how much
        print(f"{name:36s} median step {med * 1e3:8.1f} ms (quartiles {q1:.0f}-{q3:.0f})  {rates[name]:8.1f} tokens/s  "
              f"{100 * flops / med / ceiling:5.1f}% of ceiling   CPU {cpu:6.2f} s/step  {cpu_rates[name]:7.1f} tokens/CPU-s  "
              f"{100 * flops / cpu / cpu_ceiling:5.1f}% of the CPU-time ceiling   {med / floor['floor']:.3f}x the floor")
    # Where each server's step goes: the engine's own time per op (its /metrics) and the rest
    # (SDK, HTTP, control, the pipe to the engine process, snapshots written inline).
    for (server, e1), name in zip(engine1.items(), run.times):
        e0 = engine0[server]
        per_op = {k: (e1[k][0] - e0.get(k, (0, 0))[0]) / max(1, e1[k][1] - e0.get(k, (0, 0))[1])
                  for k in ("ForwardBackward", "OptimStep") if k in e1}
        rest = float(np.mean(run.times[name])) - sum(per_op.values())
        print(f"{name} step, mean: " + ", ".join(f"engine {k} {v * 1e3:.0f} ms" for k, v in per_op.items())
              + f", the rest {rest * 1e3:.0f} ms")
    names = list(rates)
    pairs = [(n, names[-1]) for n in names[:-1]] + [(names[0], n) for n in names[1:-1]]  # HF's plain loop runs last
    for a, b in pairs:
        print(f"ratio {a} / {b}: {rates[a] / rates[b]:.3f} (wall), {cpu_rates[a] / cpu_rates[b]:.3f} (CPU)")
    hf = float(np.median(run.times[names[-1]]))
    print(f"a step at the floor would be {hf / floor['floor']:.3f}x {names[-1]} (wall): the most a server that runs all of it can show here")
    print(f"a step at the floor would be {100 * flops / floor['floor'] / ceiling:.1f}% of the ceiling: the most any implementation "
          f"doing this work reaches here (its small GEMMs and attention run below the ceiling's rate)")
    return {"dtype": dtype, "threads": threads, "rates": rates, "cpu_rates": cpu_rates, "floor_s": floor["floor"],
            "pct": {n: 100 * flops * r / tokens / ceiling for n, r in rates.items()},
            "cpu_pct": {n: 100 * flops * r / tokens / cpu_ceiling for n, r in cpu_rates.items()}}


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The model, data dir and batch arguments the SDK loop benchmarks share (here, dtype_ratio.py)."""
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench", help="its models/ is reused, so a model is converted once")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)


def start_run(data_dir: str) -> Path:
    """A benchmark's process set up as the engine's is: re-executed with huge pages asked for (the
    glibc tunable is read at process start), telemetry off, and `data_dir`'s models/ shared by its
    servers. Returns `data_dir`, resolved."""
    if "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", ""):
        os.execve(sys.executable, [sys.executable, *sys.argv], with_huge_pages(os.environ))
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    base = Path(data_dir).resolve()
    (base / "models").mkdir(parents=True, exist_ok=True)
    share_models((base / "models").resolve())
    return base


def main() -> None:
    ap = argparse.ArgumentParser()
    add_run_args(ap)
    ap.add_argument("--group-size", type=int, default=1,
                    help="GRPO-shaped rows: each this many consecutive rows share their first --prompt-tokens tokens")
    ap.add_argument("--prompt-tokens", type=int, default=0)
    ap.add_argument("--threads", default="1", help="comma-separated thread counts, one interleaved run each")
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=4, help="A B rounds; each side runs --steps steps per round")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--engine", choices=["process", "thread"], default="process")
    ap.add_argument("--train-unembed", action="store_true",
                    help="LoRA on the LM head too (the SDK's default; off by default here, as before)")
    ap.add_argument("--hf-adamw", choices=["foreach", "fused"], default="fused")
    ap.add_argument("--baseline-tree", default=None, help="also run a server from this checkout (e.g. /work/main)")
    ap.add_argument("--hf-onednn", action="store_true",
                    help="also run the HF + PEFT loop with F.linear's GEMMs on the engine's (engine/gemm.py: oneDNN's)")
    args = ap.parse_args()
    base = start_run(args.data_dir)
    keep_freed_memory()  # the HF side runs in this process (module docstring)
    summary = []
    for dtype in args.dtypes.split(","):
        for threads in [int(t) for t in args.threads.split(",")]:
            summary.append(run_config(args, base, dtype, threads))
    for path in _made:  # models/ stays for the next run
        shutil.rmtree(path, ignore_errors=True)
    print("\n| dtype | threads | " + " | ".join(f"{n} tok/s (% ceiling; tok/CPU-s, % CPU-time ceiling)"
                                              for n in summary[0]["rates"])
          + " | tinkerd / HF, wall | tinkerd / HF, CPU |")
    print("|---|---|" + "---|" * (len(summary[0]["rates"]) + 2))
    for s in summary:
        names = list(s["rates"])
        cells = " | ".join(f"{s['rates'][n]:.1f} ({s['pct'][n]:.0f}%; {s['cpu_rates'][n]:.1f}, {s['cpu_pct'][n]:.0f}%)"
                           for n in names)
        wall, cpu = (s[k][names[0]] / s[k][names[-1]] for k in ("rates", "cpu_rates"))
        print(f"| {s['dtype']} | {s['threads']} | {cells} | {wall:.3f} | {cpu:.3f} |")
    by = {(s["dtype"], s["threads"]): s for s in summary}
    for (dtype, threads), s in by.items():
        if dtype == "bfloat16" and ("float32", threads) in by:  # issue 20's bf16 target, and its bound here
            f32, name = by[("float32", threads)], list(s["rates"])[0]
            print(f"{threads} thread(s): {name} bf16 / fp32 {s['rates'][name] / f32['rates'][name]:.3f}x; their floors "
                  f"{f32['floor_s'] / s['floor_s']:.3f}x (two steps each at its floor)")


if __name__ == "__main__":
    main()
