"""The codec registry: every registered codec's config, spec and bytes round trip (Hypothesis),
registration rules, hostile spec strings, and a toy codec added exactly as
docs/architecture.md ("A codec.") tells a newcomer, saved and loaded through real DCP."""

from __future__ import annotations

import inspect
import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered.codecs import Codec, FrameCodec, get_codec, register_codec, registered_codecs, unregister_codec
from dcp_tiered.codecs.bytegroup import FILTER_BYTEGROUP, FILTER_BYTEGROUP_SIGNSWAP, FILTER_NONE
from dcp_tiered.codecs.frames import stored_frame_bounds
from dcp_tiered.errors import CodecError, CorruptCheckpointError, UnsupportedFormatError

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


# The toy codec of docs/architecture.md, "A codec." (test_docs_show_this_toy_codec keeps them equal).
class RunLengthCodec(Codec):
    """(count, byte) pairs. Spec "rle", or "rle:N" with N (2..255) the longest run per pair."""

    codec_id = "rle"
    spec_help = "rle, rle:N (N in 2..255)"  # how the specs read in error messages

    def __init__(self, max_run: int = 255) -> None:
        if type(max_run) is not int or not 2 <= max_run <= 255:
            raise ValueError(f"max_run must be an integer 2..255, got {max_run!r}")
        self.max_run = max_run

    # spec string <-> config: "rle:N" <-> {"id": "rle", "max_run": N}; "rle" <-> max_run 255
    @classmethod
    def config_from_arg(cls, arg: str | None) -> dict[str, Any]:
        return {} if arg is None else {"max_run": int(arg)}

    def spec_arg(self) -> str | None:
        return None if self.max_run == 255 else str(self.max_run)

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "max_run": self.max_run}

    def min_stored_size(self, raw_len: int) -> int:
        return 2 * -(-raw_len // self.max_run)  # at best one pair per max_run bytes

    def compress(self, data: object) -> bytes:
        out = bytearray()
        for value, run in itertools.groupby(memoryview(data).cast("B")):
            n = sum(1 for _ in run)
            while n:
                k = min(n, self.max_run)
                out += bytes((k, value))
                n -= k
        return bytes(out)

    def decompress(self, data: object, raw_len: int) -> bytes:
        src = bytes(memoryview(data).cast("B"))
        counts, values = src[0::2], src[1::2]
        if len(src) % 2 or sum(counts) != raw_len:  # checked before allocating
            raise CorruptCheckpointError(f"rle block does not decode to {raw_len} bytes")
        return b"".join(bytes((v,)) * n for n, v in zip(counts, values))


@contextmanager
def rle_registered() -> Iterator[None]:
    register_codec(RunLengthCodec)
    try:
        yield
    finally:
        unregister_codec("rle")


@pytest.fixture
def rle() -> Iterator[None]:
    with rle_registered():
        yield


def test_docs_show_this_toy_codec() -> None:
    doc = DOC.read_text()
    assert inspect.getsource(RunLengthCodec) in doc
    assert "register_codec(RunLengthCodec)" in doc


# -- every registered codec ----------------------------------------------------------------
# Parameter strategies for the codecs that take an argument; any other registered codec is
# drawn with its default config (the plain "<id>" spec every codec must accept).
_ARGS = {"zstd": st.integers(1, 22).map(str), "rle": st.integers(2, 255).map(str)}


@st.composite
def codecs(draw: st.DrawFn) -> Codec:
    cid = draw(st.sampled_from(sorted(registered_codecs())))
    arg = draw(st.none() | _ARGS[cid]) if cid in _ARGS else None
    return get_codec(cid if arg is None else f"{cid}:{arg}")


def test_builtin_codecs_are_registered_in_order() -> None:
    assert list(registered_codecs())[:3] == ["none", "lz4", "zstd"]
    assert get_codec("zstd").get_config() == {"id": "zstd", "level": 1}
    assert not get_codec("none").compresses and get_codec("lz4").compresses


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_config_and_spec_round_trip(data: st.DataObject) -> None:
    with rle_registered():
        codec = data.draw(codecs())
        config = codec.get_config()
        assert config["id"] == codec.codec_id and json.loads(json.dumps(config)) == config
        assert get_codec(config) == codec and get_codec(config).get_config() == config
        assert get_codec(codec.spec) == codec and get_codec(codec.spec).spec == codec.spec
        assert str(get_codec(str(codec))) == str(codec) == codec.spec
        assert codec.spec.split(":")[0] == codec.codec_id
        assert get_codec(codec) is codec
        assert get_codec(codec.spec.upper()) == codec  # spec strings are case-insensitive, as before


@settings(max_examples=200, deadline=None)
@given(data=st.data(), raw=st.binary(max_size=3000) | st.binary(max_size=20).map(lambda b: b * 150))
def test_compress_round_trip_and_size_bounds(data: st.DataObject, raw: bytes) -> None:
    with rle_registered():
        codec = data.draw(codecs())
        for c in (codec, codec.tuned_for_planes()):
            block = c.compress(np.frombuffer(raw, dtype=np.uint8))
            assert len(block) >= codec.min_stored_size(len(raw))
            assert bytes(codec.decompress(block, len(raw))) == raw
            if raw:  # a lying raw length is refused, never over-allocated
                for wrong in (len(raw) - 1, len(raw) + 1):
                    with pytest.raises(CorruptCheckpointError):
                        codec.decompress(block, wrong)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), junk=st.binary(max_size=300), raw_len=st.integers(0, 4096))
