"""GRPO-shaped sampling through the SDK: groups of samples of a few prompts, before vs after.

The shape of one GRPO batch: 4 prompts of 256 tokens, 8 samples each (32 rows), 64 new tokens,
temperature 1. Two ways of sending it, both through the official SDK against `tinkerd serve`:

  cookbook     32 concurrent `sample(prompt, num_samples=1)` calls, 8 per prompt: what
               tinker_cookbook's RL loop sends (rl/rollouts.do_group_rollout runs one
               TinkerTokenCompleter call per env of the group, each num_samples=1)
  num_samples  4 concurrent `sample(prompt, num_samples=8)` calls

Each side is a server started from a checkout: this tree, and with `--baseline-tree DIR` (main,
say) the same server from there. Sides and cases run interleaved (A B A B) in one invocation, so
machine noise hits both alike. Reported per (side, case): median wall tokens/s, generated tokens
per CPU-second of this process and the server trees (engine included; the machine is shared, and
CPU time is less skewed by neighbours than wall time), the load average, and the ratio after/before.

    python benchmarks/grpo_sampling.py --baseline-tree /work/main --threads 1 --rounds 3
    python benchmarks/grpo_sampling.py --server-args="--dtype bfloat16" ...   # a bf16 server on both sides
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.training import _made, interleave, load_average, serve, start_run  # noqa: E402
from tests.serverproc import API_KEY  # noqa: E402


class Side:
    """One server's sampling client and the GRPO batch's two ways of sending it."""

    def __init__(self, url: str, model: str, prompts: int, prompt_tokens: int, group: int, new_tokens: int):
        import tinker
        from tinker import types

        client = tinker.ServiceClient(base_url=url, api_key=API_KEY).create_sampling_client(base_model=model)
        self.client = client.result() if hasattr(client, "result") else client
        self.shape = (prompts, prompt_tokens)
        self.group = group
        self.types = types
        self.new_tokens = new_tokens
        self.calls = 0  # fresh prompts and seeds per batch, the same sequence on every side

    def batch(self) -> list:
        """This call's prompts: new ones each batch, as an RL loop's next batch has (a server that
        kept the last batch's prefills must not be credited with them); random ids from the lower
        vocabulary (ordinary text tokens), the same on every side."""
        self.calls += 1
        ids = np.random.default_rng(self.calls).integers(100, 20000, size=self.shape)
        return [self.types.ModelInput.from_ints(p.tolist()) for p in ids]

    def params(self, seed: int):
        # stop=[] and no EOS stop would need a server flag; with a seed both sides generate the
        # same completions, so EOS ends the same rows early on both.
        return self.types.SamplingParams(max_tokens=self.new_tokens, temperature=1.0, stop=[], seed=seed)

    def cookbook(self) -> int:
        prompts = self.batch()
        futures = [self.client.sample(p, 1, self.params(self.calls * 1000 + i * self.group + j))
                   for i, p in enumerate(prompts) for j in range(self.group)]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    def num_samples(self) -> int:
        prompts = self.batch()
        futures = [self.client.sample(p, self.group, self.params(self.calls * 1000 + i)) for i, p in enumerate(prompts)]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cases", default="cookbook,num_samples")
    ap.add_argument("--baseline-tree", default=None, help="also run a server from this checkout (e.g. /work/main)")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench", help="its models/ is reused, so a model is converted once")
    ap.add_argument("--server-args", default="", help="extra `tinkerd serve` arguments for both sides, e.g. '--dtype bfloat16'")
    args = ap.parse_args()
    base = start_run(args.data_dir)
    server_args = ["--threads", str(args.threads), *shlex.split(args.server_args)]
    try:
        with ExitStack() as stack:
            trees = {"after": None} | ({"before": args.baseline_tree} if args.baseline_tree else {})
            with ThreadPoolExecutor(len(trees)) as pool:  # the servers load their models side by side
                started = {k: pool.submit(serve, base, k, args.model, server_args, t) for k, t in trees.items()}
                servers = {k: f.result() for k, f in started.items()}
            for s in servers.values():
                stack.callback(s.stop)
            sides = {k: Side(s.url, args.model, args.prompts, args.prompt_tokens, args.group, args.new_tokens) for k, s in servers.items()}
            runs = {}
            for case in args.cases.split(","):
                for k in ("before", "after"):
                    if k in sides:
                        runs[f"{k} {case}"] = getattr(sides[k], case)
            for fn in runs.values():  # warm-up: packing, allocator, first-call paths
                fn()
            load0 = load_average()
            # Each run is charged its own server's CPU (interleave waits for it to go quiet).
            run = interleave(runs, args.rounds, 1, {name: servers[name.split()[0]].proc.pid for name in runs})
            load1 = load_average()
    finally:
        for path in _made:  # models/ stays for the next run
            shutil.rmtree(path, ignore_errors=True)
    print(f"model {args.model}, threads {args.threads}, server args {args.server_args!r}, {args.prompts} prompts x {args.prompt_tokens} tokens, "
          f"{args.group} samples each, {args.new_tokens} new tokens, {args.rounds} rounds; load average "
          f"{load0} before, {load1} after; other processes used {run.other_cpu_s:.0f} CPU-s in {run.wall_s:.0f} s")
    rates = {}
    for name in runs:
        tokens = np.array(run.results[name], dtype=float)
        wall, cpu = tokens / np.array(run.times[name]), tokens / np.array(run.cpu[name])
        rates[name] = (float(np.median(wall)), float(np.median(cpu)))
        print(f"  {name:22s} {rates[name][0]:7.1f} tok/s wall  {rates[name][1]:7.1f} tok/CPU-s  "
              f"(tokens {int(tokens.mean())}, walls {', '.join(f'{t:.1f}' for t in run.times[name])} s)")
    for case in args.cases.split(","):
        if f"before {case}" in rates:
            (wb, cb), (wa, ca) = rates[f"before {case}"], rates[f"after {case}"]
            print(f"{case}: after/before {wa / wb:.2f}x wall, {ca / cb:.2f}x per CPU-second")
    if "before num_samples" in rates and "after cookbook" in rates:
        print(f"after cookbook / before num_samples: {rates['after cookbook'][0] / rates['before num_samples'][0]:.2f}x wall")


if __name__ == "__main__":
    main()
