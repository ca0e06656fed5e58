"""The ArtifactStore: where checkpoints, recovery snapshots and exports live, named by key.

An artifact is a small set of named files (a PEFT adapter directory: weights, config, tinkerd.json,
optimizer state) under a key such as `checkpoints/<model_id>/weights/<name>` or
`snapshots/<model_id>/seq-000000000042`. Ops carry keys, never paths (docs/op-contract.md): the
engine writes and reads artifacts through its store, control lists and deletes them through its
own, and the two meet only at the store, so an engine on another machine needs the store, not the
server's disk.

The interface is shaped so that an object store fits: keys are `/`-separated segments (S3-like), a
`put` makes the whole artifact visible at once or not at all (an object store does that by writing
its files, then a manifest last, and listing only artifacts with a manifest), reads stream, a
listing is by prefix, and nothing depends on renaming beyond what the local store does inside
`put` for its own atomicity. `LocalArtifactStore` is the default: a directory tree (the data
directory), each artifact a directory written into `.<name>.tmp-*` and renamed into place; an
existing one is first renamed aside to `.<name>.old-*/ckpt`. A process killed mid-write leaves
only such temp dirs, which `sweep_incomplete` removes (docs/architecture.md).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Mapping, Protocol

from tinkerd.errors import NotFoundError, ServerError, UserError

log = logging.getLogger(__name__)

# A key segment: what a checkpoint name, a model_id or a seq-<n> may be on every store ("." and ".."
# excepted).
_SEGMENT = re.compile(r"[A-Za-z0-9_.:@+=,-]+")
# Reads stream in chunks of this size (an archive download of a ~120 MB rank-32 state holds one).
CHUNK = 1 << 20


def check_key(key: str) -> str:
    """`key` if it is `/`-separated segments of safe characters, else UserError naming it."""
    if not isinstance(key, str) or not key or any(not _SEGMENT.fullmatch(s) or s in (".", "..")
                                                  for s in key.split("/")):
        raise UserError(f"invalid artifact key {key!r}")
    return key


def join(*parts: str) -> str:
    return "/".join(parts)


class ArtifactStore(Protocol):
    """Artifacts by key (see the module docstring). Every method is safe to call from any thread."""

    def put(self, key: str, files: Mapping[str, bytes | Iterable[bytes]]) -> int:
        """Write `files` (name -> bytes, or chunks) as the artifact `key`, replacing what is there,
        visible whole or not at all; returns the bytes written. A failed write raises ServerError
        and leaves `key` as it was."""

    def copy(self, src: str, dst: str) -> int:
        """`put(dst, <every file of src>)`, streamed; NotFoundError when `src` is absent."""

    def exists(self, key: str) -> bool: ...

    def version(self, key: str) -> str | None:
        """A token that changes whenever `key` is put again (None: absent): readers cache by it."""

    def modified(self, key: str) -> float | None:
        """When `key` was last put (epoch seconds; None: absent)."""

    def names(self, key: str) -> list[str]:
        """The files of artifact `key`, sorted; NotFoundError when absent."""

    def files(self, key: str) -> dict[str, int]:
        """The files of artifact `key` with their sizes in bytes, by name; NotFoundError when absent."""

    def open(self, key: str, name: str) -> BinaryIO:
        """One file of `key`, for streaming reads; NotFoundError when absent."""

    def read(self, key: str, name: str) -> bytes: ...

    def size(self, key: str) -> int:
        """Bytes of every artifact at or under `key` (0 when none)."""

    def list(self, prefix: str) -> list[str]:
        """Keys of the whole artifacts and folders directly under `prefix`, sorted."""

    def delete(self, key: str) -> None:
        """Remove the artifact `key`, or every artifact under it (a run's); absent is fine."""

    def sweep_incomplete(self, prefix: str, older_than_s: float = 0.0) -> list[str]:
        """Remove what writes that never finished left under `prefix` (older than `older_than_s`;
        0: all, only while no write of another process can be running); returns what went."""


class LocalArtifactStore:
    """Artifacts as directories under `root` (the data directory by default)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        # Temp dirs of this process's writes in progress, which no sweep may take.
        self._writing: set[Path] = set()

    def __reduce__(self):  # crosses to engine processes and Ray actors as its root alone
        return (LocalArtifactStore, (str(self.root),))

    def path(self, key: str) -> Path:
        """The directory of `key` (for tools that report where things are on disk: fsck). A leading
        `/` is dropped: a store rooted at `/` takes absolute paths as keys (an Engine held by tests
        and tools, engine/engine.py)."""
        return self.root / check_key(key[1:] if isinstance(key, str) and key.startswith("/") else key)

    # -- writes ------------------------------------------------------------------------------------

    def put(self, key: str, files: Mapping[str, bytes | Iterable[bytes]]) -> int:
        for name in files:
            check_key(name)
        target = self.path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        except OSError as e:
            raise _write_error(target, e) from e
        self._writing.add(tmp)
        written = 0
        try:
            for name, data in files.items():
                if isinstance(data, (bytes, bytearray, memoryview)) and len(data) >= DIRECT_MIN_BYTES:
                    if _write_direct(tmp / name, memoryview(data).cast("B")):
                        written += len(data)
                        continue
                with open(tmp / name, "wb") as f:
                    for chunk in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data):
                        f.write(chunk)
                        written += len(chunk)
                    f.flush()
                    os.fsync(f.fileno())
            _swap_into_place(tmp, target)
        except OSError as e:
            raise _write_error(target, e) from e
        finally:
            self._writing.discard(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        return written

    def copy(self, src: str, dst: str) -> int:
        names = self.names(src)
        return self.put(dst, {name: self._chunks(src, name) for name in names})

    def delete(self, key: str) -> None:
        shutil.rmtree(self.path(key), ignore_errors=True)

    # -- reads -------------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.path(key).is_dir()

    def version(self, key: str) -> str | None:
        try:
            st = os.stat(self.path(key))
        except OSError:
            return None
        return f"{st.st_ino}-{st.st_mtime_ns}"  # a put renames a new directory into place: a new inode

    def modified(self, key: str) -> float | None:
        try:
            return os.stat(self.path(key)).st_mtime
        except OSError:
            return None

    def names(self, key: str) -> list[str]:
        d = self.path(key)
        try:
            return sorted(p.name for p in d.iterdir() if p.is_file())
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"no artifact {key!r}") from None

    def files(self, key: str) -> dict[str, int]:
        d = self.path(key)
        return {name: (d / name).stat().st_size for name in self.names(key)}

    def open(self, key: str, name: str) -> BinaryIO:
        try:
            return open(self.path(key) / check_key(name), "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFoundError(f"no file {name!r} in artifact {key!r}") from None

    def read(self, key: str, name: str) -> bytes:
        with self.open(key, name) as f:
            return f.read()

    def size(self, key: str) -> int:
        d = self.path(key)
        return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0

    def list(self, prefix: str) -> list[str]:
        d = self.path(prefix)
        try:
            return sorted(join(prefix, p.name) for p in d.iterdir() if p.is_dir() and not _is_temp(p.name))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _chunks(self, key: str, name: str) -> Iterable[bytes]:
        with self.open(key, name) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    # -- debris ------------------------------------------------------------------------------------

    def sweep_incomplete(self, prefix: str, older_than_s: float = 0.0,
                         keep: Callable[[Path], bool] = lambda p: False) -> list[str]:
        """Temp dirs (`.<name>.tmp-*`, `.<name>.old-*`) under `prefix`, at any depth. A set-aside
        `.old-*` whose real name is empty (the crash came between the two renames) is put back
        first: nothing that pointed at that name changed."""
        root = self.path(prefix)
        if not root.is_dir():
            return []
        cutoff = time.time() - older_than_s
        swept = []
        for parent, dirs, _ in os.walk(root):
            temps = [d for d in dirs if _is_temp(d)]
            dirs[:] = [d for d in dirs if d not in temps]
            for name in temps:
                d = Path(parent) / name
                try:
                    if d in self._writing or keep(d) or (older_than_s > 0 and d.stat().st_mtime >= cutoff):
                        continue
                    target = set_aside_target(d)
                    if target is not None and not target.exists():
                        os.replace(d / "ckpt", target)
                        log.warning("restored %s, set aside by a write that crashed before replacing it", target)
                    shutil.rmtree(d, ignore_errors=True)
                    swept.append(str(d.relative_to(self.root)))
                except FileNotFoundError:  # swept meanwhile by another sweep
                    pass
        return swept


# Files at least this big are written with O_DIRECT (module _write_direct).
DIRECT_MIN_BYTES = 4 << 20
_BOUNCE_BYTES = 8 << 20
_ALIGN = 4096
_bounce = threading.local()


def _write_direct(path: Path, data: memoryview) -> bool:
    """Write `data` to the new file `path` past the page cache; False where the filesystem refuses
    O_DIRECT (tmpfs), and the caller writes it buffered. Why: a snapshot's ~140 MB written buffered
    takes that much fresh page cache each time, and on a VM that hands freed pages back to its host
    that cost 0.25 s of system time per 111 MB against 0.03 s direct. The data goes through one
    page-aligned 8 MB buffer per thread, kept (so touched once); the last piece is padded to the
    block size and the file cut back to its length."""
    buf = getattr(_bounce, "buf", None)
    if buf is None:
        buf = _bounce.buf = mmap.mmap(-1, _BOUNCE_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        with memoryview(buf) as view:
            for start in range(0, len(data), _BOUNCE_BYTES):
                piece = data[start:start + _BOUNCE_BYTES]
                n = len(piece)
                view[:n] = piece
                padded = -(-n // _ALIGN) * _ALIGN
                if padded > n:
                    view[n:padded] = bytes(padded - n)
                os.write(fd, view[:padded])
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _is_temp(name: str) -> bool:
    """`.<name>.tmp-*` (a put in progress or crashed) or `.<name>.old-*` (an artifact set aside)."""
    return name.startswith(".") and (".tmp-" in name or ".old-" in name)


def set_aside_target(d: Path) -> Path | None:
    """For `.<name>.old-*` holding `ckpt`: the real name it was set aside from; else None."""
    if ".old-" not in d.name or not (d / "ckpt").is_dir():
        return None
    return d.parent / d.name[1:].rsplit(".old-", 1)[0]


def _swap_into_place(tmp: Path, target: Path) -> None:
    # os.replace cannot replace a non-empty directory, so an existing artifact is first renamed
    # aside (also atomic) and deleted only after the new one is in place.
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "ckpt")
    os.replace(tmp, target)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_error(target: Path, e: OSError) -> ServerError:
    """A server error (not the caller's fault) that names the disk: the SDK does not retry a failed
    future, so the user reads this once and can tell the operator what to free."""
    where = target.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
        space = f"{_human(st.f_bavail * st.f_frsize)} free of {_human(st.f_blocks * st.f_frsize)} on {where}"
    except OSError:
        space = f"free space on {where} unknown"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ServerError(f"cannot write checkpoint {target.name!r}: the server's disk is full ({e.strerror}: {space}); "
                           f"nothing was saved, save it again once space is freed")
    return ServerError(f"cannot write checkpoint {target.name!r}: {e.strerror or e} ({space}); nothing was saved")


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def key_of_path(path: str) -> str:
    """The key a path written by op schema v1 (absolute, under the data directory) names: its
    layout is tinkerd's own, so it is read from the end, whatever the data directory was then.
    `checkpoints/<model_id>/<segment>/<name>`, `checkpoints/_ephemeral/<id>`,
    `snapshots/<model_id>/seq-<n>`. A key passes unchanged; anything else is a ValueError."""
    parts = [p for p in str(path).split("/") if p]
    if not str(path).startswith("/"):
        check_key(str(path))
        return str(path)
    for depth in (3, 4):
        if len(parts) >= depth and parts[-depth] in ("checkpoints", "snapshots"):
            tail = parts[-depth:]
            if (tail[0], depth) in (("snapshots", 3), ("checkpoints", 4)) or (depth == 3 and tail[1] == "_ephemeral"):
                try:
                    return check_key("/".join(tail))
                except UserError:
                    break
    raise ValueError(f"{path!r} is not a checkpoint, sampler or snapshot directory of a tinkerd data directory")


def adapter_key(value: str | None) -> str | None:
    """A sampler's adapter as stored in a row (a key, or a path written before keys) as a key."""
    return key_of_path(value) if value else None
