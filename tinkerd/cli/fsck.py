"""`tinkerd fsck`: check that a stopped server's store and files agree (control/fsck.py), and with
`--repair` remove the debris a crash left. Exit 0 when clean, 1 when not, 2 when a server holds the
data directory. The store is the data directory's SQLite file, or the database `--db-url` names.

A running server is detected from what holds the store: on SQLite a process other than this one
with the file (or its WAL) open, found in /proc; on PostgreSQL another tinkerd process's connection
to the database, found in pg_stat_activity by its application_name (control/store/db.py). Every
`tinkerd serve` holds the store from start to stop, and so does any other tool writing to it; a
crashed one holds nothing. A check beside a live server would report its saves in progress as
debris, and a repair would delete them, so both are refused. There is no pid or lock file to go
stale: after a SIGKILL the kernel closes the descriptors, and PostgreSQL ends the dead client's
sessions, so the check can run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tinkerd.cli.flags import add_store_flags, store_config
from tinkerd.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("fsck", help="check a stopped server's data directory: store and files agree, no crash "
                                    "debris, every pending op can run; --repair removes debris")
    add_store_flags(p)
    p.add_argument("--repair", action="store_true",
                   help="remove temp directories and orphans (never a registered checkpoint), then check again")
    p.set_defaults(func=run)


def holders(paths: list[Path]) -> list[tuple[int, str]]:
    """(pid, command line) of other processes with any of `paths` open."""
    wanted = {os.path.realpath(p) for p in paths}
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
                    found.append((int(pid), cmd.strip()))
                    break
            except OSError:
                continue
    return found


def _sqlite_holders(db: Path) -> list[str]:
    if not os.path.isdir("/proc/self/fd"):
        print("tinkerd fsck: warning: no /proc here, cannot tell whether a server holds the data directory",
              file=sys.stderr)
        return []
    return [f"{db} is open in process {pid} ({cmd[:120]})" for pid, cmd in holders([db, db.with_name(db.name + "-wal")])]


def parse_body(row) -> None:
    """Decode a pending pre-op-log row's wire request the way the start-up conversion will (api/legacy.py):
    protobuf for forward(_backward), the SDK's pydantic request otherwise."""
    from tinker import types as t

    from tinkerd.api import codec
    from tinkerd.api.deps import parse

    requests = {"CreateModel": t.CreateModelRequest, "OptimStep": t.OptimStepRequest,
                "SaveWeights": t.SaveWeightsRequest, "SaveWeightsForSampler": t.SaveWeightsForSamplerRequest,
                "LoadWeights": t.LoadWeightsRequest, "Sample": t.SampleRequest,
                "SaveWeightsExternal": t.SaveWeightsExternalRequest}
    if row.request_type in ("ForwardBackward", "Forward"):
        codec.decode_forward_backward(row.body)
    elif row.request_type in requests:
        parse(requests[row.request_type], row.body)
    else:
        raise UserError(f"{row.request_type} requests cannot be resumed after a restart")


def run(args) -> int:
    from tinkerd.control.fsck import Fsck
    from tinkerd.control.store.db import Store

    config = store_config(args)
    if config.db_url is None:
        db = config.db_path
        if not db.exists():
            raise UserError(f"no tinkerd data in {config.data_dir} (pass --data-dir)")
        held = _sqlite_holders(db)
        store = None if held else Store.sqlite(db)
    else:
        if not config.data_dir.is_dir():
            raise UserError(f"no tinkerd data directory at {config.data_dir} (pass --data-dir)")
        store = Store(config.db_url)
        held = store.holders()
    if held:
        for line in held:
            print(f"tinkerd fsck: {line}", file=sys.stderr)
        print("tinkerd fsck: a server holds this data directory; stop it first (a check beside it would "
              "take its saves in progress for debris)", file=sys.stderr)
        return 2
    fsck = Fsck(store, config.data_dir, parse_body=parse_body)
    report = fsck.check()
    if args.repair and report.problems:
        for p in report.problems:
            print(p.line())
        for line in fsck.repair(report):
            print(f"repair: {line}")
        report = fsck.check()
        print("after repair:")
    for p in report.problems:
        print(p.line())
    what = (f"{report.checkpoints} checkpoints, {report.runs} runs, {report.snapshots} snapshots, "
            f"{report.pending} pending ops")
    if report.clean:
        print(f"tinkerd fsck: {config.data_dir}: clean ({what})")
        return 0
    debris = sum(p.debris for p in report.problems)
    print(f"tinkerd fsck: {config.data_dir}: {len(report.problems)} problems, {debris} of them debris that --repair "
          f"removes ({what})")
    return 1
