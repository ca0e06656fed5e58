"""Training throughput: the official SDK through tinkerd vs an in-process HF + PEFT loop.

Both sides train the same model with the same LoRA (rank, layers), batch and thread count, with
AdamW, interleaved A B A B so machine noise hits both alike. Prints tokens/s of each and the ratio
last. The tinkerd side is the whole path a user pays for: SDK -> HTTP -> control -> engine.

    python benchmarks/training.py                   # SmolLM2-135M, 2 x 256 tokens, 1 thread
    python benchmarks/training.py --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.serverproc import API_KEY, start_server  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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


@dataclass
class Interleaved:
    """An A B A B run: each side's step times and step results, and the CPU that other processes
    used meanwhile (the machine is shared, so absolute times are inflated by that much)."""

    times: dict[str, list[float]]
    results: dict[str, list]
    other_cpu_s: float
    wall_s: float

    def print_rates(self, tokens: int, width: int) -> dict[str, float]:
        """Prints each side's median step and tokens/s; returns the tokens/s."""
        rates = {}
        for name, ts in self.times.items():
            med = float(np.median(ts))
            rates[name] = tokens / med
            print(f"{name:{width}s} median step {med * 1e3:8.1f} ms   {rates[name]:8.1f} tokens/s")
        return rates


def interleave(sides: dict[str, Callable[[], object]], rounds: int, steps: int, server_pid: int) -> Interleaved:
    """One warm-up step of each side (first-step allocations, lazy inits), then `rounds` rounds in
    which each side runs `steps` steps in turn, so machine noise hits both alike."""
    for step in sides.values():
        step()
    times: dict[str, list[float]] = {k: [] for k in sides}
    results: dict[str, list] = {k: [] for k in sides}
    busy0, total0 = cpu_jiffies()
    own0 = proc_jiffies(os.getpid()) + tree_jiffies(server_pid)
    for _ in range(rounds):
        for name, step in sides.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                results[name].append(step())
                times[name].append(time.perf_counter() - t0)
    busy1, total1 = cpu_jiffies()
    own1 = proc_jiffies(os.getpid()) + tree_jiffies(server_pid)
    wall_s = (total1 - total0) / os.cpu_count() / os.sysconf("SC_CLK_TCK")
    other_cpu_s = max(0, (busy1 - busy0) - (own1 - own0)) / os.sysconf("SC_CLK_TCK")
    return Interleaved(times, results, other_cpu_s, wall_s)


def make_batch(vocab: int, rows: int, tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(rows, tokens + 1))


class HFPeft:
    def __init__(self, model_dir: str, rank: int, batch: np.ndarray):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.input_ids = torch.from_numpy(batch[:, :-1]).long()
        self.labels = torch.from_numpy(batch[:, 1:]).long()

    def step(self) -> float:
        logits = self.model(input_ids=self.input_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.labels.flatten(), reduction="sum")
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


class TinkerdSDK:
    def __init__(self, url: str, model: str, rank: int, batch: np.ndarray):
        import tinker
        from tinker import types

        self.types = types
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        self.tc = sc.create_lora_training_client(base_model=model, rank=rank, train_unembed=False, seed=0).result()
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench", help="reused, so the model is converted once")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4, help="A B rounds; each side runs --steps steps per round")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--engine", choices=["process", "thread"], default="process")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    server = start_server(Path(args.data_dir), [args.model], ["--threads", str(args.threads), "--engine", args.engine])
    try:
        from tinkerd.engine.model.registry import cache_dir_for

        model_dir = cache_dir_for(args.model, Path(args.data_dir) / "models")
        model_dir = str(model_dir) if model_dir.exists() else args.model
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        batch = make_batch(vocab, args.rows, args.tokens)
        sides = {"tinkerd (SDK->HTTP->engine)": TinkerdSDK(server.url, args.model, args.rank, batch),
                 "HF+PEFT in-process": HFPeft(model_dir, args.rank, batch)}
        run = interleave({name: side.step for name, side in sides.items()}, args.rounds, args.steps, server.proc.pid)
    finally:
        server.stop()

    print(f"model={args.model} engine={args.engine} batch={args.rows}x{args.tokens} rank={args.rank} threads={args.threads} "
          f"steps/side={args.rounds * args.steps} cpus={os.cpu_count()}")
    print(f"CPU used by other processes during the run: {run.other_cpu_s:.1f} s over {run.wall_s:.1f} s wall")
    a, b = run.print_rates(args.rows * args.tokens, 32).values()
    print(f"ratio tinkerd / HF+PEFT: {a / b:.3f}")


if __name__ == "__main__":
    main()
