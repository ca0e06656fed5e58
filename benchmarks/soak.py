"""Soak (issue 16): one SDK client for many steps against a real `tinkerd serve`; does what the
server holds stay bounded?

The loop: forward_backward + optim_step every step; every `--sample-every` steps a
save_weights_and_get_sampling_client and a sample from it (as an RL loop does: ephemeral samplers,
the session keeps its newest few); every `--save-every` steps a save_state with `--ttl-s`. The
server runs with futures retention on (results deleted `--grace-s` after they were retrieved,
tombstones forgotten `--tombstone-s` later) and the checkpoint sweeper every 10 s, on timescales
short enough that a run of a few hundred steps reaches its steady state; the defaults of a real
server (600 s, 24 h, 24 h) make the same curves over hours.

Every `--every` steps, and at least every `--every-s` seconds, it samples: the RSS of the server
and of its engine process, the data directory's size (without the converted models), and the row
count of every store table. At the end it prints the table over time and a verdict per quantity on
windows of wall time `--windows-of` retention periods long (benchmarks/soak_verdict.py says why
wall time, not steps); the retention period is the longest time anything lives before a sweep
(checkpoint TTL + sweep interval, grace + tombstone, the futures' max age):
- RSS flat: the later half's peak within `--rss-tolerance` (10%) of the earlier half's, and the
  peaks' trend under `--rss-growth-per-hour` (5%);
- data dir and rows bounded: the later half's peak within `--tolerance` (25%, plus a small absolute
  slack) of the earlier half's. Ledger tables grow by design, one row per op or per checkpoint:
  usage (billing), checkpoint_storage (GB-hour billing), audit_log, step_metrics (the console's
  curves); their growth per step is printed instead.
Exit 1 if anything meant to be bounded is not, or the loop saw an error. `--json F` keeps the
samples; `--report F` judges kept samples again without running.

With `--step-interval-s S` each step starts S seconds after the one before (or at once when late),
so the step rate is the same in every window however the machine's load moves; the verdict is
given only when the windows' rates are within `--max-rate-ratio` (1.5x) of each other, since what
the server holds scales with the rate (soak_verdict.py).

    python benchmarks/soak.py --step-interval-s 1.5  # 2000 steps at a steady rate, ~50 min
    python benchmarks/soak.py --steps 300 --every 20 --ttl-s 30 --grace-s 10 --tombstone-s 10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from benchmarks.soak_verdict import judge, steady_rate  # noqa: E402
from tests.chaos import TINY, engine_pid  # noqa: E402
from tests.serverproc import API_KEY, start_server  # noqa: E402

# Tables that grow by design, one row per op or per checkpoint: billing, GB-hour billing, the audit
# trail, and step_metrics, each run's metric history that the console draws (one small row per
# training op; a page sends only the newest 2,000 points of it).
LEDGERS = ("usage", "checkpoint_storage", "audit_log", "step_metrics")
MIB = 2**20
SWEEP_INTERVAL_S = 10.0  # the server's --checkpoint-sweep-interval-s here


@dataclass
class Sample:
    step: int
    elapsed_s: float
    server_rss: int
    engine_rss: int
    data_bytes: int
    rows: dict[str, int] = field(default_factory=dict)
    # Private (anonymous) resident memory: what a leak grows. VmRSS also counts file pages (shared
    # libraries, mmapped weights) that the kernel drops and reads back with the machine's memory
    # pressure: in one soak the engine's VmRSS moved 903.0 -> 884.0 MiB while RssAnon stayed 695.0.
    server_anon: int = 0
    engine_anon: int = 0


def rss(pid: int | None, key: str = "VmRSS") -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, TypeError):
        pass
    return 0


def dir_bytes(root: Path, skip: str = "models") -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root and skip in dirnames:
            dirnames.remove(skip)
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512  # allocated, as df sees it
            except FileNotFoundError:  # deleted meanwhile (a swept checkpoint)
                pass
    return total


def row_counts(db_path: Path) -> dict[str, int]:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: db.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in sorted(tables)}
    finally:
        db.close()


def soak(args) -> int:
    root = Path(args.data_dir or tempfile.mkdtemp(prefix="tinkerd-soak-"))
    server_args = ["--threads", str(args.threads), "--checkpoint-sweep-interval-s", f"{SWEEP_INTERVAL_S:g}",
                   "--future-retrieved-grace-s", str(args.grace_s), "--future-tombstone-s", str(args.tombstone_s),
                   "--future-max-age-s", str(max_age_s(args))]
    srv = start_server(root, [TINY], server_args)
    rng = random.Random(args.seed)
    samples: list[Sample] = []
    errors: list[str] = []
    try:
        sc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=args.seed).result()
        t0 = time.monotonic()

        def record(step: int) -> None:
            engine = engine_pid(srv.proc.pid)
            samples.append(Sample(step, time.monotonic() - t0, rss(srv.proc.pid), rss(engine), dir_bytes(root),
                                  row_counts(root / "tinkerd.sqlite"), rss(srv.proc.pid, "RssAnon"), rss(engine, "RssAnon")))
            s = samples[-1]
            print(f"  step {step:5d}  {s.elapsed_s:7.1f} s  rss server {s.server_rss / MIB:6.1f} MiB engine "
                  f"{s.engine_rss / MIB:6.1f} MiB (anon {s.engine_anon / MIB:6.1f})  data {s.data_bytes / MIB:6.1f} MiB  "
                  f"futures {s.rows.get('futures', 0)}",
                  flush=True)
            keep(args, samples, errors, os.getloadavg())

        record(0)
        started = time.monotonic() - args.step_interval_s
        for step in range(1, args.steps + 1):
            # S after the last step's start, never catching up on a late one: a catch-up burst would
            # raise the rate the verdict needs steady.
            time.sleep(max(0.0, started + args.step_interval_s - time.monotonic()))
            started = time.monotonic()
            toks = [[rng.randrange(1, 5000) for _ in range(rng.randrange(12, 40))] for _ in range(2)]
            data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]), loss_fn_inputs={"target_tokens": t[1:]})
                    for t in toks]
            try:
                fb = tc.forward_backward(data, "cross_entropy")
                optim = tc.optim_step(types.AdamParams(learning_rate=1e-3))
                loss = fb.result().metrics["loss:sum"]
                optim.result()
                if loss != loss:
                    errors.append(f"step {step}: loss is NaN")
                if step % args.sample_every == 0:
                    sampler = tc.save_weights_and_get_sampling_client().result()
                    sampler.sample(types.ModelInput.from_ints(toks[0][:8]), 1,
                                   types.SamplingParams(max_tokens=8, temperature=1.0, seed=step)).result()
                if step % args.save_every == 0:
                    tc.save_state(f"step-{step:06d}", ttl_seconds=args.ttl_s).result()
            except Exception as e:  # noqa: BLE001  a soak reports every error, then goes on
                errors.append(f"step {step}: {type(e).__name__}: {e}")
            if step % args.every == 0 or step == args.steps or time.monotonic() - t0 - samples[-1].elapsed_s >= args.every_s:
                record(step)
    finally:
        load = os.getloadavg()
        srv.stop()
    keep(args, samples, errors, load)
    return report(samples, errors, args, load)


def keep(args, samples: list[Sample], errors: list[str], load: tuple[float, ...]) -> None:
    """Rewritten at every sample, so an unfinished soak can be judged too (`--report`)."""
    if args.json:
        kept = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))}
        args.json.write_text(json.dumps({"samples": [dataclasses.asdict(x) for x in samples], "errors": errors,
                                         "load": load, "args": kept}))


def max_age_s(args) -> float:
    return max(args.grace_s, 60.0)


def retention_period_s(args) -> float:
    """The longest anything lives before a sweep removes it: a checkpoint (TTL, then up to one sweep
    interval), a retrieved future (grace, then its tombstone), an unretrieved one (max age)."""
    return max(args.ttl_s + SWEEP_INTERVAL_S, args.grace_s + args.tombstone_s, max_age_s(args))


def report(samples: list[Sample], errors: list[str], args, load: tuple[float, float, float]) -> int:
    steps = samples[-1].step
    wall = samples[-1].elapsed_s
    print(f"\nsoak: {steps} steps in {wall:.0f} s ({wall / steps * 1000:.0f} ms a step, with a sample every "
          f"{args.sample_every} and a save_state every {args.save_every}), threads={args.threads}, "
          f"load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} on {os.cpu_count()} CPUs; retention grace "
          f"{args.grace_s:g} s, tombstones {args.tombstone_s:g} s, checkpoint TTL {args.ttl_s} s")
    tables = sorted({t for s in samples for t in s.rows})
    head = (f"{'step':>6} {'s':>6} {'srv MiB':>8} {'eng MiB':>8} {'eng anon':>8} {'data MiB':>9} "
            + " ".join(f"{t[:12]:>12}" for t in tables))
    print(head)
    stride = -(-len(samples) // 40)  # at most ~40 rows; --json keeps them all
    for s in samples[::stride] + ([samples[-1]] if (len(samples) - 1) % stride else []):
        print(f"{s.step:6d} {s.elapsed_s:6.0f} {s.server_rss / MIB:8.1f} {s.engine_rss / MIB:8.1f} {s.engine_anon / MIB:8.1f} "
              f"{s.data_bytes / MIB:9.1f} " + " ".join(f"{s.rows.get(t, 0):12d}" for t in tables))
    ok, judged = not errors, []
    window_s = args.windows_of * retention_period_s(args)
    times = [s.elapsed_s for s in samples]
    print(f"\nwindows of {window_s:.0f} s ({args.windows_of:g} retention periods of {retention_period_s(args):.0f} s); "
          f"the first is warm-up")
    steady, rates = steady_rate(times, [s.step for s in samples], window_s, args.max_rate_ratio)
    print("steps/s per window: " + " ".join("-" if r is None else f"{r:.2f}" for r in rates)
          + ("" if steady else f"  NOT steady (over {args.max_rate_ratio:g}x): no verdict on what is held"))
    anon = all(s.engine_anon for s in samples)  # samples kept before RssAnon was recorded have none
    for name, values, judged_on in (
            ("server RSS", [s.server_rss for s in samples], not anon),
            ("engine RSS", [s.engine_rss for s in samples], not anon),
            ("server anon RSS", [s.server_anon for s in samples], anon),
            ("engine anon RSS", [s.engine_anon for s in samples], anon)):
        if not any(values):
            continue
        v = judge(times, values, window_s, args.rss_tolerance, 0, args.rss_growth_per_hour)
        if judged_on:
            ok &= bool(v.bounded)
            judged.append(v)
        print(f"{name}: {v.describe(' MiB', MIB).replace('bounded', 'flat', 1)}{'' if judged_on else ' (not judged)'}")
    v = judge(times, [s.data_bytes for s in samples], window_s, args.tolerance, 2 * MIB)
    ok &= bool(v.bounded)
    judged.append(v)
    print(f"data dir: {v.describe(' MiB', MIB)}")
    for t in tables:
        values = [s.rows.get(t, 0) for s in samples]
        if t in LEDGERS:
            per_step = (values[-1] - values[1]) / max(1, samples[-1].step - samples[1].step)
            print(f"rows {t}: a ledger, grows by design: {values[-1]} rows, {per_step:.2f} per step")
            continue
        v = judge(times, values, window_s, args.tolerance, 4)
        ok &= bool(v.bounded)
        judged.append(v)
        print(f"rows {t}: {v.describe()}")
    print(f"errors: {len(errors)}")
    for e in errors[:20]:
        print(f"  {e}")
    if any(v.bounded is None for v in judged):
        print("verdict: none yet, the run is too short or too sparse for its windows (see above)")
    elif not steady:
        print("verdict: none, the step rate was not steady (see above); pace it with --step-interval-s")
        return 1
    else:
        print("verdict: " + ("bounded" if ok else "NOT bounded (see above)"))
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument("--every", type=int, default=100, help="steps between measurements")
    p.add_argument("--every-s", type=float, default=30.0, help="and at most this many seconds between them")
    p.add_argument("--ttl-s", type=int, default=60, help="ttl_seconds of each save_state")
    p.add_argument("--grace-s", type=float, default=15.0, help="--future-retrieved-grace-s of the server")
    p.add_argument("--tombstone-s", type=float, default=15.0, help="--future-tombstone-s of the server")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--step-interval-s", type=float, default=0.0, help="start a step every S seconds (0: at once)")
    p.add_argument("--max-rate-ratio", type=float, default=1.5, help="windows' step rates must agree within this")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--rss-growth-per-hour", type=float, default=0.05, help="RSS trend allowed (0.05: +5%% an hour)")
    p.add_argument("--windows-of", type=float, default=3.0, help="verdict windows, in retention periods")
    p.add_argument("--json", type=Path, default=None, help="write the samples here")
    p.add_argument("--report", type=Path, default=None, help="judge the samples of an earlier --json, do not run")
    p.add_argument("--data-dir", type=Path, default=None, help="default: a new temp dir")
    args = p.parse_args()
    if args.report:
        kept = json.loads(args.report.read_text())
        for k, v in kept["args"].items():
            if k not in ("report", "json", "max_rate_ratio", "tolerance", "rss_tolerance", "rss_growth_per_hour", "windows_of"):
                setattr(args, k, v)
        return report([Sample(**x) for x in kept["samples"]], kept["errors"], args, tuple(kept["load"]))
    return soak(args)


if __name__ == "__main__":
    sys.exit(main())
