"""No save commits a checkpoint its readers refuse, and readers bound their work by records.

Readers cap ``.metadata`` at ``MAX_METADATA_BYTES`` and ``MAX_METADATA_RECORDS``; a pure-FSDP 70B
+ Adam save crosses them at a few thousand ranks.  The writer used to commit such a ``.metadata``
and report success; every restore then failed.  Now the save fails before its commit, saying why.
The limits are lowered in a child process so that a small save crosses them.
"""

from __future__ import annotations

from isolated import run_isolated

_SAVE = """
    import os, torch, torch.distributed.checkpoint as dcp
    import dcp_tiered.dcp.metadata_io as mio
    from dcp_tiered import CompressedWriter, CompressedReader, MetadataTooLargeError
    mio.MAX_METADATA_RECORDS = {records}
    mio.MAX_METADATA_BYTES = {nbytes}
    path = {path!r}
    state = {{f"t{{i}}": torch.full((4,), float(i)) for i in range(100)}}
    try:
        dcp.save(state, storage_writer=CompressedWriter(path, sync_files=False), no_dist=True)
        emit({{"saved": True, "committed": os.path.exists(os.path.join(path, ".metadata"))}})
    except BaseException as exc:
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {{}}).values()] or [exc]
        emit({{"saved": False, "errors": [type(e).__name__ + ": " + str(e) for e in failures],
               "too_large": any(isinstance(e, MetadataTooLargeError) for e in failures),
               "committed": os.path.exists(os.path.join(path, ".metadata"))}})
"""


def test_a_save_over_the_record_limit_fails_before_its_commit(tmp_path):
    res = run_isolated(_SAVE.format(records=50, nbytes=256 << 20, path=str(tmp_path / "ckpt")), timeout=120)
    assert res.returncode == 0, res.describe()
    out = res.result
    assert not out["saved"] and out["too_large"] and not out["committed"], out
    assert "100 storage records" in out["errors"][0] and "nothing was committed" in out["errors"][0], out


def test_a_save_over_the_byte_limit_fails_before_its_commit(tmp_path):
    res = run_isolated(_SAVE.format(records=1 << 22, nbytes=2000, path=str(tmp_path / "ckpt")), timeout=120)
    assert res.returncode == 0, res.describe()
    out = res.result
    assert not out["saved"] and out["too_large"] and not out["committed"], out
    assert "bytes, over the 2000-byte limit" in out["errors"][0], out


def test_a_save_within_the_limits_commits(tmp_path):
    res = run_isolated(_SAVE.format(records=100, nbytes=256 << 20, path=str(tmp_path / "ckpt")), timeout=120)
    assert res.returncode == 0, res.describe()
    assert res.result == {"saved": True, "committed": True}, res.result


def test_a_metadata_declaring_more_records_than_the_limit_is_refused_before_its_records_are_read(tmp_path):
    path = tmp_path / "ckpt"
    res = run_isolated(_SAVE.format(records=1 << 22, nbytes=256 << 20, path=str(path)), timeout=120)
    assert res.result == {"saved": True, "committed": True}, res.describe()
    res = run_isolated(f"""
        import dcp_tiered.dcp.metadata_io as mio
        from dcp_tiered.errors import CorruptCheckpointError
        mio.MAX_METADATA_RECORDS = 50
        try:
            mio.decode_metadata(open({str(path / '.metadata')!r}, 'rb').read(), 'crafted')
            emit('loaded')
        except CorruptCheckpointError as exc:
            emit(str(exc))
    """, timeout=120)
    assert res.returncode == 0, res.describe()
    assert "declares 100 records" in res.result, res.result