def test_hostile_blocks_raise_corruption_or_decode_exactly(data: st.DataObject, junk: bytes, raw_len: int) -> None:
    with rle_registered():
        codec = data.draw(codecs())
        try:
            out = codec.decompress(junk, raw_len)
        except CorruptCheckpointError:
            return
        assert len(out) == raw_len


_LAYOUTS = [(FILTER_NONE, 1), (FILTER_BYTEGROUP, 4), (FILTER_BYTEGROUP_SIGNSWAP, 2), (FILTER_BYTEGROUP_SIGNSWAP, 8)]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), raw=st.binary(max_size=4000) | st.binary(max_size=16).map(lambda b: b * 200),
       layout=st.sampled_from(_LAYOUTS))
def test_frames_stay_within_the_declared_bounds(data: st.DataObject, raw: bytes, layout: tuple[str, int]) -> None:
    with rle_registered():
        codec = data.draw(codecs())
        filt, itemsize = layout
        arr = np.frombuffer(raw[: len(raw) - len(raw) % itemsize], dtype=np.uint8)
        fc = FrameCodec(codec.spec, filt, itemsize)
        enc = fc.encode(arr)
        lo, hi = stored_frame_bounds(codec.spec, filt, itemsize, arr.nbytes)
        assert lo <= enc.stored_len <= hi
        out = np.empty_like(arr)
        fc.decode(b"".join(bytes(memoryview(p).cast("B")) for p in enc.pieces), out)
        assert out.tobytes() == arr.tobytes()


# -- registration rules and hostile spec strings --------------------------------------------
class _Plain(Codec):
    codec_id = "plain-test"

    def compress(self, data: object) -> bytes:
        return bytes(memoryview(data).cast("B"))

    def decompress(self, data: object, raw_len: int) -> bytes:
        return bytes(memoryview(data).cast("B"))[:raw_len]


def test_registration_rules() -> None:
    class OtherZstd(_Plain):
        codec_id = "zstd"

    class BadId(_Plain):
        codec_id = "Bad:Id"

    class NoDefault(_Plain):
        codec_id = "no-default"

        def __init__(self, level: int) -> None:
            self.level = level

    for cls in (OtherZstd, BadId, NoDefault, int):
        with pytest.raises(CodecError):
            register_codec(cls)  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        unregister_codec("zstd")
    with pytest.raises(CodecError, match="register_codec"):
        get_codec(_Plain())  # would write checkpoints no reader can open
    assert register_codec(_Plain) is _Plain and register_codec(_Plain) is _Plain  # idempotent
    try:
        assert type(get_codec("plain-test")) is _Plain
        with pytest.raises(CodecError, match="no argument"):
            get_codec("plain-test:3")
    finally:
        unregister_codec("plain-test")
    with pytest.raises(CodecError, match="plain-test"):
        get_codec("plain-test")  # the lookup cache forgets unregistered codecs
    assert list(registered_codecs()) == ["none", "lz4", "zstd"]


@pytest.mark.parametrize("spec", [
    "dcp_tiered.codecs.compressors.ZstdCodec", "ZstdCodec", "__import__('os').system('true')", "os:system",
    "zstd:1" + " " * 100, "x" * 10_000, "codec", "registry", {"id": "ZstdCodec"}, {"level": 3}, b"zstd",
])
def test_hostile_specs_are_refused_without_any_lookup_beyond_the_registry(spec: object) -> None:
    with pytest.raises(CodecError) as err:
        get_codec(spec)  # type: ignore[arg-type]
    assert "zstd" in str(err.value) and len(str(err.value)) < 400


