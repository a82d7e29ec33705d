"""The non-tensor part of DCP's state-dict contract: ``Stateful`` objects, ``io.BytesIO`` values,
objects that need more than ``weights_only`` (numpy, user classes) and the save-time check.

* The DCP tutorial's ``AppState`` (model + optimizer after real steps) round-trips bit-exact
  through ``dcp.load`` with ``CompressedReader`` and through ``load_and_broadcast`` on 4 gloo
  ranks, where every rank's own objects get ``load_state_dict`` (replicas start different).
* ``io.BytesIO`` values are stored as raw bytes (no pickle) and load with the default reader.
* numpy values need ``safe_globals=[...]`` on the writer and the reader: without it the save
  fails (sync and ``async_save``) naming the key and the missing globals, nothing committed.
* Stock ``FileSystemWriter`` checkpoints holding ``BytesIO`` and objects still load.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from speed import scaled
import torch
import torch.distributed.checkpoint as dcp
from gloo_ranks import read_records, record, run_ranks_recording
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dcp_tiered import (
    CompressedReader,
    CompressedWriter,
    ConfigError,
    RestoreError,
    SaveError,
    Tier,
    TieredCheckpointer,
    UnsafeCheckpointError,
    UnsafeObjectError,
    UnsupportedFormatError,
    load_and_broadcast,
    numpy_safe_globals,
)
from dcp_tiered.inspect import load_any as load_state
from dcp_tiered.dcp.format import METADATA_FILE
from dcp_tiered.dcp.metadata_io import decode_metadata, encode_metadata
from dcp_tiered.dcp.objects import OBJECT_BYTESIO, OBJECT_FIELD
from dcp_tiered.dcp.statedict import expand_stateful

WS = 4
SPAWN_TIMEOUT = 300.0
PAYLOAD = bytes(range(256)) * 3 + b"\x80\x02not a pickle."  # raw bytes that are no valid torch.save


# -- the DCP tutorial's AppState ---------------------------------------------------------------


class AppState:
    """The ``Stateful`` wrapper of the DCP tutorial: model + optimizer as one state dict."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Model and optimizer after a few real steps (deterministic in every process)."""
    model, optim = make_model(0)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        optim.zero_grad()
        model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
        optim.step()
    return model, optim


