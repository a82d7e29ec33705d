"""The storage backends behave alike: a local directory, S3 (moto) and ``memory://``.

Each test runs on the three backends that ``Storage(url)`` picks; what differs by design
(links, locks, how atomic an exclusive commit is) is tested on the backend it concerns.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import time
import uuid
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from dcp_tiered.errors import ConfigError, CorruptCheckpointError, StorageError, UnsafeCheckpointError
from dcp_tiered.storage import (
    FsspecStorage,
    LocalStorage,
    MissingFileError,
    ObjectStoreStorage,
    Storage,
    register_backend,
)
from dcp_tiered.storage import base as storage_base
from dcp_tiered.storage.retry import RetryPolicy
from isolated import run_isolated

BACKENDS = {"local": LocalStorage, "s3": ObjectStoreStorage, "memory": FsspecStorage}


@pytest.fixture(params=list(BACKENDS))
def store(request, tmp_path: Path) -> Storage:
    """An empty directory on one backend."""
    if request.param == "local":
        return Storage(tmp_path / "root")
    if request.param == "s3":
        bucket, options = request.getfixturevalue("s3_bucket")
        return Storage(f"{bucket}/root", options)
    return Storage(f"memory://backends-{uuid.uuid4().hex}/root")


def backend(store: Storage) -> str:
    return next(k for k, cls in BACKENDS.items() if type(store) is cls)


def test_the_url_picks_the_backend_and_children_keep_it(store: Storage) -> None:
    kind = backend(store)
    assert store.is_local == (kind == "local") and store.is_object_store == (kind == "s3")
    child = store.child("step_1/sub")
    assert type(child) is type(store) and child.url == store.url + "/step_1/sub"
    again = pickle.loads(pickle.dumps(child))
    assert type(again) is type(store) and again.url == child.url and again.root == child.root
    assert store.same_place(Storage(store.url + "/", store.storage_options))
    assert not store.same_place(child)


def test_file_urls_are_local_and_a_wrong_direct_backend_is_refused(tmp_path: Path) -> None:
    assert type(Storage(f"file://{tmp_path}")) is LocalStorage
    with pytest.raises(ConfigError, match="LocalStorage cannot serve memory://"):
        LocalStorage("memory://x/y")
    assert type(FsspecStorage(str(tmp_path))) is FsspecStorage  # the generic backend serves any filesystem


def test_commit_replaces_and_exclusive_commit_keeps_the_first(store: Storage) -> None:
    store.makedirs()
    assert store.commit_bytes("m", b"one")
    assert store.read_bytes("m") == b"one"
    assert store.commit_bytes("m", b"second")
    assert store.read_bytes("m") == b"second"
    assert store.commit_bytes("m", b"third", exclusive=True) is False
    assert store.read_bytes("m") == b"second"
    assert store.commit_bytes("x", b"new", exclusive=True)
    assert store.read_bytes("x") == b"new"
    assert store.file_sizes() == {"m": 6, "x": 3}  # no temporary file is left


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_exclusive_commit_has_one_winner_under_a_race(kind: str, request, tmp_path: Path) -> None:
    if kind == "local":
        store = Storage(tmp_path)
    else:
        bucket, options = request.getfixturevalue("s3_bucket")
        store = Storage(f"{bucket}/race", options)
    payloads = [f"writer {i}".encode() * 100 for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
        won = list(pool.map(lambda p: store.commit_bytes(".metadata", p, exclusive=True), payloads))
    assert won.count(True) == 1
    assert store.read_bytes(".metadata") == payloads[won.index(True)]


def _break_publish(store: Storage, monkeypatch) -> None:
    """Make the step that publishes a commit fail on the backend of ``store``."""

    def fail(*args, **kwargs):
        raise OSError(5, "injected I/O error")

    if store.is_local:
        monkeypatch.setattr(os, "replace", fail)
    elif store.is_object_store:
        monkeypatch.setattr(store.fs, "pipe_file", fail)
    else:
        monkeypatch.setattr(store.fs, "mv", fail)


def test_a_failed_commit_leaves_the_old_content_and_no_temp(store: Storage, monkeypatch) -> None:
    store.makedirs()
    store.commit_bytes(".metadata", b"committed")
    _break_publish(store, monkeypatch)
    with pytest.raises(StorageError, match=r"commit failed on .*\.metadata"):
        store.commit_bytes(".metadata", b"never seen")
    monkeypatch.undo()
    assert store.read_bytes(".metadata") == b"committed"
    assert store.file_sizes() == {".metadata": 9}


def test_commit_file_publishes_a_local_file_whole_and_consumes_it(store: Storage, tmp_path: Path) -> None:
    store.makedirs()
    store.commit_bytes("model.safetensors", b"old")
    staged = tmp_path / "staged"
    staged.write_bytes(b"new bytes")
    os.chmod(staged, 0o600)  # as the safetensors library creates its files
    store.commit_file("model.safetensors", staged)
    assert store.read_bytes("model.safetensors") == b"new bytes"
    assert not staged.exists()
    assert store.file_sizes() == {"model.safetensors": 9}  # no temporary file is left
    if store.is_local:  # the mode any new file gets here, not the stager's owner-only one
        probe = os.open(store.path("probe"), os.O_CREAT | os.O_WRONLY, 0o666)
        os.close(probe)
        mode = os.stat(store.path("probe")).st_mode & 0o777
        assert os.stat(store.path("model.safetensors")).st_mode & 0o777 == mode


def test_commit_file_retries_a_transient_upload_failure(store: Storage, tmp_path: Path, monkeypatch) -> None:
    if store.is_local:
        pytest.skip("a local rename has no transient failure to retry")
    store.makedirs()
    put = store.fs.put_file
    calls = []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise OSError(5, "injected transient I/O error")
        return put(*args, **kwargs)

    monkeypatch.setattr(store.fs, "put_file", flaky)
    staged = tmp_path / "staged"
    staged.write_bytes(b"shard")
    store.commit_file("s", staged, retry=RetryPolicy(attempts=3, base=0.01))
    assert len(calls) == 2 and store.read_bytes("s") == b"shard"
    staged.write_bytes(b"shard")
    monkeypatch.setattr(store.fs, "put_file", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "injected")))
    with pytest.raises(StorageError, match=r"commit failed on .*/t"):
        store.commit_file("t", staged, retry=RetryPolicy(attempts=2, base=0.01))
    assert "t" not in store.file_sizes()


def test_local_commit_file_copies_a_file_staged_on_another_filesystem(tmp_path: Path) -> None:
    staging = Path("/dev/shm")
    if not staging.is_dir() or os.stat(staging).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second filesystem (/dev/shm)")
    staged = staging / f"dcp-tiered-test-{uuid.uuid4().hex}"
    staged.write_bytes(b"x" * (3 << 20))
    store = Storage(tmp_path / "dst")
    store.makedirs()
    store.commit_file("big", staged)
    assert store.read_bytes("big") == b"x" * (3 << 20) and not staged.exists()
    assert store.file_sizes() == {"big": 3 << 20}


def test_local_commit_file_never_follows_a_planted_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"victim")
    store = Storage(tmp_path / "dst")
    store.makedirs()
    os.symlink(outside, tmp_path / "dst" / "model.safetensors")
    staged = tmp_path / "dst" / "staged"
    staged.write_bytes(b"shard")
    store.commit_file("model.safetensors", staged)
    assert outside.read_bytes() == b"victim"
    assert not store.is_link("model.safetensors") and store.read_bytes("model.safetensors") == b"shard"
    link = tmp_path / "link"
    os.symlink(outside, link)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        store.commit_file("other", link)  # the staged file itself must not be a link
    assert outside.read_bytes() == b"victim"


def test_open_write_then_ranged_reads(store: Storage) -> None:
    data = bytes(range(256)) * 40
    with store.open_write("d/data.distcp") as f:
        f.write(data[:5000])
        f.write(data[5000:])
    assert store.size("d/data.distcp") == len(data)
    assert store.read_range("d/data.distcp", 100, 356) == data[100:356]
    assert store.read_range("d/data.distcp", len(data) - 10, len(data) + 50) == data[-10:]  # short at EOF
    buf = bytearray(300)
    assert store.read_range_into("d/data.distcp", 20, buf) == 300 and bytes(buf) == data[20:320]
    tail = memoryview(bytearray(64))
    assert store.read_range_into("d/data.distcp", len(data) - 16, tail) == 16 and bytes(tail[:16]) == data[-16:]
    with store.open_write("d/fast", durable=False) as f:
        f.write(b"abc")
    assert store.read_bytes("d/fast") == b"abc"


def test_listing_has_sizes_and_ages(store: Storage) -> None:
    assert store.file_sizes() == {} and store.listdir() == []  # a missing root lists as empty
    before = time.time()
    store.makedirs()
    store.commit_bytes("a", b"12345")
    with store.open_write("sub/b") as f:
        f.write(b"x" * 1000)
    assert store.file_sizes() == {"a": 5, "sub/b": 1000}
    assert store.listdir() == ["a", "sub"]
    now = time.time()
    ages = store.file_ages(now)
    # memory:// reports no modification time: files of unknown age are left out
    assert set(ages) == (set() if backend(store) == "memory" else {"a", "sub/b"})
    assert all(-5 <= age <= now - before + 5 for age in ages.values())  # S3 times are whole seconds
    assert store.child("sub").file_sizes() == {"b": 1000}


def test_delete_a_file_and_a_tree(store: Storage) -> None:
    store.makedirs()
    store.commit_bytes("a", b"1")
    with store.open_write("sub/b") as f:
        f.write(b"2")
    store.remove("a")
    store.remove("a")  # missing: not an error
    assert not store.exists("a") and store.file_sizes() == {"sub/b": 1}
    store.remove_tree()
    store.remove_tree()
    assert store.file_sizes() == {} and not store.exists("sub/b")


def test_read_bytes_checks_the_size_before_reading(store: Storage) -> None:
    store.makedirs()
    store.commit_bytes("small", b"x" * 100)
    store.commit_bytes("empty", b"")
    assert store.read_bytes("small", max_bytes=100) == b"x" * 100
    assert store.read_bytes("empty", max_bytes=0) == b""
    with pytest.raises(CorruptCheckpointError, match=r"small has 100 bytes, more than the 99 allowed"):
        store.read_bytes("small", max_bytes=99)
    with pytest.raises(MissingFileError, match="nothing"):
        store.read_bytes("nothing", max_bytes=10)
    with pytest.raises(MissingFileError):
        store.read_range("nothing", 0, 1)
    with pytest.raises(MissingFileError):
        store.size("nothing")


def test_remove_temps_deletes_only_the_temps_of_that_name(store: Storage) -> None:
    store.makedirs()
    names = [".metadata.0123abcd.tmp", ".metadata.deadbeef.tmp", ".metadata", ".metadata.zzzzzzzz.tmp",
             "other.0123abcd.tmp", ".metadata.0123abcd.tmp.keep"]
    for name in names:
        store.commit_bytes(name, b"t")
    store.remove_temps(".metadata", older_than=3600)  # all are fresh: may be commits in progress elsewhere
    assert sorted(store.file_sizes()) == sorted(names)
    store.remove_temps(".metadata", older_than=3600, now=time.time() + 7200)
    if not store.file_ages(time.time()):  # memory:// keeps no times: an age never known, nothing removed
        assert sorted(store.file_sizes()) == sorted(names)
    else:
        assert sorted(store.file_sizes()) == sorted(names[2:])


def test_only_local_directories_lock(store: Storage) -> None:
    store.makedirs()
    lock = store.try_lock(".lock")
    assert lock is not None and lock.held == store.is_local
    if store.is_local:
        assert store.try_lock(".lock") is None  # held by the first one (flock is per open file)
        lock.release(unlink=True)
        again = store.try_lock(".lock")
        assert again is not None and again.held
        again.release()


def test_a_child_is_on_its_parents_filesystem_object(store: Storage) -> None:
    """A subdirectory is reached through the parent's filesystem object, not a new one: with an S3
    endpoint (the fixture passes ``skip_instance_cache``) a new one is a new client and session, about
    half a second of CPU each (a listing of N steps made N)."""
    child = store.child("step_1").child("sub")
    assert child.fs is store.fs and child.root == Storage(child.url, store.storage_options).root
    child.makedirs()
    child.commit_bytes("x", b"1")
    assert store.child("step_1/sub").read_bytes("x") == b"1"


def test_cli_s3_options_share_one_client_across_storages_and_threads(s3_bucket, moto_server, monkeypatch) -> None:
    """``--s3-endpoint-url`` gives every storage of one endpoint the same cached filesystem (and its one
    client), whichever thread opens it: ``train`` spent seconds making a session per storage."""
    import argparse

    from dcp_tiered.cli.args import storage_options_for

    bucket, _ = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    args = argparse.Namespace(s3_endpoint_url=moto_server.endpoint_url)
    first = Storage(f"{bucket}/run", storage_options_for(bucket, args))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: Storage(f"{bucket}/other", storage_options_for(bucket, args))).result()
    assert other.fs is first.fs
    other.commit_bytes("x", b"1")
    assert first.fs.cat_file(f"{bucket.removeprefix('s3://')}/other/x") == b"1"


def test_a_missing_bucket_is_named(s3_bucket) -> None:
    _bucket, options = s3_bucket
    store = Storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", options)
    with pytest.raises(MissingFileError, match="bucket or container .* does not exist; create it first"):
        store.makedirs()


# -- local hardening: links and special files are never followed --------------------


def test_local_links_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    store = Storage(tmp_path / "ckpt")
    store.makedirs()
    os.symlink(outside / "secret", tmp_path / "ckpt" / "file_link")
    os.symlink(outside, tmp_path / "ckpt" / "dir_link")
    assert store.is_link("file_link") and not store.is_link()
    for read in (lambda: store.read_bytes("file_link"), lambda: store.read_bytes("file_link", max_bytes=100),
                 lambda: store.read_range("file_link", 0, 3), lambda: store.size("file_link"),
                 lambda: store.read_range_into("file_link", 0, bytearray(3)),
                 lambda: store.read_bytes("dir_link/secret"), lambda: store.child("dir_link").read_bytes("secret")):
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            read()
    assert store.file_sizes() == {}  # links are not listed, and not walked
    with pytest.raises(UnsafeCheckpointError), store.open_write("file_link") as f:
        f.write(b"overwritten")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        store.try_lock("file_link")
    assert (outside / "secret").read_bytes() == b"secret"


def test_a_local_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    code = f"""
from dcp_tiered.errors import UnsafeCheckpointError
from dcp_tiered.storage import Storage
st = Storage({str(tmp_path)!r})
out = []
for read in (lambda: st.read_bytes("fifo", max_bytes=10), lambda: st.read_bytes("fifo"), lambda: st.size("fifo")):
    try:
        read()
        out.append("read")
    except UnsafeCheckpointError as exc:
        out.append("regular file" in str(exc))
