"""Memory with many tenants: the engine's peak RSS with 1 adapter vs 8 on one base model.

One copy of the base weights serves every adapter; each adapter adds only its LoRA tensors, their
AdamW state and gradients. Each client creates a rank-32 LoRA and runs one forward_backward +
optim_step so its optimizer state exists.

The figure to hold against the target: peak RSS per extra resident adapter, (peak with N - peak
with 1) / (N - 1), against the budget of LoRA weights + grads + AdamW's two moments, 4x the
adapter's fp32 weights (the size of its snapshot's adapter_model.safetensors), plus 10%.

    python benchmarks/multitenancy.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from tests.chaos import engine_pid  # noqa: E402
from tests.serverproc import API_KEY, start_server  # noqa: E402


def rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--data-dir", default="/tmp/tinkerd-bench")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    srv = start_server(Path(args.data_dir), [args.model], ["--threads", str(args.threads)])
    try:
        pid = engine_pid(srv.proc.pid)
        sc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 129))),
                            loss_fn_inputs={"target_tokens": list(range(2, 130))})
        base_rss, _ = rss_mb(pid)
        print(f"model={args.model} rank={args.rank} threads={args.threads}")
        print(f"engine RSS with the base model loaded, no adapter: {base_rss:.0f} MB")
        for n in range(1, args.adapters + 1):
            tc = sc.create_lora_training_client(base_model=args.model, rank=args.rank, seed=n).result()
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            if n in (1, args.adapters):
                rss, peak = rss_mb(pid)
                print(f"{n} adapter(s): RSS {rss:.0f} MB, peak {peak:.0f} MB")
                peak_one = peak if n == 1 else peak_one
        print(f"(one copy of the base weights: {args.adapters} adapters cost {rss - base_rss:.0f} MB over the base)")
        weights = max((srv.data_dir / "snapshots").glob("*/seq-*/adapter_model.safetensors"))  # any run: same shapes
        budget = 4 * weights.stat().st_size / 2**20
        per = (peak - peak_one) / (args.adapters - 1)
        print(f"peak RSS per extra resident adapter: {per:.0f} MB; budget (weights + grads + 2 AdamW moments) "
              f"{budget:.0f} MB, +10% {1.1 * budget:.0f} MB: {'within' if per <= 1.1 * budget else 'OVER'}")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
