"""Checkpoint REST the hpcai client calls: a checkpoint as one tar.gz in the response body, and
checkpoint URLs with a bare name (hpcai drops the type segment).

A bare name can be both a training and a sampler checkpoint of one run (the cookbook's
`save_checkpoint(kind="both")` saves `final` so). The rule: an archive of a bare name is the
sampler copy when there is one (the weights to deploy), else the training one; the training copy
stays reachable as `weights/<name>/archive`. A delete of a bare name that is both is refused, naming
the two typed ids, rather than deleting two checkpoints on one ambiguous request.

Archives are the caller's own checkpoints only (a published one is loadable by path, not
downloadable by others), capped at `max_archive_bytes` before a byte is sent, and each download is
recorded in the audit log with its size, as the signed-URL export downloads are per file.
"""

from __future__ import annotations

import queue
import tarfile
import threading
import time
from typing import Iterator

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from tinkerd.api.deps import account, authenticate, empty, state
from tinkerd.artifacts import ArtifactStore
from tinkerd.control.ids import SEGMENT_TYPES, TinkerPath, check_name
from tinkerd.control.runs import Runs
from tinkerd.control.records import Checkpoint
from tinkerd.errors import ArchiveTooLarge, NotFoundError, UserError

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])

# Sampler first: a bare name's archive is its sampler copy when it has both (module docstring).
_BARE_ORDER = ("sampler_weights", "weights")
_CHUNKS_QUEUED = 64  # the tar writer runs at most 64 gzip writes (~640 KiB) ahead of the client
_PUT_WAIT_S = 1.0


def _owned(runs: Runs, path: TinkerPath, account_id: str) -> Checkpoint | None:
    try:
        return runs.checkpoints.owned_checkpoint(path, account_id)
    except NotFoundError:
        return None


def _bare(runs: Runs, run_id: str, name: str, account_id: str) -> list[Checkpoint]:
    """The caller's checkpoints named `name` in run `run_id`, sampler copy first; 404 when none."""
    runs.training_runs.owned_run(run_id, account_id)
    rows = [r for seg in _BARE_ORDER if (r := _owned(runs, TinkerPath(run_id, seg, check_name(name)), account_id))]
    if not rows:
        raise NotFoundError(f"run {run_id} has no checkpoint named {name!r}")
    return rows


def _archive(request: Request, row: Checkpoint) -> Response:
    st = state(request)
    key = st.runs.checkpoints.key_of(row)
    files = st.runs.artifacts.files(key)
    size = sum(files.values())
    if size > st.config.max_archive_bytes:
        raise ArchiveTooLarge(f"{row.tinker_path} holds {size} bytes, over this server's archive limit of "
                              f"{st.config.max_archive_bytes} (max_archive_bytes)")
    st.runs.audit.record("checkpoint_archive_downloaded", account(request), tinker_path=row.tinker_path,
                         size_bytes=size)
    name = f"{row.name}.tar.gz"
    return StreamingResponse(_tar_gz(st.runs.artifacts, key, files, row.name), media_type="application/gzip",
                             headers={"Content-Disposition": f'attachment; filename="{name}"'})


def _tar_gz(artifacts: ArtifactStore, key: str, files: dict[str, int], arcname: str) -> Iterator[bytes]:
    """The artifact's files (name -> size) as a tar.gz of the directory `arcname`, streamed from the
    store (tinkerd/artifacts.py): a thread writes the archive into a bounded queue that the
    response reads, so a checkpoint of any size takes ~640 KiB of memory, never its size. A client
    that goes away stops the writer at its next write."""
    chunks: queue.Queue = queue.Queue(maxsize=_CHUNKS_QUEUED)
    gone = threading.Event()

    def put(item) -> None:
        while not gone.is_set():
            try:
                chunks.put(item, timeout=_PUT_WAIT_S)
                return
            except queue.Full:
                continue
        raise BrokenPipeError("the client stopped reading the archive")

    class Pipe:
        def write(self, data: bytes) -> int:
            put(bytes(data))
            return len(data)

    def write() -> None:
        try:
            now = int(time.time())
            with tarfile.open(fileobj=Pipe(), mode="w|gz") as tar:
                folder = tarfile.TarInfo(arcname)
                folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, now
                tar.addfile(folder)
                for name, size in files.items():
                    info = tarfile.TarInfo(f"{arcname}/{name}")
                    info.size, info.mode, info.mtime = size, 0o644, now
                    with artifacts.open(key, name) as f:
                        tar.addfile(info, f)
            put(None)
        except BrokenPipeError:
            pass  # nobody is reading any more
        except Exception as e:  # handed to the reader, which raises it in the response
            try:
                put(e)
            except BrokenPipeError:
                pass

    threading.Thread(target=write, name="tinkerd-archive", daemon=True).start()
    try:
        while (chunk := chunks.get()) is not None:
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk
    finally:
        gone.set()


@router.get("/training_runs/{run_id}/checkpoints/{name}/archive")
def archive_bare(run_id: str, name: str, request: Request) -> Response:
    return _archive(request, _bare(state(request).runs, run_id, name, account(request))[0])


@router.get("/training_runs/{run_id}/checkpoints/{type_seg}/{name}/archive")
def archive_typed(run_id: str, type_seg: str, name: str, request: Request) -> Response:
    if type_seg not in SEGMENT_TYPES:
        raise NotFoundError(f"no checkpoint type {type_seg!r}: use weights, sampler_weights or a bare name")
    row = state(request).runs.checkpoints.owned_checkpoint(TinkerPath(run_id, type_seg, check_name(name)), account(request))
    return _archive(request, row)


@router.delete("/training_runs/{run_id}/checkpoints/{name}")
def delete_bare(run_id: str, name: str, request: Request) -> Response:
    runs = state(request).runs
    rows = _bare(runs, run_id, name, account(request))
    if len(rows) > 1:
        raise UserError(f"run {run_id} has both a training and a sampler checkpoint named {name!r}; delete "
                        f"weights/{name} or sampler_weights/{name}")
    runs.checkpoints.delete_checkpoint(TinkerPath(run_id, _segment(rows[0]), rows[0].name), account(request))
    return empty()


def _segment(row: Checkpoint) -> str:
    return next(seg for seg, kind in SEGMENT_TYPES.items() if kind == row.checkpoint_type)
