"""The encode fast path: planes predicted incompressible are stored raw without compressing;
every path still decodes bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered.codecs import FrameCodec, frame_bounds
from dcp_tiered.codecs import frames as frames_mod
from dcp_tiered.codecs.bytegroup import FILTER_BYTEGROUP_SIGNSWAP, SAMPLE_RUN, SAMPLE_RUNS, filter_for, merge_planes, sample_entropy

CODECS = ["lz4", "zstd", "zstd:3", "zstd:19"]


class _Counting:
    """Wraps a FrameCodec's compressor and records the size of every buffer it is asked to compress."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def compress(self, data):
        self.calls.append(memoryview(data).nbytes)
        return self.inner.compress(data)

    def decompress(self, data, raw_len):
        return self.inner.decompress(data, raw_len)


def _plane(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "constant":
        return np.full(n, seed % 256, dtype=np.uint8)
    if kind == "exponent":  # few values, skewed: what the top byte of weights looks like
        return (120 - np.minimum(rng.geometric(0.5, n), 20)).astype(np.uint8)
    half = n // 2  # mixed: a constant run, then random bytes
    return np.concatenate([np.zeros(half, np.uint8), rng.integers(0, 256, n - half, dtype=np.uint8)])


def _modes(stored: bytes, planes: int) -> list[int]:
    return [stored[1 + 5 * k] for k in range(planes)]


def _stored(enc) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in enc.pieces)


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["random", "constant", "exponent", "mixed"]), min_size=8, max_size=8),
    n=st.sampled_from([1, 100, 4096, 40_000, 70_000]),
    seed=st.integers(0, 2**16),
    codec=st.sampled_from(CODECS),
    itemsize=st.sampled_from([2, 4, 8]),
)
def test_planes_of_any_kind_round_trip_and_random_ones_skip_the_compressor(
    kinds: list[str], n: int, seed: int, codec: str, itemsize: int
) -> None:
    planes = [_plane(k, n, seed + i) for i, k in enumerate(kinds[:itemsize])]
    raw = np.empty(n * itemsize, dtype=np.uint8)
    merge_planes(planes, FILTER_BYTEGROUP_SIGNSWAP, itemsize, raw)
    fc = FrameCodec(codec, FILTER_BYTEGROUP_SIGNSWAP, itemsize)
    spy = fc._compressor = _Counting(fc._compressor)
    enc = fc.encode(raw)
    stored = _stored(enc)
    assert len(stored) == enc.stored_len
    out = np.zeros_like(raw)
    fc.decode(stored, out)
    assert out.tobytes() == raw.tobytes()
    if n >= SAMPLE_RUNS * SAMPLE_RUN:
        # A plane of uniform random bytes is stored raw and never handed to the compressor.  The
        # sign swap moves one bit between the top two planes, so only the planes below are as built.
        modes = _modes(stored, itemsize)
        low = range(itemsize - 2)
        assert len(spy.calls) <= itemsize - sum(kinds[k] == "random" for k in low)
        for k in low:
            if kinds[k] == "random":
                assert modes[k] == frames_mod.MODE_RAW
            if kinds[k] == "constant":
                assert modes[k] == frames_mod.MODE_COMPRESSED


def test_random_float_mantissas_are_not_compressed() -> None:
    """Normal weights: the low mantissa bytes are uniform, so only the exponent plane (and the
    byte holding the sign and the top mantissa bit) reach the compressor."""
    w = (np.random.default_rng(1).standard_normal(1 << 18) * 0.02).astype(np.float32)
    raw = w.view(np.uint8)
    for codec in ("zstd", "lz4"):
        fc = FrameCodec(codec, FILTER_BYTEGROUP_SIGNSWAP, 4)
        spy = fc._compressor = _Counting(fc._compressor)
        enc = fc.encode(raw)
        assert len(spy.calls) < 4, codec
        out = np.zeros_like(raw)
        fc.decode(_stored(enc), out)
        assert np.array_equal(out, raw)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 3 * SAMPLE_RUNS * SAMPLE_RUN), alphabet=st.integers(1, 256), seed=st.integers(0, 2**16))
def test_native_entropy_matches_numpy_reference(n: int, alphabet: int, seed: int) -> None:
    from dcp_tiered.codecs import bytegroup

    if bytegroup._native_entropy is None:
        pytest.skip("native kernel not built")
    plane = np.random.default_rng(seed).integers(0, alphabet, n).astype(np.uint8)
    assert sample_entropy(plane) == pytest.approx(sample_entropy(plane, native=False), abs=1e-9)


def test_entropy_of_known_planes() -> None:
    assert sample_entropy(np.zeros(0, np.uint8)) == 0.0
    assert sample_entropy(np.full(1 << 20, 7, np.uint8)) == 0.0
    assert sample_entropy(np.arange(256, dtype=np.uint8)) == pytest.approx(8.0)
    assert sample_entropy(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)) > 7.98
    assert sample_entropy(np.tile(np.array([0, 1], np.uint8), 1 << 19)) == pytest.approx(1.0)


def test_native_entropy_rejects_bad_sample_shape() -> None:
    from dcp_tiered.codecs import bytegroup

    if bytegroup._native_entropy is None:
        pytest.skip("native kernel not built")
    for runs, run in ((0, 256), (64, 0), (1 << 17, 256)):
        with pytest.raises(ValueError):
            bytegroup._native.entropy(b"abc", runs, run)


@pytest.mark.parametrize("codec", ["zstd:1", "lz4"])
@pytest.mark.parametrize("as_bf16", [False, True])
def test_prediction_stores_real_weights_no_larger(minilm_path, monkeypatch, codec: str, as_bf16: bool) -> None:
    """Skipping the compressor on predicted planes never costs ratio on real weights."""
    import torch
    from safetensors.torch import load_file

    w = load_file(str(minilm_path / "model.safetensors"))
    t = torch.cat([v.reshape(-1).float() for k, v in sorted(w.items()) if "layer.1." in k or "embeddings" in k])
    t = t.bfloat16() if as_bf16 else t
    raw = t.view(torch.uint8).numpy()[: 12 << 20].copy()
    fc = FrameCodec(codec, filter_for(True, t.element_size()), t.element_size())

    def stored() -> int:
        return sum(fc.encode(raw[a:b]).stored_len for a, b in frame_bounds(raw.nbytes, 4 << 20, t.element_size()))

    predicted = stored()
    monkeypatch.setattr(frames_mod, "RAW_ENTROPY_BITS", 9.0)  # never predict: try every plane
    assert predicted <= stored()


def test_prediction_without_the_native_entropy_kernel(monkeypatch) -> None:
    """A kernel built from an older C file (no entropy function) falls back to numpy, same decision."""
    from dcp_tiered.codecs import bytegroup

    monkeypatch.setattr(bytegroup, "_native_entropy", None)
    raw = np.random.default_rng(2).integers(0, 256, 1 << 18, dtype=np.uint8)
    fc = FrameCodec("zstd", FILTER_BYTEGROUP_SIGNSWAP, 4)
    spy = fc._compressor = _Counting(fc._compressor)
    enc = fc.encode(raw)
    assert spy.calls == []
    out = np.zeros_like(raw)
    fc.decode(_stored(enc), out)
    assert np.array_equal(out, raw)