def flat(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything restore must bring back, keyed for comparison."""
    out: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    osd = optim.state_dict()
    for pid, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = v
    out["optim.param_groups"] = osd["param_groups"]
    return out


def diff_states(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    errs = [f"{k}: missing" for k in want if k not in got] + [f"{k}: unexpected" for k in got if k not in want]
    for k in want.keys() & got.keys():
        a, b = got[k], want[k]
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
                errs.append(f"{k}: {a!r} vs {b!r}")
            elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                errs.append(f"{k}: values differ")
        elif a != b:
            errs.append(f"{k}: {a!r} != {b!r}")
    return errs


def check_app(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    want = flat(*trained())
    errs = diff_states(flat(model, optim), want)
    assert not errs, "restored AppState differs:\n  " + "\n  ".join(errs)


@dataclasses.dataclass
class RunInfo:
    """A user class: needs an explicit opt-in to be restored."""

    name: str
    seeds: list[int]


def objects_state() -> dict[str, Any]:
    """Non-tensor values stock DCP round-trips, beside a tensor."""
    rs = np.random.RandomState(7)
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "buf": io.BytesIO(PAYLOAD),
        "empty_buf": io.BytesIO(),
        "extra": {"rng": rs.get_state(), "arr": rs.standard_normal((3, 5)), "scalar": np.float64(2.5)},
        "info": RunInfo("run-1", [1, 2]),
        "epoch": 3,
    }


def objects_template() -> dict[str, Any]:
    return {"w": torch.zeros(3, 4), "buf": io.BytesIO(b"stale"), "empty_buf": io.BytesIO(b"x"),
            "extra": {"rng": None, "arr": None, "scalar": None}, "info": None, "epoch": 0}


def check_objects(got: dict[str, Any]) -> None:
    want = objects_state()
    assert torch.equal(got["w"], want["w"])
    assert isinstance(got["buf"], io.BytesIO) and got["buf"].getvalue() == PAYLOAD
    assert isinstance(got["empty_buf"], io.BytesIO) and got["empty_buf"].getvalue() == b""
    rng, ref = got["extra"]["rng"], want["extra"]["rng"]
    assert rng[0] == ref[0] and np.array_equal(rng[1], ref[1]) and rng[1].dtype == ref[1].dtype and rng[2:] == ref[2:]
    assert np.array_equal(got["extra"]["arr"], want["extra"]["arr"]) and got["extra"]["arr"].dtype == np.float64
    assert got["extra"]["scalar"] == 2.5 and isinstance(got["extra"]["scalar"], np.float64)
    assert got["info"] == want["info"] and got["epoch"] == 3


TRUST = [*numpy_safe_globals(), RunInfo]


def failures(exc: BaseException) -> list[BaseException]:
    """The errors DCP collected in a CheckpointException (the originals stay reachable)."""
    assert isinstance(exc, CheckpointException), exc
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


def records(path: Path) -> dict[str, dict]:
    md = CompressedReader(path).read_metadata()
    return {idx.fqn: rec for idx, rec in md.storage_data.items()}


# -- AppState through dcp.load --------------------------------------------------------------------


def test_appstate_round_trips_bit_exact_through_dcp_load(tmp_path: Path) -> None:
    model, optim = trained()
    dcp.save({"app": AppState(model, optim)}, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    model2, optim2 = make_model(5)  # different initial weights, no optimizer state
    dcp.load({"app": AppState(model2, optim2)}, storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    check_app(model2, optim2)


def test_appstate_through_load_and_broadcast_without_a_group(tmp_path: Path) -> None:
    model, optim = trained()
    dcp.save({"app": AppState(model, optim), "step": 40}, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    model2, optim2 = make_model(5)
    sd: dict[str, Any] = {"app": AppState(model2, optim2), "step": 0}
    load_and_broadcast(sd, str(tmp_path / "ck"))
    check_app(model2, optim2)
    assert sd["step"] == 40 and isinstance(sd["app"], AppState)


# -- BytesIO ----------------------------------------------------------------------------------------


def test_bytesio_round_trips_as_raw_bytes_with_the_default_reader(tmp_path: Path) -> None:
    sd = {"w": torch.ones(3), "buf": io.BytesIO(PAYLOAD), "nested": {"b": io.BytesIO(b"abc")}}
    dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "ck", codec="zstd"), no_dist=True)
    recs = records(tmp_path / "ck")
    for key, content in (("buf", PAYLOAD), ("nested.b", b"abc")):
        assert recs[key].get(OBJECT_FIELD) == OBJECT_BYTESIO and recs[key]["raw"] == len(content)
    assert OBJECT_FIELD not in recs["w"]
    out = {"w": torch.zeros(3), "buf": io.BytesIO(), "nested": {"b": io.BytesIO()}}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    assert out["buf"].getvalue() == PAYLOAD and out["nested"]["b"].getvalue() == b"abc"
    assert torch.equal(out["w"], torch.ones(3))
    # A planner of its own (the CLI's, overriding load_bytes) gets DCP's torch.save payload.
    loaded = load_state(str(tmp_path / "ck"))
    assert loaded["buf"].getvalue() == PAYLOAD and loaded["nested"]["b"].getvalue() == b"abc"


def test_bytesio_through_async_save(tmp_path: Path) -> None:
    fut = dcp.async_save({"buf": io.BytesIO(PAYLOAD), "w": torch.ones(2)},
                         storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    fut.result(timeout=scaled(120))
    out = {"buf": io.BytesIO(), "w": torch.zeros(2)}
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    assert out["buf"].getvalue() == PAYLOAD


def test_unknown_object_encoding_is_refused_naming_the_key(tmp_path: Path) -> None:
    dcp.save({"buf": io.BytesIO(PAYLOAD)}, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    md_path = tmp_path / "ck" / METADATA_FILE
    md = decode_metadata(md_path.read_bytes(), str(md_path))
    for rec in md.storage_data.values():
        rec[OBJECT_FIELD] = "json-v9"  # a later version's encoding
    md_path.write_bytes(encode_metadata(md))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"buf": io.BytesIO()}, storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    (err,) = failures(info.value)
    assert isinstance(err, UnsupportedFormatError) and "'buf'" in str(err) and "json-v9" in str(err), err


# -- objects that need an opt-in -----------------------------------------------------------------------


def test_numpy_and_user_objects_round_trip_with_the_opt_in(tmp_path: Path) -> None:
    before = set(map(repr, torch.serialization.get_safe_globals()))
    dcp.save(objects_state(), storage_writer=CompressedWriter(tmp_path / "ck", safe_globals=TRUST), no_dist=True)
    out = objects_template()
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "ck", safe_globals=TRUST), no_dist=True)
    check_objects(out)
    assert set(map(repr, torch.serialization.get_safe_globals())) == before  # nothing widened process-wide
    # The default reader refuses them, naming the key and the globals to opt in.
    with pytest.raises(CheckpointException) as info:
        dcp.load(objects_template(), storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    errs = failures(info.value)
    assert all(isinstance(e, UnsafeCheckpointError) for e in errs), errs
    text = str(errs[0])
    assert "safe_globals=[" in text and ("numpy" in text or "RunInfo" in text)


def test_process_wide_safe_globals_of_the_user_survive(tmp_path: Path) -> None:
    torch.serialization.add_safe_globals([RunInfo])
    try:
        dcp.save({"info": RunInfo("a", [1])}, storage_writer=CompressedWriter(tmp_path / "ck", safe_globals=[RunInfo]),
                 no_dist=True)
        out: dict[str, Any] = {"info": None}
        dcp.load(out, storage_reader=CompressedReader(tmp_path / "ck", safe_globals=[RunInfo]), no_dist=True)
        assert out["info"] == RunInfo("a", [1])
        assert RunInfo in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()


def _assert_refused_at_save(exc: BaseException, path: Path) -> None:
    errs = failures(exc)
    assert errs and all(isinstance(e, UnsafeObjectError) for e in errs), errs
    text = str(errs[0])
    assert "'extra.rng'" in text or "'extra.arr'" in text or "'extra.scalar'" in text, text
    assert "numpy._core.multiarray._reconstruct" in text and "safe_globals=[" in text, text
    assert "numpy.dtypes.UInt32DType" in text or "'extra.rng'" not in text, text  # dynamic globals named too
    assert isinstance(errs[0], ConfigError)
    assert not (path / METADATA_FILE).exists()  # nothing committed


def test_numpy_state_is_refused_at_save_without_the_opt_in(tmp_path: Path) -> None:
    sd = objects_state()
    del sd["info"]
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    _assert_refused_at_save(info.value, tmp_path / "ck")


def test_numpy_state_is_refused_at_async_save_without_the_opt_in(tmp_path: Path) -> None:
    sd = objects_state()
    del sd["info"]
    fut = dcp.async_save(sd, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        fut.result(timeout=scaled(120))
    _assert_refused_at_save(info.value, tmp_path / "ck")


@pytest.mark.parametrize("async_save", [False, True])
def test_tiered_checkpointer_refuses_numpy_state_at_save_and_restores_it_with_the_opt_in(tmp_path: Path, async_save: bool
                                                                                         ) -> None:
    rng = np.random.RandomState(7)
    sd = {"w": torch.arange(8.0), "rng": rng.get_state()}
    tiers = [Tier("local", str(tmp_path / "local"), every_steps=1, keep=2)]
    plain = TieredCheckpointer(tiers, async_save=async_save)
    try:
        with pytest.raises((SaveError, UnsafeObjectError)) as info:
            plain.maybe_save(1, sd)
            plain.wait()  # the async save surfaces its failure here
        assert "rng" in str(info.value) and "safe_globals" in str(info.value)
        assert plain.list() == [] or not any(i.committed for i in plain.list())
    finally:
        plain.close()
    opted = TieredCheckpointer(tiers, async_save=async_save, safe_globals=numpy_safe_globals())
    opted.maybe_save(2, sd)
    opted.close()
    again = TieredCheckpointer(tiers, safe_globals=numpy_safe_globals())
    dst = {"w": torch.zeros(8), "rng": None}
    assert again.restore(dst) == 2
    again.close()
    assert torch.equal(dst["w"], sd["w"])
    got = dst["rng"]
    assert got[0] == sd["rng"][0] and np.array_equal(got[1], sd["rng"][1]) and got[2:] == sd["rng"][2:]
    with pytest.raises(RestoreError) as refused:  # without the opt-in: refused, never "start from 0"
        TieredCheckpointer(tiers).restore({"w": torch.zeros(8), "rng": None})
    assert "rng" in str(refused.value)


def test_user_class_refused_at_save_names_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save({"info": RunInfo("a", [1])}, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    (err,) = failures(info.value)
    assert isinstance(err, UnsafeObjectError) and "'info'" in str(err) and f"{__name__}.RunInfo" in str(err), err


def test_safe_globals_argument_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="safe_globals"):
        CompressedWriter(tmp_path / "a", safe_globals="numpy.ndarray")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="safe_globals"):
        CompressedWriter(tmp_path / "b", safe_globals=[42])  # type: ignore[list-item]


class _Reduce:
    """Unpickles as ``fn(arg)``."""

    def __init__(self, fn: Any, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple:
        return (self.fn, (self.arg,))


UNPICKLED: list[Any] = []


class Recorder:
    """Records each unpickling: the refusal's diagnosis must not build it."""

    def __setstate__(self, state: dict) -> None:
        UNPICKLED.append(state)
        self.__dict__.update(state)


def test_code_payload_is_refused_at_save_and_at_load_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    sd = {"obj": _Reduce(os.system, f"touch {shlex.quote(str(marker))}"), "w": torch.ones(2)}
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=CompressedWriter(tmp_path / "c"), no_dist=True)
    (err,) = failures(info.value)
    assert isinstance(err, UnsafeObjectError) and "do not allow" in str(err) and "system" in str(err), err
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock"), no_dist=True)  # stock writers do not check
    rec = Recorder()
    rec.x = 1
    dcp.save({"rec": rec}, storage_writer=FileSystemWriter(tmp_path / "rec"), no_dist=True)
    UNPICKLED.clear()
    for path, key in ((tmp_path / "stock", "obj"), (tmp_path / "rec", "rec")):
        with pytest.raises(CheckpointException) as info:
            dcp.load({key: None}, storage_reader=CompressedReader(path, safe_globals=TRUST), no_dist=True)
        (err,) = failures(info.value)
        assert isinstance(err, UnsafeCheckpointError) and f"{key!r}" in str(err), err
    assert f"{__name__}.Recorder" in str(err)
    assert UNPICKLED == [] and not marker.exists()


