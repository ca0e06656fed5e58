"""The ArtifactStore (tinkerd/artifacts.py) and its local implementation: artifacts by key, put whole
or not at all, read and copied as streams, listed by prefix, deleted by key or prefix; keys that
would leave the store are refused; what a crashed write leaves is swept; and the key a v1 path (op
schema v1, absolute under some data directory) names is read from tinkerd's own layout."""

from __future__ import annotations

import errno

import pytest

from tinkerd.artifacts import LocalArtifactStore, key_of_path
from tinkerd.errors import NotFoundError, ServerError, UserError

KEY = "checkpoints/sess-1:train:0/weights/step-2"


def test_put_read_list_copy_delete(tmp_path):
    store = LocalArtifactStore(tmp_path)
    assert not store.exists(KEY) and store.version(KEY) is None and store.list("checkpoints") == []
    written = store.put(KEY, {"a.bin": b"abc", "b.json": (chunk for chunk in (b"{", b"}"))})  # bytes or chunks
    assert written == 5 and store.exists(KEY)
    assert store.names(KEY) == ["a.bin", "b.json"] and store.files(KEY) == {"a.bin": 3, "b.json": 2}
    assert store.read(KEY, "b.json") == b"{}" and store.size(KEY) == 5
    with store.open(KEY, "a.bin") as f:
        assert f.read(2) == b"ab"
    assert store.list("checkpoints/sess-1:train:0/weights") == [KEY]
    assert store.list("checkpoints") == ["checkpoints/sess-1:train:0"]  # folders too, by prefix
    first = store.version(KEY)
    store.put(KEY, {"a.bin": b"new"})  # replaced whole: b.json is gone, the version changed
    assert store.names(KEY) == ["a.bin"] and store.version(KEY) != first
    copy = "checkpoints/sess-2:train:0/weights/step-2"
    assert store.copy(KEY, copy) == 3 and store.read(copy, "a.bin") == b"new"
    store.delete("checkpoints/sess-1:train:0")  # a run's every artifact, by prefix
    assert not store.exists(KEY) and store.exists(copy) and store.size("checkpoints") == 3
    with pytest.raises(NotFoundError):
        store.names(KEY)
    with pytest.raises(NotFoundError):
        store.open(copy, "missing.bin")
    with pytest.raises(NotFoundError):
        store.copy(KEY, "elsewhere/x")
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "sess-2:train:0" / "weights").iterdir()) == ["step-2"]


def test_a_failed_put_leaves_the_artifact_as_it_was_and_names_the_disk(tmp_path):
    store = LocalArtifactStore(tmp_path)
    store.put(KEY, {"a.bin": b"old"})

    def full_disk():
        yield b"half"
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ServerError) as err:
        store.put(KEY, {"a.bin": full_disk()})
    assert "disk is full" in err.value.message and "free of" in err.value.message
    assert store.read(KEY, "a.bin") == b"old"
    assert [p.name for p in (tmp_path / KEY).parent.iterdir()] == ["step-2"]  # no temp dir left


@pytest.mark.parametrize("key", ["", "../etc", "a/../../b", "a//b", "a/./b", "a/b/", "a b", "a\0b"])
def test_a_key_that_could_leave_the_store_is_refused(tmp_path, key):
    store = LocalArtifactStore(tmp_path)
    with pytest.raises(UserError):
        store.put(key, {"f": b"x"})
    with pytest.raises(UserError):
        store.put("ok", {key or "..": b"x"})  # file names are one segment each
    assert list(tmp_path.iterdir()) == []


def test_a_store_rooted_at_the_filesystem_root_takes_absolute_paths(tmp_path):
    store = LocalArtifactStore("/")  # an Engine held by tests and tools (engine/engine.py)
    store.put(str(tmp_path / "ckpt"), {"a.bin": b"x"})
    assert (tmp_path / "ckpt" / "a.bin").read_bytes() == b"x"


def test_sweep_removes_crash_debris_restores_a_set_aside_artifact_and_keeps_whole_ones(tmp_path):
    store = LocalArtifactStore(tmp_path)
    store.put("snapshots/m/seq-000000000004", {"a": b"4"})
    root = tmp_path / "snapshots" / "m"
    (root / ".seq-000000000006.tmp-ab12").mkdir()  # a put killed mid-way
    (root / ".seq-000000000005.old-cd34" / "ckpt").mkdir(parents=True)  # killed between the two renames
    (root / ".seq-000000000005.old-cd34" / "ckpt" / "a").write_bytes(b"5")
    swept = store.sweep_incomplete("snapshots")
    assert sorted(swept) == ["snapshots/m/.seq-000000000005.old-cd34", "snapshots/m/.seq-000000000006.tmp-ab12"]
    assert store.list("snapshots/m") == ["snapshots/m/seq-000000000004", "snapshots/m/seq-000000000005"]
    assert store.read("snapshots/m/seq-000000000005", "a") == b"5"
    assert store.sweep_incomplete("snapshots", older_than_s=3600) == []  # nothing left, nothing young taken


