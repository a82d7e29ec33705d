"""Codecs, the byte-group filter and frames: round trips (Hypothesis) and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered.codecs import FILTERS, FrameCodec, frame_bounds, get_codec
from dcp_tiered.codecs.bytegroup import FILTER_BYTEGROUP, FILTER_BYTEGROUP_SIGNSWAP, FILTER_NONE, filter_for
from dcp_tiered.errors import CodecError, CorruptCheckpointError

CODECS = ["none", "lz4", "zstd", "zstd:3", "zstd:19"]


@pytest.mark.parametrize(
    ("spec", "text"),
    [("none", "none"), ("lz4", "lz4"), ("zstd", "zstd:1"), ("zstd:1", "zstd:1"), ("ZSTD:22", "zstd:22"), (" zstd:7 ", "zstd:7")],
)
def test_parse_codec_accepts_valid_specs(spec: str, text: str) -> None:
    assert str(get_codec(spec)) == text


@pytest.mark.parametrize("spec", ["zstd:0", "zstd:23", "zstd:-1", "zstd:x", "gzip", "lz4:3", "", "none:1", 3, None])
def test_parse_codec_rejects_with_the_valid_list(spec: object) -> None:
    with pytest.raises(CodecError) as err:
        get_codec(spec)  # type: ignore[arg-type]
    assert isinstance(err.value, ValueError)
    assert "zstd" in str(err.value)


def test_filter_choice() -> None:
    assert filter_for(True, 4) == FILTER_BYTEGROUP_SIGNSWAP
    assert filter_for(True, 8) == FILTER_BYTEGROUP_SIGNSWAP
    assert filter_for(True, 2) == FILTER_BYTEGROUP_SIGNSWAP
    assert filter_for(True, 1) == FILTER_NONE
    assert filter_for(False, 4) == FILTER_NONE
    assert filter_for(True, 4, enabled=False) == FILTER_NONE


def _stored(enc) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in enc.pieces)


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(max_size=5000),
    codec=st.sampled_from(CODECS),
    layout=st.sampled_from([(FILTER_NONE, 1), (FILTER_BYTEGROUP, 4), (FILTER_BYTEGROUP_SIGNSWAP, 4), (FILTER_BYTEGROUP_SIGNSWAP, 8), (FILTER_BYTEGROUP_SIGNSWAP, 2)]),
)
def test_frame_round_trip_any_bytes(data: bytes, codec: str, layout: tuple[str, int]) -> None:
    filt, itemsize = layout
    data = data[: len(data) - len(data) % itemsize]
    raw = np.frombuffer(data, dtype=np.uint8)
    fc = FrameCodec(codec, filt, itemsize)
    enc = fc.encode(raw)
    stored = _stored(enc)
    assert len(stored) == enc.stored_len
    out = np.empty_like(raw)
    fc.decode(stored, out)
    assert out.tobytes() == data


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(width=16, allow_nan=True, allow_infinity=True), min_size=1, max_size=3000),
    codec=st.sampled_from(CODECS),
)
def test_float_frames_round_trip_bit_exact(values: list[float], codec: str) -> None:
    for dtype, filt in ((np.float32, FILTER_BYTEGROUP_SIGNSWAP), (np.float16, FILTER_BYTEGROUP_SIGNSWAP), (np.float64, FILTER_BYTEGROUP_SIGNSWAP), (np.float32, FILTER_BYTEGROUP)):
        arr = np.asarray(values, dtype=dtype)
        raw = arr.view(np.uint8)
        fc = FrameCodec(codec, filt, arr.itemsize)
        out = np.empty_like(raw)
        fc.decode(_stored(fc.encode(raw)), out)
        assert out.tobytes() == raw.tobytes()


def test_incompressible_planes_are_stored_raw() -> None:
    rng = np.random.default_rng(0)
    raw = np.frombuffer(rng.bytes(1 << 16), dtype=np.uint8)
    enc = FrameCodec("zstd", FILTER_NONE, 1).encode(raw)
    # header (1 + 5 bytes) + the raw plane, not a bigger compressed one
    assert enc.stored_len == 6 + raw.nbytes


def test_float_planes_compress_exponents() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(1 << 16) * 0.02).astype(np.float32)
    enc = FrameCodec("zstd", FILTER_BYTEGROUP, 4).encode(w.view(np.uint8))
    assert enc.stored_len < 0.9 * w.nbytes


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_decode_rejects_bad_frames(codec: str) -> None:
    raw = np.arange(4096, dtype=np.float32).view(np.uint8)
    fc = FrameCodec(codec, FILTER_BYTEGROUP, 4)
    stored = bytearray(_stored(fc.encode(raw)))
    out = np.empty_like(raw)
    with pytest.raises(CorruptCheckpointError):
        fc.decode(bytes(stored[:-3]), out)  # truncated
    with pytest.raises(CorruptCheckpointError):
        fc.decode(bytes(stored) + b"xx", out)  # trailing bytes
    with pytest.raises(CorruptCheckpointError):
        fc.decode(b"", out)
    with pytest.raises(CorruptCheckpointError):
        fc.decode(bytes(stored), np.empty(raw.nbytes * 2, dtype=np.uint8))  # lying raw length


def test_zstd_bomb_is_bounded() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
    header = bytes([1, 1]) + len(bomb).to_bytes(4, "little")
    out = np.empty(1024, dtype=np.uint8)
    with pytest.raises(CorruptCheckpointError):
        FrameCodec("zstd", FILTER_NONE, 1).decode(header + bomb, out)


@pytest.mark.parametrize(("raw_len", "frame", "itemsize"), [(0, 4096, 4), (10, 4096, 2), (4096, 4096, 4), (4097 * 4, 4096, 4), (30, 7, 3)])
def test_frame_bounds_cover_exactly(raw_len: int, frame: int, itemsize: int) -> None:
    bounds = frame_bounds(raw_len, frame, itemsize)
    assert sum(e - s for s, e in bounds) == raw_len
    assert all(s % itemsize == 0 for s, _ in bounds)
    assert all(b[1] == nb[0] for b, nb in zip(bounds, bounds[1:]))


def test_unknown_filter_is_a_format_error() -> None:
    from dcp_tiered.errors import UnsupportedFormatError

    with pytest.raises(UnsupportedFormatError):
        FrameCodec("zstd", "shuffle9", 4)
    assert set(FILTERS) == {FILTER_NONE, FILTER_BYTEGROUP, FILTER_BYTEGROUP_SIGNSWAP}


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=4000), layout=st.sampled_from([(FILTER_BYTEGROUP, 4), (FILTER_BYTEGROUP_SIGNSWAP, 2), (FILTER_BYTEGROUP_SIGNSWAP, 4), (FILTER_BYTEGROUP_SIGNSWAP, 8)]))
def test_native_kernel_matches_numpy_reference(data: bytes, layout: tuple[str, int]) -> None:
    from dcp_tiered.codecs import bytegroup

    if bytegroup._native is None:
        pytest.skip("native kernel not built")
    filt, itemsize = layout
    raw = np.frombuffer(data[: len(data) - len(data) % itemsize], dtype=np.uint8)
    ref = bytegroup.split_planes(raw, filt, itemsize, native=False)
    nat = bytegroup.split_planes(raw, filt, itemsize, native=True)
    assert [p.tobytes() for p in ref] == [p.tobytes() for p in nat]
    out_ref, out_nat = np.empty_like(raw), np.empty_like(raw)
    bytegroup.merge_planes(ref, filt, itemsize, out_ref, native=False)
    bytegroup.merge_planes(nat, filt, itemsize, out_nat, native=True)
    assert out_ref.tobytes() == out_nat.tobytes() == raw.tobytes()


@pytest.mark.parametrize("as_bf16", [False, True])
def test_higher_zstd_levels_never_store_real_weights_larger_than_zstd_1(minilm_path, as_bf16: bool) -> None:
    """A user who raises the level for a cold tier must not get a bigger checkpoint."""
    import torch
    from safetensors.torch import load_file

    w = load_file(str(minilm_path / "model.safetensors"))
    t = torch.cat([v.reshape(-1).float() for k, v in sorted(w.items()) if "layer.1." in k])
    t = t.bfloat16() if as_bf16 else t
    raw = t.view(torch.uint8).numpy()[: 8 << 20].copy()
    filt = filter_for(True, t.element_size())

    def stored(codec: str) -> int:
        fc = FrameCodec(codec, filt, t.element_size())
        return sum(fc.encode(raw[a:b]).stored_len for a, b in frame_bounds(raw.nbytes, 4 << 20, t.element_size()))

    base = stored("zstd:1")
    for level in (3, 6, 9):
        assert stored(f"zstd:{level}") <= base * 1.002, f"zstd:{level} stores more than zstd:1"


@pytest.mark.parametrize("raw_len, frame_size, itemsize", [
    (8 * ((1 << 29) + 1), 4096, 8),   # just over 4 GiB of int64 in 4 KiB frames (found by hostile review)
    (2 * ((1 << 21) + 3), 1, 2),
    (12 * (1 << 20) + 36, 4, 12),
    (12 * ((1 << 20) + 1), 13, 12),  # the frame size alone would do, but frames are cut at 12 bytes
])
def test_an_item_too_large_for_its_frame_size_gets_frames_readers_accept(raw_len, frame_size, itemsize) -> None:
    """The frame size is enlarged so that no item needs more than ``MAX_FRAMES_PER_RECORD`` frames (readers
    refuse more), counted after frames are cut at whole elements."""
    from dcp_tiered.codecs.frames import MAX_FRAMES_PER_RECORD, frame_bounds, record_frame_size

    size = record_frame_size(raw_len, frame_size, itemsize)
    assert size >= frame_size and len(frame_bounds(raw_len, size, itemsize)) <= MAX_FRAMES_PER_RECORD