# -- stock checkpoints ----------------------------------------------------------------------------------


def test_stock_checkpoints_with_bytesio_and_objects_still_load(tmp_path: Path) -> None:
    dcp.save(objects_state(), storage_writer=FileSystemWriter(tmp_path / "stock"), no_dist=True)
    out = objects_template()
    dcp.load(out, storage_reader=CompressedReader(tmp_path / "stock", safe_globals=TRUST), no_dist=True)
    check_objects(out)
    # BytesIO (pickled by stock DCP) and plain values need no opt-in.
    plain = {"w": torch.ones(2), "buf": io.BytesIO(PAYLOAD), "meta": {"step": 7, "tag": "x", "t": (1, 2.5)}}
    dcp.save(plain, storage_writer=FileSystemWriter(tmp_path / "plain"), no_dist=True)
    out2 = {"w": torch.zeros(2), "buf": io.BytesIO(), "meta": {"step": 0, "tag": "", "t": None}}
    dcp.load(out2, storage_reader=CompressedReader(tmp_path / "plain"), no_dist=True)
    assert out2["buf"].getvalue() == PAYLOAD and out2["meta"] == {"step": 7, "tag": "x", "t": (1, 2.5)}


# -- expand_stateful ----------------------------------------------------------------------------------------


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.t = torch.zeros(2)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.t = sd["t"]