@pytest.mark.parametrize("path, key", [
    ("/srv/d/checkpoints/sess-1:train:0/weights/step-2", "checkpoints/sess-1:train:0/weights/step-2"),
    ("/home/u/.tinkerd/checkpoints/sess-1:train:0/sampler_weights/final", "checkpoints/sess-1:train:0/sampler_weights/final"),
    ("/x/checkpoints/_ephemeral/sess-1:sample:3", "checkpoints/_ephemeral/sess-1:sample:3"),
    ("/x/snapshots/sess-1:train:0/seq-000000000012", "snapshots/sess-1:train:0/seq-000000000012"),
    ("checkpoints/m/weights/n", "checkpoints/m/weights/n"),  # already a key
])
def test_a_v1_path_names_its_key_by_tinkerds_layout(path, key):
    assert key_of_path(path) == key


@pytest.mark.parametrize("path", ["/somewhere/else/adapter", "/x/checkpoints/m/bogus-depth"])
def test_a_path_outside_the_layout_is_no_key(path):
    with pytest.raises(ValueError):
        key_of_path(path)


# -- big files past the page cache (artifacts._write_direct) ----------------------------------------


def _spy_direct(monkeypatch) -> list[str]:
    """Record the files opened with O_DIRECT (the direct path taken), passing every call through."""
    import os

    from tinkerd import artifacts

    opened, real = [], os.open

    def spy(path, flags, *args, **kwargs):  # (shutil.rmtree passes dir_fd=)
        if flags & os.O_DIRECT:
            opened.append(os.path.basename(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(artifacts.os, "open", spy)
    return opened


def test_big_files_are_written_direct_and_read_back_exactly(tmp_path, monkeypatch):
    """Files of DIRECT_MIN_BYTES or more go through the aligned bounce buffer: lengths that are not
    a multiple of the block or of the buffer, as bytes, bytearray and memoryview, come back byte for
    byte at their own length; small files are written as before."""
    import os

    from tinkerd.artifacts import DIRECT_MIN_BYTES, _BOUNCE_BYTES

    opened = _spy_direct(monkeypatch)
    rng = __import__("numpy").random.default_rng(0)
    big = rng.integers(0, 256, size=2 * _BOUNCE_BYTES + 4099, dtype="uint8").tobytes()
    files = {"exact.bin": big[:DIRECT_MIN_BYTES], "ragged.bin": bytearray(big[:DIRECT_MIN_BYTES + 123]),
             "two-buffers.bin": memoryview(big), "small.json": b"{}"}
    store = LocalArtifactStore(tmp_path)
    assert store.put(KEY, files) == sum(len(v) for v in files.values())
    assert sorted(opened) == ["exact.bin", "ragged.bin", "two-buffers.bin"]
    for name, data in files.items():
        assert store.read(KEY, name) == bytes(data)
        assert os.path.getsize(tmp_path / KEY / name) == len(data)


def test_where_o_direct_is_refused_big_files_are_written_buffered(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT answers EINVAL at open: the file is written buffered."""
    import os

    from tinkerd import artifacts

    real = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(artifacts.os, "open", refusing)
    data = bytes(range(256)) * (artifacts.DIRECT_MIN_BYTES // 256 + 7)
    store = LocalArtifactStore(tmp_path)
    store.put(KEY, {"big.bin": data})
    assert store.read(KEY, "big.bin") == data


def test_a_direct_write_that_fills_the_disk_leaves_the_artifact_as_it_was(tmp_path, monkeypatch):
    """On a real full filesystem (an 8 MiB tmpfs, which takes O_DIRECT) a 12 MB direct write gets
    ENOSPC: the error names the disk, the old artifact stays whole, no temporary directory is left."""
    from tests.tmpfs import small_tmpfs

    with small_tmpfs(tmp_path / "disk", "8m") as disk:
        opened = _spy_direct(monkeypatch)
        store = LocalArtifactStore(disk)
        store.put(KEY, {"a.bin": b"old"})
        with pytest.raises(ServerError) as err:
            store.put(KEY, {"a.bin": bytes(12 << 20)})
        assert opened == ["a.bin"]  # the direct path was the one that failed
        assert "disk is full" in err.value.message
        assert store.read(KEY, "a.bin") == b"old"
        assert [p.name for p in (disk / KEY).parent.iterdir()] == ["step-2"]
