"""``export_safetensors``/``import_safetensors`` and the ``export``/``import`` commands, on the real MiniLM weights.

The files written are read back with the ``safetensors`` library's own loader; indexes are the
``transformers`` layout; hostile files (an index escaping its directory, a header length of 2**63)
are refused with this package's errors; peak memory is measured in a child process.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save, save_file

from dcp_tiered import CompressedReader, CompressedWriter
from dcp_tiered.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    MissingFileError,
    StorageError,
    UnsafeCheckpointError,
)
from dcp_tiered.inspect import INDEX_NAME, WEIGHTS_NAME, export_safetensors, import_safetensors, load_any
from dcp_tiered.storage import Storage
from dcp_tiered.tiers import Tier, TieredCheckpointer
from forked import run_cli
from isolated import run_isolated

def cli(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``dcp-tiered ARGS`` in a forked child (tests/forked.py)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    return run_cli(*args, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def minilm(minilm_path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(minilm_path / "model.safetensors"))


def _training_state(weights: dict[str, torch.Tensor]) -> dict:
    return {"model": dict(weights), "optim": {"step": torch.tensor(7.0), "exp_avg": torch.ones(16)},
            "extra": {"epoch": 3}}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def _read_export(folder: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Every tensor of an export through ``safetensors.torch.load_file``, each shard checked against the index."""
    if not (folder / INDEX_NAME).exists():
        return load_file(str(folder / WEIGHTS_NAME)), None
    index = json.loads((folder / INDEX_NAME).read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        shard = load_file(str(folder / file))
        assert {k for k, f in index["weight_map"].items() if f == file} == set(shard), file
        out.update(shard)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out, index


def test_export_and_import_round_trip_minilm_bit_for_bit(tmp_path: Path, minilm: dict) -> None:
    dcp.save(_training_state(minilm), storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    res = export_safetensors(tmp_path / "ck", tmp_path / "hf", prefix="model.", max_shard_size="20MB")
    assert len(res.files) > 2 and res.skipped == []  # optimizer state is left out, not skipped
    back, index = _read_export(tmp_path / "hf")
    _same(back, minilm)
    assert index is not None and sorted(os.listdir(tmp_path / "hf")) == sorted([INDEX_NAME, *res.files])
    assert list(res.files) == [f"model-{i:05d}-of-{len(res.files):05d}.safetensors" for i in range(1, len(res.files) + 1)]
    for name in res.files:  # transformers' bound: a shard over 20 MB holds one tensor larger than that
        held = [back[k].numel() * back[k].element_size() for k in res.files[name]]
        assert sum(held) <= 20_000_000 or len(held) == 1, name

    imported = import_safetensors(tmp_path / "hf", tmp_path / "ck2", prefix="model.", codec="lz4")
    assert imported.tensors == len(minilm) and imported.saved["codec"] == "lz4"
    fresh = {"model": {k: torch.zeros_like(v) for k, v in minilm.items()}}
    dcp.load(fresh, storage_reader=CompressedReader(tmp_path / "ck2"), no_dist=True)
    _same(fresh["model"], minilm)

    one = export_safetensors(tmp_path / "ck2", tmp_path / "one", prefix="model")  # 5GB: one file, no index
    assert list(one.files) == [WEIGHTS_NAME] and os.listdir(tmp_path / "one") == [WEIGHTS_NAME]
    _same(load_file(str(tmp_path / "one" / WEIGHTS_NAME)), minilm)
    assert oct((tmp_path / "one" / WEIGHTS_NAME).stat().st_mode & 0o044) != "0o0"  # readable beyond the owner


def test_import_reads_the_hugging_face_file_and_a_transformers_index(tmp_path: Path, minilm_path: Path, minilm: dict) -> None:
    """The published MiniLM ``model.safetensors`` itself, and a ``transformers``-style index over shards of it."""
    import_safetensors(minilm_path / WEIGHTS_NAME, tmp_path / "from_file")
    _same(load_any(tmp_path / "from_file"), minilm)
    keys = sorted(minilm)
    hf = tmp_path / "hf"
    hf.mkdir()
    weight_map = {}
    for i, part in enumerate((keys[:40], keys[40:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: minilm[k] for k in part}, str(hf / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in minilm.values())
    (hf / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    for src in (hf, hf / INDEX_NAME):
        res = import_safetensors(src, tmp_path / "ck" / src.name, prefix="app.model.")
        assert sorted(res.files) == sorted(set(weight_map.values()))
        sd = load_any(tmp_path / "ck" / src.name)
        _same(sd["app"]["model"], minilm)


def test_an_import_onto_a_committed_checkpoint_raises_checkpoint_exists(tmp_path: Path) -> None:
    save_file({"w": torch.ones(3)}, str(tmp_path / "one.safetensors"))
    import_safetensors(tmp_path / "one.safetensors", tmp_path / "ck")
    with pytest.raises(CheckpointExistsError, match="overwrite"):
        import_safetensors(tmp_path / "one.safetensors", tmp_path / "ck")
    save_file({"w": torch.zeros(3)}, str(tmp_path / "two.safetensors"))
    import_safetensors(tmp_path / "two.safetensors", tmp_path / "ck", overwrite=True)
    assert torch.equal(load_any(tmp_path / "ck")["w"], torch.zeros(3))


def test_an_import_is_the_first_checkpoint_a_training_run_restores(tmp_path: Path, minilm: dict) -> None:
    save_file(minilm, str(tmp_path / WEIGHTS_NAME))
    tier = Tier("local", str(tmp_path / "local"))
    import_safetensors(tmp_path / WEIGHTS_NAME, tmp_path / "local" / "step_000000000", prefix="model.")
    model = {k: torch.zeros_like(v) for k, v in minilm.items()}
    with TieredCheckpointer([tier]) as ckpt:
        assert ckpt.restore({"model": model}) == 0
    _same(model, minilm)


def test_every_dtype_and_a_scalar_round_trip_from_stock_dcp(tmp_path: Path) -> None:
    """A stock DCP checkpoint exported, imported and exported again: dtypes, 0-dim and empty tensors as they were."""
    state = {"model": {"s": torch.tensor(3.5), "e": torch.zeros(0, 4), "b": torch.ones(2, 3, dtype=torch.bfloat16),
                       "h": torch.randn(5).half(), "d": torch.randn(3, dtype=torch.float64), "i8": torch.arange(-3, 3, dtype=torch.int8),
                       "u8": torch.arange(7, dtype=torch.uint8), "m": torch.tensor([True, False]), "l": torch.arange(4)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    export_safetensors(tmp_path / "stock", tmp_path / "hf", prefix="model.")
    _same(load_file(str(tmp_path / "hf" / WEIGHTS_NAME)), state["model"])
    import_safetensors(tmp_path / "hf" / WEIGHTS_NAME, tmp_path / "ck", prefix="model.")
    export_safetensors(tmp_path / "ck", tmp_path / "again", prefix="model.")
    _same(load_file(str(tmp_path / "again" / WEIGHTS_NAME)), state["model"])


def test_complex64_exports_and_a_dtype_safetensors_lacks_is_refused(tmp_path: Path) -> None:
    state = {"model": {"c": torch.randn(4, dtype=torch.complex64), "w": torch.ones(2)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    export_safetensors(tmp_path / "stock", tmp_path / "hf", prefix="model.")
    _same(load_file(str(tmp_path / "hf" / WEIGHTS_NAME)), state["model"])
    wide = {"model": {"z": torch.randn(4, dtype=torch.complex128)}}
    dcp.save(wide, storage_writer=dcp.FileSystemWriter(str(tmp_path / "wide")), no_dist=True)
    with pytest.raises(ConfigError, match=r"'model\.z'.*complex128.*--exclude"):
        export_safetensors(tmp_path / "wide", tmp_path / "hf2", prefix="model.")


def test_dtype_downcast_is_the_safe_one(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(64, 32, generator=g), "ids": torch.arange(10), "h": torch.randn(8, generator=g).half(),
                       "huge": torch.full((4,), 1e6), "vast": torch.tensor([1.0, 3.4e38]),
                       "tiny64": torch.tensor([1.0, 1e-300], dtype=torch.float64)}}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    bf = export_safetensors(tmp_path / "ck", tmp_path / "bf16", prefix="model.", dtype=torch.bfloat16)
    out = load_file(str(tmp_path / "bf16" / WEIGHTS_NAME))
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], state["model"]["w"].to(torch.bfloat16))
    assert torch.equal(out["ids"], state["model"]["ids"]) and torch.equal(out["h"], state["model"]["h"])
    assert sorted(bf.downcast) == ["huge", "w"] and sorted(bf.kept) == ["tiny64", "vast"]  # past bfloat16's range
    assert "overflow" in bf.kept["vast"] and "underflow" in bf.kept["tiny64"]
    assert out["vast"].dtype == torch.float32 and torch.equal(out["tiny64"], state["model"]["tiny64"])
    fp = export_safetensors(tmp_path / "ck", tmp_path / "fp16", prefix="model.", dtype=torch.float16)
    out = load_file(str(tmp_path / "fp16" / WEIGHTS_NAME))
    assert out["w"].dtype == torch.float16 and out["huge"].dtype == torch.float32  # 1e6 overflows float16
    assert "overflow" in fp.kept["huge"] and torch.equal(out["huge"], state["model"]["huge"])
    with pytest.raises(ConfigError):
        export_safetensors(tmp_path / "ck", tmp_path / "int8", prefix="model.", dtype=torch.int8)


def test_dtype_offers_only_the_downcasts_it_does(tmp_path: Path) -> None:
    """``--dtype`` of export and convert is bf16 or fp16; fp32 was accepted and did nothing (bf16 stayed bf16)."""
    dcp.save({"model": {"w": torch.ones(2, dtype=torch.bfloat16)}}, storage_writer=CompressedWriter(tmp_path / "ck"),
             no_dist=True)
    for cmd in ("export", "convert"):
        run = cli(cmd, tmp_path / "ck", tmp_path / f"{cmd}-out", "--dtype", "fp32")
        assert run.returncode == 2 and "invalid choice: 'fp32'" in run.stderr, run.stderr
        assert "16 bits" in cli(cmd, "--help").stdout
    run = cli("export", tmp_path / "ck", tmp_path / "hf", "--prefix", "model.")
    assert run.returncode == 0 and "(safetensors)" in run.stdout, run.stderr
    assert load_file(str(tmp_path / "hf" / WEIGHTS_NAME))["w"].dtype == torch.bfloat16


def test_prefix_include_and_exclude_choose_the_model(tmp_path: Path) -> None:
    state = {"app": {"model": {"enc.w": torch.ones(3), "enc.b": torch.zeros(3), "lora_a": torch.ones(2), "note": "x"},
                     "ema": {"enc.w": torch.full((3,), 2.0)}},
             "optim": {"exp_avg": torch.ones(3)}}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    res = export_safetensors(tmp_path / "ck", tmp_path / "m", prefix="app.model.", exclude=["*.lora_*"])
    assert sorted(load_file(str(tmp_path / "m" / WEIGHTS_NAME))) == ["enc.b", "enc.w"]
    assert res.skipped == ["app.model.note"]
    export_safetensors(tmp_path / "ck", tmp_path / "ema", prefix="app.ema", include=["app.ema.enc.*"])
    assert torch.equal(load_file(str(tmp_path / "ema" / WEIGHTS_NAME))["enc.w"], torch.full((3,), 2.0))
    everything = export_safetensors(tmp_path / "ck", tmp_path / "all")  # no prefix: every key, optimizer left out
    assert "optim.exp_avg" not in load_file(str(tmp_path / "all" / WEIGHTS_NAME)) and everything.tensors == 4
    with pytest.raises(ConfigError, match="'model.'.*app"):
        export_safetensors(tmp_path / "ck", tmp_path / "none", prefix="model.")
    with pytest.raises(CheckpointExistsError):
        export_safetensors(tmp_path / "ck", tmp_path / "m", prefix="app.model.")


def test_exclude_adds_to_the_default_which_no_default_exclude_drops(tmp_path: Path) -> None:
    state = {"net": {"w": torch.ones(3), "lora_a": torch.ones(2)}, "optim": {"exp_avg": torch.ones(3)},
             "optimizer_states": {"0": {"m": torch.ones(1)}}}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    export_safetensors(tmp_path / "ck", tmp_path / "a", exclude=["*.lora_*"])
    assert sorted(load_file(str(tmp_path / "a" / WEIGHTS_NAME))) == ["net.w"]  # optimizer state still left out
    export_safetensors(tmp_path / "ck", tmp_path / "b", exclude=["*.lora_*"], default_exclude=False)
    assert sorted(load_file(str(tmp_path / "b" / WEIGHTS_NAME))) == ["net.w", "optim.exp_avg", "optimizer_states.0.m"]
    run = cli("export", tmp_path / "ck", tmp_path / "c", "--exclude", "*.lora_*", "--json")
    assert run.returncode == 0, run.stderr
    assert sorted(load_file(str(tmp_path / "c" / WEIGHTS_NAME))) == ["net.w"]
    run = cli("export", tmp_path / "ck", tmp_path / "d", "--no-default-exclude")
    assert run.returncode == 0, run.stderr
    assert len(load_file(str(tmp_path / "d" / WEIGHTS_NAME))) == 4


def test_an_overwrite_leaves_no_shard_of_the_old_export(tmp_path: Path) -> None:
    state = {"model": {f"l{i}": torch.randn(1000) for i in range(4)}}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    export_safetensors(tmp_path / "ck", tmp_path / "hf", prefix="model.", max_shard_size=4000)
    assert len(os.listdir(tmp_path / "hf")) == 5
    export_safetensors(tmp_path / "ck", tmp_path / "hf", prefix="model.", overwrite=True)
    assert os.listdir(tmp_path / "hf") == [WEIGHTS_NAME]
    _same(load_file(str(tmp_path / "hf" / WEIGHTS_NAME)), state["model"])


def test_an_interrupted_overwrite_never_looks_like_a_whole_export(tmp_path: Path, monkeypatch) -> None:
    """An overwrite that dies after 2 of 4 shards: the old index (naming the new shards 1-2 and the old 3-4) is gone
    before the first shard is replaced, so import refuses the directory instead of loading a mix of two exports."""
    from dcp_tiered.inspect import safetensors_export

    old = {"model": {f"l{i}": torch.zeros(1000) for i in range(4)}}
    new = {"model": {f"l{i}": torch.ones(1000) for i in range(4)}}
    for name, state in (("old", old), ("new", new)):
        dcp.save(state, storage_writer=CompressedWriter(tmp_path / name), no_dist=True)
    export_safetensors(tmp_path / "old", tmp_path / "hf", prefix="model.", max_shard_size=4000)
    write, written = safetensors_export._write_shard, []

    def crashing(*args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt("killed mid-export")
        written.append(args[1])
        return write(*args, **kwargs)

    monkeypatch.setattr(safetensors_export, "_write_shard", crashing)
    with pytest.raises(KeyboardInterrupt):
        export_safetensors(tmp_path / "new", tmp_path / "hf", prefix="model.", max_shard_size=4000, overwrite=True)
    assert INDEX_NAME not in os.listdir(tmp_path / "hf")
    with pytest.raises(CheckpointNotFoundError, match=INDEX_NAME):
        import_safetensors(tmp_path / "hf", tmp_path / "mixed")
    monkeypatch.undo()
    export_safetensors(tmp_path / "new", tmp_path / "hf", prefix="model.", max_shard_size=4000, overwrite=True)
    _same(_read_export(tmp_path / "hf")[0], new["model"])
    # a sharded overwrite of a one-file export removes the old model.safetensors first: no old whole file to load
    export_safetensors(tmp_path / "old", tmp_path / "one", prefix="model.")
    monkeypatch.setattr(safetensors_export, "_write_shard", crashing)
    written.clear()
    with pytest.raises(KeyboardInterrupt):
        export_safetensors(tmp_path / "new", tmp_path / "one", prefix="model.", max_shard_size=4000, overwrite=True)
    assert WEIGHTS_NAME not in os.listdir(tmp_path / "one")
    with pytest.raises(CheckpointNotFoundError):
        import_safetensors(tmp_path / "one", tmp_path / "mixed")


def test_a_shard_the_disk_refuses_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    """``/proc/self`` takes no new file: the safetensors library's I/O error is a StorageError (exit 5) naming the
    shard and DST, not an internal error."""
    dcp.save({"model": {"w": torch.ones(4)}}, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    with pytest.raises(StorageError, match=r"/proc/self/model\.safetensors.*DST /proc/self"):
        export_safetensors(tmp_path / "ck", "/proc/self", prefix="model.")
    run = cli("export", tmp_path / "ck", "/proc/self", "--prefix", "model.")
    assert run.returncode == 5 and "model.safetensors" in run.stderr and "internal error" not in run.stderr, run.stderr


@pytest.mark.parametrize("name", ["__metadata__", "a\tb", "x" * 5000])
def test_a_name_import_would_refuse_is_refused_by_export_up_front(tmp_path: Path, name: str) -> None:
    """One name rule for both: ``__metadata__`` (the header's own key: an unreadable file), a name that is not printable
    or too long are refused before anything is written, naming the key and the way out (--exclude, --prefix)."""
    dcp.save({"model": {name: torch.ones(2), "w": torch.ones(2)}}, storage_writer=CompressedWriter(tmp_path / "ck"),
             no_dist=True)
    with pytest.raises(ConfigError, match=r"--exclude.*--prefix") as raised:
        export_safetensors(tmp_path / "ck", tmp_path / "hf", prefix="model.")
    assert repr(f"model.{name}")[:60] in str(raised.value)
    assert not (tmp_path / "hf").exists()
    export_safetensors(tmp_path / "ck", tmp_path / "hf", prefix="model.", exclude=[f"model.{name}"])
    assert list(load_file(str(tmp_path / "hf" / WEIGHTS_NAME))) == ["w"]


def test_messages_say_what_is_wrong_and_what_to_do(tmp_path: Path) -> None:
    """A shard size of 0, an index naming a shard that is not there, an empty DST (which wrote into the current
    directory)."""
    dcp.save({"model": {"w": torch.ones(4)}}, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    zero = cli("export", tmp_path / "ck", tmp_path / "hf", "--max-shard-size", "0")
    assert zero.returncode == 2 and "--max-shard-size" in zero.stderr and "at least 1 byte" in zero.stderr, zero.stderr
    lots = cli("export", tmp_path / "ck", tmp_path / "hf", "--max-shard-size", "lots")
    assert lots.returncode == 2 and "cannot read 'lots' as a size" in lots.stderr, lots.stderr
    with pytest.raises(ConfigError, match="empty"):
        export_safetensors(tmp_path / "ck", "", prefix="model.")
    work = tmp_path / "cwd"
    work.mkdir()
    empty = cli("export", tmp_path / "ck", "", cwd=work)
    assert empty.returncode == 2 and "DST" in empty.stderr and os.listdir(work) == [], empty.stderr
    hf = _shards(tmp_path)
    _index(hf, {"a": "model-00001-of-00001.safetensors", "gone": "model-00002-of-00002.safetensors"})
    with pytest.raises(MissingFileError, match=r"index\.json names model-00002-of-00002\.safetensors for tensor 'gone'"
                       r".*re-download.*re-export"):
        import_safetensors(hf, tmp_path / "ck2")
    assert not (tmp_path / "ck2").exists()


def test_export_from_and_import_to_s3(tmp_path: Path, s3_bucket: tuple, minilm: dict) -> None:
    bucket, opts = s3_bucket
    dcp.save(_training_state(minilm), storage_writer=CompressedWriter(f"{bucket}/run/step_000000100", storage_options=opts),
             no_dist=True)
    export_safetensors(f"{bucket}/run/step_000000100", f"{bucket}/hf", prefix="model.", max_shard_size="40MB",
                       src_options=opts, dst_options=opts)
    import_safetensors(f"{bucket}/hf", tmp_path / "ck", prefix="model.", src_options=opts)
    export_safetensors(tmp_path / "ck", tmp_path / "hf", prefix="model.", max_shard_size="40MB")
    back, index = _read_export(tmp_path / "hf")
    _same(back, minilm)
    assert index is not None


def test_an_upload_that_fails_once_is_retried(tmp_path: Path, s3_bucket: tuple, monkeypatch) -> None:
    """Shards go through the storage layer's commit: a transient upload failure does not fail the export."""
    bucket, opts = s3_bucket
    state = {"model": {f"l{i}": torch.randn(1000) for i in range(3)}}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    fs_class = type(Storage(f"{bucket}/hf", opts).fs)
    put, calls = fs_class.put_file, []

    def flaky(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise OSError(5, "injected transient I/O error")
        return put(self, *args, **kwargs)

    monkeypatch.setattr(fs_class, "put_file", flaky)
    res = export_safetensors(tmp_path / "ck", f"{bucket}/hf", prefix="model.", max_shard_size=4000, dst_options=opts)
    assert len(calls) == 4 and len(res.files) == 3
    monkeypatch.undo()
    import_safetensors(f"{bucket}/hf", tmp_path / "back", prefix="model.", src_options=opts)
    _same(load_any(tmp_path / "back")["model"], state["model"])


def test_a_local_export_replaces_a_planted_link_and_leaves_no_temp(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(10)}}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    (tmp_path / "victim").write_bytes(b"victim")
    (tmp_path / "hf").mkdir()
    os.symlink(tmp_path / "victim", tmp_path / "hf" / WEIGHTS_NAME)
    export_safetensors(tmp_path / "ck", tmp_path / "hf", prefix="model.", overwrite=True)
    assert (tmp_path / "victim").read_bytes() == b"victim" and not (tmp_path / "hf" / WEIGHTS_NAME).is_symlink()
    assert os.listdir(tmp_path / "hf") == [WEIGHTS_NAME]
    _same(load_file(str(tmp_path / "hf" / WEIGHTS_NAME)), state["model"])


def _shards(tmp_path: Path) -> Path:
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(4), "b": torch.zeros(2)}, str(hf / "model-00001-of-00001.safetensors"))
    return hf


def _index(hf: Path, weight_map: object) -> Path:
    (hf / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf / INDEX_NAME


def test_hostile_indexes_are_refused_naming_the_file_and_key(tmp_path: Path) -> None:
    hf = _shards(tmp_path)
    (tmp_path / "x").write_bytes(b"outside")
    for weight_map, error, words in (
        ({"a": "../x"}, UnsafeCheckpointError, "'a'"),
        ({"a": "/etc/passwd"}, UnsafeCheckpointError, "'a'"),
        ({"a": "model-00001-of-00001.safetensors", "c": "model-00001-of-00001.safetensors"}, CorruptCheckpointError, "'c'"),
        ({"a": 5}, CorruptCheckpointError, "'a'"),
        ({"a\x00b": "model-00001-of-00001.safetensors"}, UnsafeCheckpointError, "tensor name"),
        ([], CorruptCheckpointError, "weight_map"),
    ):
        index = _index(hf, weight_map)
        with pytest.raises(error, match=words) as raised:
            import_safetensors(index, tmp_path / "ck")
        assert INDEX_NAME in str(raised.value)
        assert not (tmp_path / "ck").exists()
    index.write_text("[" * 100_000)
    with pytest.raises(CorruptCheckpointError, match="not a JSON index"):
        import_safetensors(index, tmp_path / "ck")


def _hub_snapshot(root: Path, files: dict[str, bytes]) -> Path:
    """The Hugging Face hub cache layout: ``blobs/<sha>`` files and ``snapshots/<rev>/<name>`` links to them."""
    import hashlib

    (root / "blobs").mkdir(parents=True)
    snap = root / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (root / "blobs" / sha).write_bytes(data)
        os.symlink(f"../../blobs/{sha}", snap / name)
    return snap


def test_a_hugging_face_hub_snapshot_imports_as_is(tmp_path: Path, minilm_path: Path, minilm: dict) -> None:
    """``snapshots/<rev>/*`` are links into ``blobs/``: import follows a link to a regular file (a directory, a file or
    an index given), and still refuses links to a FIFO, a device or a directory."""
    keys = sorted(minilm)
    shards = {f"model-{i + 1:05d}-of-00002.safetensors": part for i, part in enumerate((keys[:40], keys[40:]))}
    files = {name: save({k: minilm[k] for k in part}, metadata={"format": "pt"})
             for name, part in shards.items()}
    files[INDEX_NAME] = json.dumps({"metadata": {}, "weight_map": {k: n for n, part in shards.items() for k in part}}).encode()
    snap = _hub_snapshot(tmp_path / "models--x", files)
    for src in (snap, snap / INDEX_NAME):
        res = import_safetensors(src, tmp_path / "ck" / src.name, prefix="model.")
        assert res.tensors == len(minilm)
        _same(load_any(tmp_path / "ck" / src.name)["model"], minilm)
    one = _hub_snapshot(tmp_path / "models--one", {WEIGHTS_NAME: (minilm_path / WEIGHTS_NAME).read_bytes()})
    for src in (one, one / WEIGHTS_NAME):
        import_safetensors(src, tmp_path / "one" / src.name)
        _same(load_any(tmp_path / "one" / src.name), minilm)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "adir").mkdir()
    for i, target in enumerate((tmp_path / "fifo", "/dev/zero", tmp_path / "adir")):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        os.symlink(target, bad / WEIGHTS_NAME)
        for src in (bad, bad / WEIGHTS_NAME) if i < 2 else (bad,):  # a link to a directory given is that directory
            with pytest.raises(UnsafeCheckpointError, match="regular file"):
                import_safetensors(src, tmp_path / "never")
    (tmp_path / "huge.bin").write_bytes(struct.pack("<Q", 2**63) + b"{}")  # the header bound holds through a link
    os.symlink(tmp_path / "huge.bin", tmp_path / "bad0" / "model-linked.safetensors")
    with pytest.raises(CorruptCheckpointError, match="header"):
        import_safetensors(tmp_path / "bad0" / "model-linked.safetensors", tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_hostile_headers_are_refused_before_the_library_parses_them(tmp_path: Path) -> None:
    for name, data in (("huge.safetensors", struct.pack("<Q", 2**63) + b"{}"),
                       ("past_end.safetensors", struct.pack("<Q", 1000) + b"{}"),
                       ("short.safetensors", b"\x01\x02"),
                       ("bad_json.safetensors", struct.pack("<Q", 4) + b"{{{{"),
                       ("bad_offsets.safetensors", _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CorruptCheckpointError, match=name):
            import_safetensors(tmp_path / name, tmp_path / "ck")
        assert not (tmp_path / "ck").exists()


def test_a_dtype_torch_cannot_hold_is_refused_naming_the_file_and_tensor(tmp_path: Path) -> None:
    raw = json.dumps({"w": {"dtype": "F6_E2M3", "shape": [16], "data_offsets": [0, 12]}}).encode()
    (tmp_path / "fp6.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 12)
    with pytest.raises(CorruptCheckpointError, match=r"fp6\.safetensors.*tensor 'w'.*re-export"):
        import_safetensors(tmp_path / "fp6.safetensors", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def _header(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * 16


def test_the_commands_export_and_import(tmp_path: Path, minilm: dict) -> None:
    tier = Tier("local", str(tmp_path / "local"))
    with TieredCheckpointer([tier]) as ckpt:
        ckpt.save_now(5, _training_state(minilm))
    by_step = cli("export", "5", tmp_path / "hf", "--local-path", tmp_path / "local", "--prefix", "model.",
                  "--max-shard-size", "30MB", "--json")
    assert by_step.returncode == 0, by_step.stderr
    doc = json.loads(by_step.stdout)
    assert doc["tensors"] == len(minilm) and doc["index"] == INDEX_NAME and len(doc["files"]) > 1
    _same(_read_export(tmp_path / "hf")[0], minilm)
    again = cli("export", tmp_path / "local" / "step_000000005", tmp_path / "hf", "--prefix", "model.")
    assert again.returncode == 2 and "--overwrite" in again.stderr
    latest = cli("export", "latest", tmp_path / "bf16", "--local-path", tmp_path / "local", "--prefix", "model",
                 "--dtype", "bf16")
    assert latest.returncode == 0 and "bf16" in latest.stdout, latest.stderr
    assert load_file(str(tmp_path / "bf16" / WEIGHTS_NAME))["embeddings.word_embeddings.weight"].dtype == torch.bfloat16
    bad_size = cli("export", "5", tmp_path / "x", "--local-path", tmp_path / "local", "--max-shard-size", "lots")
    assert bad_size.returncode == 2 and "--max-shard-size" in bad_size.stderr
    missing = cli("export", "6", tmp_path / "x", "--local-path", tmp_path / "local")
    assert missing.returncode == 3 and "[5]" in missing.stderr
    imported = cli("import", tmp_path / "hf", tmp_path / "ck", "--prefix", "model.", "--codec", "zstd:3")
    assert imported.returncode == 0 and "zstd:3" in imported.stdout, imported.stderr
    _same(load_any(tmp_path / "ck")["model"], minilm)
    (tmp_path / "hf" / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    hostile = cli("import", tmp_path / "hf", tmp_path / "ck3")
    assert hostile.returncode == 4 and INDEX_NAME in hostile.stderr and len(hostile.stderr.strip().splitlines()) == 1


# A state of 24 tensors of 16 MiB (384 MiB), exported in 32 MiB shards and imported back.
_MEMORY_CHILD = """
    import os, torch
    from dcp_tiered.inspect import export_safetensors, import_safetensors, open_reader

    def peak(call):
        base = reset_peak()
        call()
        return status("VmHWM") - base

    reader = open_reader({ck!r})
    out = {{"export": peak(lambda: export_safetensors(reader, {hf!r}, prefix="model.", max_shard_size={shard})),
            "bf16": peak(lambda: export_safetensors(reader, {bf16!r}, prefix="model.", max_shard_size={shard},
                                                    dtype=torch.bfloat16)),
            "import": peak(lambda: import_safetensors({hf!r}, {ck2!r}, prefix="model."))}}
    emit(out)
"""
SHARD = 32 << 20
ALLOWANCE = 64 << 20  # the reader's frames and decode buffers, the writer's frames in flight, the allocator


def test_peak_memory_is_one_shard_plus_a_bound(tmp_path: Path) -> None:
    """The extra resident memory of an export (and of an import) of a 384 MiB state in 32 MiB shards stays
    within one shard, one load group and a fixed allowance, far under the state's size.  Large buffers are
    mmap'd (``MALLOC_MMAP_THRESHOLD_``) so that freed memory leaves the process and the peak counts what is held."""
    from dcp_tiered.inspect.safetensors_export import LOAD_GROUP_BYTES

    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}.weight": torch.randn(4 << 20, generator=g) for i in range(24)}}
    dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck", codec="zstd:1"), no_dist=True)
    total = sum(t.numel() * t.element_size() for t in state["model"].values())
    del state
    paths = {n: str(tmp_path / n) for n in ("ck", "hf", "bf16", "ck2")}
    res = run_isolated(_MEMORY_CHILD.format(shard=SHARD, **paths), timeout=300, memory_mb=4096,
                       env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert res.returncode == 0, res.describe()
    assert len(os.listdir(tmp_path / "hf")) == 13  # 12 shards and the index
    for what, extra in res.result.items():
        bound = SHARD + min(SHARD, LOAD_GROUP_BYTES) + ALLOWANCE
        assert extra <= bound <= total // 3, f"{what}: {extra >> 20} MiB extra, bound {bound >> 20} MiB"


def _lightning_plugin_run(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A real Lightning run with ``CompressedCheckpointIO``: its ``last.ckpt`` (a directory) and the trained weights."""
    pytest.importorskip("lightning")
    import importlib.util

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dcp_tiered.integrations.lightning import CompressedCheckpointIO

    spec = importlib.util.spec_from_file_location("lightning_io_script", Path(__file__).with_name("lightning_io_script.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # type: ignore[union-attr]
    L.seed_everything(0, verbose=False)
    model = script.Net(hidden=16)
    L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
              callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)],
              plugins=[CompressedCheckpointIO()]).fit(model, script.data())
    assert (tmp_path / "ckpts" / "last.ckpt").is_dir()
    return tmp_path / "ckpts" / "last.ckpt", {k: v.clone() for k, v in model.state_dict().items()}


def test_a_lightning_plugin_checkpoint_exports_its_state_dict_by_name(tmp_path: Path) -> None:
    last, weights = _lightning_plugin_run(tmp_path)
    res = export_safetensors(last, tmp_path / "hf")
    _same(load_file(str(tmp_path / "hf" / WEIGHTS_NAME)), weights)
    assert res.tensors == len(weights)
    run = cli("export", last, tmp_path / "net", "--prefix", "net.", "--dtype", "bf16")
    assert run.returncode == 0, run.stderr
    out = load_file(str(tmp_path / "net" / WEIGHTS_NAME))
    assert sorted(out) == sorted(k.removeprefix("net.") for k in weights)
    assert torch.equal(out["0.weight"], weights["net.0.weight"].to(torch.bfloat16))
    with pytest.raises(ConfigError, match="'model.'.*net"):
        export_safetensors(last, tmp_path / "none", prefix="model.")


def test_a_torch_save_file_is_refused_naming_the_route(tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "model.ckpt")
    with pytest.raises(ConfigError, match=r"model\.ckpt is a torch\.save file.*dcp-tiered convert"):
        export_safetensors(tmp_path / "model.ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