emit(out)
"""
    result = run_isolated(code, timeout=60)
    assert result.result == [True, True, True], result.stderr


# -- adding a backend ------------------------------------------------------------------


class _ToyFS(MemoryFileSystem):
    protocol = ("toybackend",)
    store: dict = {}
    pseudo_dirs = [""]


def test_a_registered_backend_is_picked_for_its_filesystem() -> None:
    fsspec.register_implementation("toybackend", _ToyFS, clobber=True)

    @register_backend
    class ToyStorage(FsspecStorage):
        @classmethod
        def handles(cls, fs) -> bool:
            return isinstance(fs, _ToyFS)

    try:
        store = Storage("toybackend://bucket/ckpt")
        assert type(store) is ToyStorage and type(store.child("a")) is ToyStorage
        assert type(Storage(f"memory://other-{uuid.uuid4().hex}")) is FsspecStorage
        store.commit_bytes(".metadata", b"ok")
        assert store.read_bytes(".metadata") == b"ok"
    finally:
        storage_base._BACKENDS.remove(ToyStorage)


def test_same_place_agrees_with_validate_tiers_on_endpoints() -> None:
    from dcp_tiered.tiers.config import Tier, validate_tiers

    one = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    two = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:2"}}
    validate_tiers([Tier("cache", "s3://b/run", storage_options=one), Tier("durable", "s3://b/run", storage_options=two)],
                   probe=False)  # accepted: two places
    assert not Storage("s3://b/run", one).same_place(Storage("s3://b/run", two))