# -- the toy codec through a real DCP save and load ------------------------------------------
def _state() -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    return {
        "zeros": torch.zeros(3000),  # runs: stored compressed by rle
        "steps": torch.arange(5000, dtype=torch.int64) // 700,
        "bf16": torch.ones(2048, dtype=torch.bfloat16) * 0.5,
        "noise": torch.randn(257, generator=g),  # does not shrink: stored raw
        "meta": {"name": "toy", "sizes": [1, 2, 3]},
    }


def _save(path: Path, codec: str) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedWriter

    dcp.save(_state(), storage_writer=CompressedWriter(str(path), codec=codec, sync_files=False), no_dist=True)


@pytest.mark.parametrize(("spec", "stored"), [("rle", "rle"), ("RLE:16", "rle:16"), ("rle:255", "rle")])
def test_toy_codec_saves_and_loads_through_dcp(tmp_path: Path, rle: None, spec: str, stored: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedReader

    _save(tmp_path / "ckpt", spec)
    reader = CompressedReader(str(tmp_path / "ckpt"))
    records = reader.read_metadata().storage_data
    assert {r["codec"] for r in records.values()} == {stored}
    by_key = {k.fqn: r for k, r in records.items()}
    assert by_key["zeros"]["length"] < by_key["zeros"]["raw"] // 4  # rle really ran
    want = _state()
    got = {k: torch.zeros_like(v) for k, v in want.items() if isinstance(v, torch.Tensor)}
    got["meta"] = {"name": "", "sizes": []}
    dcp.load(got, storage_reader=reader, no_dist=True)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
    assert got["meta"] == want["meta"]


def test_unregistered_toy_codec_is_refused_by_writer_and_reader(tmp_path: Path) -> None:
    from dcp_tiered import CompressedReader, CompressedWriter

    with rle_registered():
        _save(tmp_path / "ckpt", "rle:16")
    with pytest.raises(CodecError, match="unknown codec 'rle'"):
        CompressedWriter(str(tmp_path / "other"), codec="rle")
    with pytest.raises(UnsupportedFormatError) as err:
        CompressedReader(str(tmp_path / "ckpt"))
    assert "rle:16" in str(err.value)
    assert "register_codec" in str(err.value.__cause__)


# -- plugin codecs that misbehave (hostile review of issue 13) ------------------------------
class _Zlib(Codec):
    """A plugin codec whose decode fails in the ways third-party code does."""

    codec_id = "zlib-test"
    max_ratio = 1100
    failure: Any = None

    def compress(self, data: object) -> bytes:
        import zlib

        return zlib.compress(bytes(memoryview(data).cast("B")))

    def decompress(self, data: object, raw_len: int) -> Any:
        import zlib

        if isinstance(self.failure, BaseException):
            raise self.failure
        if self.failure is not None:
            return self.failure
        return zlib.decompress(bytes(memoryview(data).cast("B")))


@pytest.mark.parametrize("failure", [
    __import__("struct").error("bad"), __import__("zlib").error("bad"), RuntimeError("boom"), AssertionError(),
    RecursionError(), object(), "not bytes", [0, 1],
], ids=lambda f: type(f).__name__)
def test_plugin_decode_failures_are_corruption(failure: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    register_codec(_Zlib)
    try:
        fc = FrameCodec("zlib-test")
        raw = np.zeros(8192, dtype=np.uint8)
        stored = b"".join(bytes(memoryview(p).cast("B")) for p in fc.encode(raw).pieces)
        monkeypatch.setattr(_Zlib, "failure", failure)
        with pytest.raises(CorruptCheckpointError, match="zlib-test"):
            fc.decode(stored, np.empty_like(raw))
    finally:
        unregister_codec("zlib-test")


def test_plugin_codec_beating_its_declared_bound_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compressing codec that keeps the default max_ratio=1 would commit checkpoints every
    reader refuses as crafted (and retention would then delete the last readable one)."""
    monkeypatch.setattr(_Zlib, "max_ratio", 1)
    register_codec(_Zlib)
    try:
        with pytest.raises(CodecError, match="smallest block"):
            FrameCodec("zlib-test").encode(np.zeros(8192, dtype=np.uint8))
        with pytest.raises(BaseException) as err:  # DCP wraps it in its CheckpointException
            _save(tmp_path / "ckpt", "zlib-test")
        assert "smallest block" in str(err.value)
        assert not (tmp_path / "ckpt" / ".metadata").exists()
    finally:
        unregister_codec("zlib-test")