def test_expand_stateful_nested_writes_back_and_calls_load_state_dict(tmp_path: Path) -> None:
    src = {"top": Counter(1), "group": {"inner": Counter(2), "epoch": 5}, "x": 1}
    src["top"].t += 1
    src["group"]["inner"].t += 2
    saved, _ = expand_stateful(src, nested=True)
    dcp.save(saved, storage_writer=CompressedWriter(tmp_path / "ck"), no_dist=True)
    dst = {"top": Counter(), "group": {"inner": Counter(), "epoch": 0}, "x": 0}
    inner = dst["group"]["inner"]
    loadable, finish = expand_stateful(dst, nested=True)
    dcp.load(loadable, storage_reader=CompressedReader(tmp_path / "ck"), no_dist=True)
    finish()
    assert dst["group"]["inner"] is inner and inner.n == 2 and torch.equal(inner.t, torch.full((2,), 2.0))
    assert dst["top"].n == 1 and torch.equal(dst["top"].t, torch.ones(2))
    assert dst["group"]["epoch"] == 5 and dst["x"] == 1
    plain = {"a": 1}
    assert expand_stateful(plain)[0] is plain


# -- load_and_broadcast on 4 gloo ranks -----------------------------------------------------------------


def _worker(rank: int, world_size: int, root: str, out: str) -> None:
    out_p = Path(out)

    def appstate() -> None:
        model, optim = make_model(100 + rank)  # every replica starts different
        sd = {"app": AppState(model, optim), "step": -1}
        load_and_broadcast(sd, f"{root}/app")
        check_app(model, optim)
        assert sd["step"] == 40

    def module() -> None:
        # a reader factory (only the leader builds it), and a bare module as the Stateful value
        model, _ = make_model(200 + rank)
        load_and_broadcast({"model": model}, lambda: CompressedReader(f"{root}/module"))
        want = trained()[0].state_dict()
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())

    def objects() -> None:
        sd = objects_template()
        load_and_broadcast(sd, f"{root}/objects", safe_globals=TRUST)
        check_objects(sd)

    def objects_refused_without_opt_in() -> None:
        try:
            load_and_broadcast(objects_template(), f"{root}/objects")
        except BaseException as exc:  # noqa: BLE001 - leader: CheckpointException; others: LeaderLoadError
            assert "safe_globals" in str(exc), exc
            return
        raise AssertionError("objects needing an opt-in loaded without it")

    for name, fn in (("appstate", appstate), ("module", module), ("objects", objects),
                     ("refused", objects_refused_without_opt_in)):
        record(out_p, name, rank, fn)


@pytest.fixture(scope="module")
def broadcast_records(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str | None]:
    root = tmp_path_factory.mktemp("objects_bcast")
    model, optim = trained()
    dcp.save({"app": AppState(model, optim), "step": 40}, storage_writer=CompressedWriter(root / "app"), no_dist=True)
    dcp.save({"model": model}, storage_writer=CompressedWriter(root / "module"), no_dist=True)
    dcp.save(objects_state(), storage_writer=CompressedWriter(root / "objects", safe_globals=TRUST), no_dist=True)
    return run_ranks_recording(_worker, WS, root, str(root), root / "records", timeout=SPAWN_TIMEOUT)


@pytest.mark.parametrize("check", ["appstate", "module", "objects", "refused"])
def test_load_and_broadcast_on_4_ranks(broadcast_records: tuple[Path, str | None], check: str) -> None:
    out, spawn_error = broadcast_records
    read_records(out, check, WS, spawn_error)
