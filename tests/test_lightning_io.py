"""CompressedCheckpointIO: Lightning's checkpoints as compressed DCP directories (real lightning, CPU).

Training runs that are SIGKILLed run in child processes (tests/lightning_io_script.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

import pytest
from speed import scaled
import torch

pytest.importorskip("lightning")
import lightning as L  # noqa: E402
from lightning.fabric.utilities.data import AttributeDict  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from dcp_tiered.errors import CheckpointNotFoundError, StorageError, UnsafeObjectError  # noqa: E402
from dcp_tiered.integrations.lightning import (  # noqa: E402
    AsyncCompressedCheckpointIO,
    CompressedCheckpointIO,
    load_from_checkpoint,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "lightning_io_script.py"
_spec = importlib.util.spec_from_file_location("lightning_io_script", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)  # type: ignore[union-attr]


def run_child(args: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SCRIPT), json.dumps(args)], capture_output=True, text=True,
                          timeout=scaled(timeout), env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two uninterrupted 12-step runs with checkpoints every 3 steps: the plugin's and stock TorchCheckpointIO's;
    then, in the same child (one Lightning import), the plugin's run into ``killed`` that is SIGKILLed inside
    its 3rd save of last.ckpt (test_sigkill_during_save_and_resume_from_last_is_bit_exact resumes it)."""
    tmp = tmp_path_factory.mktemp("lightning_io")
    proc = run_child({"runs": [*({"dir": str(tmp / name), "io": io, "max_steps": 12, "out": str(tmp / f"{name}.pt")}
                                 for name, io in (("ours", "compressed"), ("stock", "torch"))),
                               {"dir": str(tmp / "killed"), "io": "compressed", "max_steps": 12,
                                "out": str(tmp / "killed.pt"), "kill_in_save": 3}]})
    assert (tmp / "ours.pt").is_file() and (tmp / "stock.pt").is_file(), proc.stderr[-3000:]  # both ran to the end
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]  # the last run was killed
    assert not (tmp / "killed.pt").exists()
    return tmp


def assert_same_final_state(a_file: Path, b_file: Path) -> None:
    a, b = torch.load(a_file), torch.load(b_file)
    assert a["step"] == b["step"] == 12
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]


def test_sigkill_during_save_and_resume_from_last_is_bit_exact(runs, tmp_path):
    # 3 batches per epoch: every checkpoint ends an epoch (mid-epoch, Lightning replays the epoch's batches
    # unless the dataloader is stateful, with any CheckpointIO)
    # the fixture's run "killed" (the same args, with kill_in_save 3) was SIGKILLed in the re-save of last.ckpt at
    # step 9, before its commit
    run = runs / "killed"
    args = {"dir": str(run), "io": "compressed", "max_steps": 12, "out": str(tmp_path / "b.pt")}
    names = sorted(p.name for p in run.iterdir())
    assert [n for n in names if not n.startswith(".")] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt",
                                                           "epoch=2-step=9.ckpt", "last.ckpt"]
    (partial,) = [n for n in names if n.startswith(".last.ckpt.")]  # the killed save, never under its name
    assert not (run / partial / ".metadata").exists()
    assert (run / "last.ckpt" / ".metadata").is_file()  # the previous last.ckpt is whole
    assert CompressedCheckpointIO().load_checkpoint(run / "last.ckpt")["global_step"] == 6
    resumed = run_child({**args, "ckpt_path": "last"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states" in resumed.stdout + resumed.stderr
    assert_same_final_state(runs / "ours.pt", tmp_path / "b.pt")
    assert not any(p.name.startswith(".") for p in run.iterdir())  # the next save of last.ckpt cleaned up


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def test_ckpt_directories_are_smaller_than_torch_checkpoint_files(runs):
    ours = sorted(p.name for p in (runs / "ours").iterdir())
    assert ours == sorted(p.name for p in (runs / "stock").iterdir())
    assert all((runs / "ours" / n).is_dir() and (runs / "stock" / n).is_file() for n in ours)
    for name in ours:
        assert du(runs / "ours" / name) < du(runs / "stock" / name), name
    assert_same_final_state(runs / "ours.pt", runs / "stock.pt")  # the plugin does not change training


def test_checkpoint_dict_round_trips_exactly(runs):
    ours = CompressedCheckpointIO().load_checkpoint(runs / "ours" / "epoch=3-step=12.ckpt")
    stock = torch.load(runs / "stock" / "epoch=3-step=12.ckpt", weights_only=False)
    assert ours.keys() == stock.keys()
    assert type(ours["hyper_parameters"]) is type(stock["hyper_parameters"]) and ours["hyper_parameters"] == stock["hyper_parameters"]
    opt_ours, opt_stock = ours["optimizer_states"][0], stock["optimizer_states"][0]
    assert opt_ours["state"].keys() == opt_stock["state"].keys() == set(range(6))  # int keys kept
    torch.testing.assert_close(ours["state_dict"], stock["state_dict"], rtol=0, atol=0)
    torch.testing.assert_close(opt_ours["state"], opt_stock["state"], rtol=0, atol=0)
    assert opt_ours["param_groups"] == opt_stock["param_groups"]
    assert ours["lr_schedulers"] == stock["lr_schedulers"] and ours["loops"] == stock["loops"]


def test_colliding_flatten_keys_tuples_and_unsafe_objects(tmp_path):
    io = CompressedCheckpointIO("lz4")
    ckpt = {"a": {0: torch.arange(3), "0": torch.ones(2)}, "a.0": torch.zeros(1), "t": (torch.tensor(1.5), "x", 3),
            "hp": AttributeDict(n=1, nested=AttributeDict(m=[1, 2])), "none": None}
    io.save_checkpoint(ckpt, tmp_path / "c.ckpt")
    back = io.load_checkpoint(tmp_path / "c.ckpt")
    assert back.keys() == ckpt.keys()
    assert torch.equal(back["a"][0], ckpt["a"][0]) and torch.equal(back["a"]["0"], ckpt["a"]["0"])
    assert torch.equal(back["a.0"], ckpt["a.0"])
    assert type(back["t"]) is tuple and torch.equal(back["t"][0], ckpt["t"][0]) and back["t"][1:] == ("x", 3)
    assert type(back["hp"]) is AttributeDict and type(back["hp"]["nested"]) is AttributeDict
    assert back["hp"] == ckpt["hp"] and back["none"] is None
    assert back["t"][0].dtype == torch.float32

    with pytest.raises(UnsafeObjectError, match="Fraction"):
        io.save_checkpoint({"hp": {"obj": Fraction(1, 3)}}, tmp_path / "bad.ckpt")
    assert not (tmp_path / "bad.ckpt" / ".metadata").exists()


def test_load_from_checkpoint_helper_and_validate(runs):
    path = runs / "ours" / "epoch=1-step=6.ckpt"
    model = load_from_checkpoint(script.Net, path)
    assert model.hparams.hidden == script.HIDDEN
    expected = CompressedCheckpointIO().load_checkpoint(path)["state_dict"]
    torch.testing.assert_close(model.state_dict(), expected, rtol=0, atol=0)
    with pytest.raises(Exception):
        script.Net.load_from_checkpoint(path)  # Lightning's own bypasses the plugin: a directory is no file

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[CompressedCheckpointIO()])
    fresh = script.Net()
    (res,) = trainer.validate(fresh, dataloaders=script.data(), ckpt_path=str(path), verbose=False)
    torch.testing.assert_close(fresh.state_dict(), expected, rtol=0, atol=0)
    x, y = script.data().dataset.tensors
    with torch.no_grad():
        assert res["val_loss"] == pytest.approx(torch.nn.functional.mse_loss(model.net(x), y).item(), rel=1e-5)


def test_stock_ckpt_file_loads_through_plugin(runs):
    path = runs / "stock" / "epoch=1-step=6.ckpt"
    got = CompressedCheckpointIO().load_checkpoint(path)
    stock = torch.load(path, weights_only=False)
    torch.testing.assert_close(got["state_dict"], stock["state_dict"], rtol=0, atol=0)
    assert got["global_step"] == 6


def fit(tmp: Path, io, max_steps: int, ckpt_path=None, **mc) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    mc = {"every_n_train_steps": 3, "save_last": True, **mc}
    tr = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                   callbacks=[ModelCheckpoint(dirpath=tmp, **mc)], plugins=[io])
    tr.fit(script.Net(hidden=16), script.data(), ckpt_path=ckpt_path)
    return tr


def test_save_top_k_removes_directories_and_last_link_resumes(tmp_path):
    fit(tmp_path, CompressedCheckpointIO(), 9, save_top_k=1, save_last="link")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["epoch=2-step=9.ckpt", "last.ckpt"], names  # steps 3 and 6 were removed
    assert (tmp_path / "last.ckpt").is_symlink()
    tr = fit(tmp_path, CompressedCheckpointIO(), 12, ckpt_path="last", save_top_k=1, save_last="link")
    assert tr.global_step == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=3-step=12.ckpt", "last.ckpt"]
    assert CompressedCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 12


def test_async_variant_saves_and_joins_at_teardown(tmp_path):
    io = AsyncCompressedCheckpointIO("lz4")
    fit(tmp_path, io, 6)
    assert io._executor is None  # torn down by the trainer: every save joined
    assert CompressedCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 6
    assert (tmp_path / "epoch=1-step=6.ckpt" / ".metadata").is_file()


def test_async_variant_surfaces_errors_at_load_and_teardown(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    ckpt = {"w": torch.ones(4), "global_step": 1}
    started = threading.Event()

    class Gated(CompressedCheckpointIO):  # the save fails only once the test has seen save_checkpoint return
        def save_checkpoint(self, *args, **kwargs):
            assert started.wait(scaled(60))
            super().save_checkpoint(*args, **kwargs)

    io = AsyncCompressedCheckpointIO(checkpoint_io=Gated())
    io.save_checkpoint(ckpt, tmp_path / "file" / "a.ckpt")  # returns at once; fails in the thread
    started.set()
    with pytest.raises(StorageError, match="a.ckpt") as first:
        io.load_checkpoint(tmp_path / "ok.ckpt")  # waits for the save in flight, then raises its error
    with pytest.raises(type(first.value)):
        io.save_checkpoint(ckpt, tmp_path / "ok.ckpt")  # the next save raises it too
    with pytest.raises(type(first.value)):
        io.teardown()


def test_routes_into_tiered_checkpointer_single_process(tmp_path):
    from dcp_tiered import Tier, TieredCheckpointer

    def make():
        return TieredCheckpointer([Tier("local", str(tmp_path / "tier"), keep=2, codec="lz4")],
                                  resume_promotions=False)

    ck = make()
    fit(tmp_path / "lt", CompressedCheckpointIO(checkpointer=ck), 6)
    ck.close()
    assert sorted(i.step for i in make().list() if i.committed) == [3, 6]
    ref = json.loads((tmp_path / "lt" / "last.ckpt").read_text())
    assert ref["step"] == 6  # Lightning's path holds a reference; the tier holds the checkpoint
    ck2 = make()
    tr = fit(tmp_path / "lt", CompressedCheckpointIO(checkpointer=ck2), 9, ckpt_path="last")
    assert tr.global_step == 9
    ck2.close()
    assert sorted(i.step for i in make().list() if i.committed) == [6, 9]  # the tier's keep=2 applies
    (tmp_path / "old.ckpt").write_text(json.dumps({**ref, "step": 3}))
    with pytest.raises(CheckpointNotFoundError, match="no tier holds.*retention.*keep >= save_top_k"):
        CompressedCheckpointIO(checkpointer=make()).load_checkpoint(tmp_path / "old.ckpt")


def test_ddp_two_gloo_ranks_save_on_rank0_and_resume(tmp_path):
    """Lightning saves on rank 0 only (dcp.save(no_dist=True)); both ranks load the checkpoint to resume."""
    out = tmp_path / "ddp.pt"
    proc = run_child({"dir": str(tmp_path / "run"), "io": "compressed", "max_steps": 6, "resume_to": 9, "devices": 2,
                      "out": str(out)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Restored all states" in proc.stdout + proc.stderr
    final = torch.load(out)
    assert final["step"] == 9
    # Adam's step counts 9: the optimizer state of step 6 was restored (a fresh one would count 3)
    assert {float(s["step"]) for s in final["optim"]["state"].values()} == {9.0}
    saved = CompressedCheckpointIO().load_checkpoint(tmp_path / "run" / "last.ckpt")
    assert saved["global_step"] == 9
    torch.testing.assert_close(saved["state_dict"], final["model"], rtol=0, atol=0)


def test_routing_refuses_several_ranks_and_async(tmp_path, monkeypatch):
    from dcp_tiered import Tier, TieredCheckpointer
    from dcp_tiered.errors import ConfigError

    ck = TieredCheckpointer([Tier("local", str(tmp_path / "tier"))], resume_promotions=False)
    with pytest.raises(ConfigError, match="async_save"):
        AsyncCompressedCheckpointIO(checkpointer=ck)
    monkeypatch.setattr(ck, "distributed", True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    with pytest.raises(ConfigError, match="TieredCheckpointCallback"):
        CompressedCheckpointIO(checkpointer=ck).save_checkpoint({"global_step": 3, "w": torch.ones(2)},
                                                                tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    ck.close()


def test_damaged_checkpoints_raise_named_errors(tmp_path):
    from dcp_tiered.errors import CorruptCheckpointError, UnsupportedFormatError
    from dcp_tiered.integrations.lightning_io import join_checkpoint, split_checkpoint

    io = CompressedCheckpointIO("none")
    io.save_checkpoint({"w": torch.arange(64, dtype=torch.float32), "global_step": 2}, tmp_path / "c.ckpt")
    data = tmp_path / "c.ckpt" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    i = raw.find(torch.arange(64, dtype=torch.float32).numpy().tobytes()[8:16])
    assert i > 0
    raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):  # frame checksums are verified on load
        io.load_checkpoint(tmp_path / "c.ckpt")

    flat = split_checkpoint({"a": [torch.ones(1)]})
    skel = flat["skeleton"][0]
    with pytest.raises(CorruptCheckpointError, match="skeleton does not match"):
        join_checkpoint({**flat, "skeleton": ({**skel, "tensors": [("a", 5)]},)}, "x.ckpt")
    with pytest.raises(UnsupportedFormatError, match="x.ckpt"):
        join_checkpoint({**flat, "skeleton": ({**skel, "format": "dcp_tiered.lightning/9"},)}, "x.ckpt")


# -- review 14h: hostile cases ------------------------------------------------------------------

from tests.isolated import run_isolated  # noqa: E402

_KILL_PRELUDE = """
import os, signal, torch
import dcp_tiered.integrations._lightning_files as files
from dcp_tiered.integrations.lightning import CompressedCheckpointIO
io_ = CompressedCheckpointIO()
io_.save_checkpoint({{"global_step": 3, "w": torch.ones(4)}}, {p!r})
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
"""
_KILL_AT = {
    # the new checkpoint is committed under its hidden name; the swap never starts
    "committed": "files.swap_in = die",
    # the atomic exchange is done; the previous checkpoint (now under the hidden name) is not deleted yet
    "exchanged": "real = files.exchange\nfiles.exchange = lambda a, b: real(a, b) and die()",
    # no atomic exchange (another OS or file system): killed between moving the old one aside and the rename
    "moved_aside": ("files.exchange = lambda a, b: False\nreal = os.rename\n"
                    "def rename(a, b):\n    real(a, b)\n    if b.endswith('.old'): die()\nfiles.os.rename = rename"),
}


@pytest.mark.parametrize("point", sorted(_KILL_AT))
def test_sigkill_at_each_point_of_the_last_ckpt_swap_loses_nothing(tmp_path, point):
    p = str(tmp_path / "last.ckpt")
    code = _KILL_PRELUDE.format(p=p) + _KILL_AT[point] + '\nio_.save_checkpoint({"global_step": 6, "w": torch.ones(4) * 2}, ' + repr(p) + ")\n"
    res = run_isolated(code, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.describe()
    io = CompressedCheckpointIO()
    if point != "moved_aside":  # what Lightning's ckpt_path="last" needs: last.ckpt exists and loads
        assert (tmp_path / "last.ckpt" / ".metadata").is_file(), sorted(os.listdir(tmp_path))
    assert io.load_checkpoint(p)["global_step"] == (3 if point == "committed" else 6)
    from dcp_tiered.integrations import _lightning_files

    _lightning_files.recover(p)  # what the next save does first: the newest committed checkpoint is kept
    assert io.load_checkpoint(p)["global_step"] == 6
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no leaked .old / .partial
    io.save_checkpoint({"global_step": 9, "w": torch.ones(4) * 3}, p)
    assert os.listdir(tmp_path) == ["last.ckpt"] and io.load_checkpoint(p)["global_step"] == 9


def _tiers(tmp_path, **kw):
    from dcp_tiered import Tier, TieredCheckpointer

    return TieredCheckpointer([Tier("local", str(tmp_path / "tiers"), keep=3)], resume_promotions=False, **kw)


def test_routed_async_reference_is_written_only_once_the_step_committed(tmp_path):
    code = f"""
    import os, signal, torch
    from dcp_tiered import Tier, TieredCheckpointer
    from dcp_tiered.integrations.lightning import CompressedCheckpointIO
    d = {str(tmp_path)!r}
    ck = TieredCheckpointer([Tier("local", d + "/tiers", keep=3)], async_save=True, resume_promotions=False)
    io_ = CompressedCheckpointIO(checkpointer=ck)
    big = torch.randn(4 << 20)
    io_.save_checkpoint({{"global_step": 3, "w": big}}, d + "/last.ckpt")
    ck.wait()
    io_.save_checkpoint({{"global_step": 6, "w": big + 1}}, d + "/last.ckpt")
    os.kill(os.getpid(), signal.SIGKILL)
    """
    res = run_isolated(code, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.describe()
    io = CompressedCheckpointIO(checkpointer=lambda: _tiers(tmp_path))
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3
    # a dangling reference (written by an older version) says what happened, not "retention"
    (tmp_path / "new.ckpt").write_text(json.dumps({"dcp_tiered_tier_ref": 1, "step": 12}))
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        io.load_checkpoint(tmp_path / "new.ckpt")


@pytest.mark.parametrize("full_first", [False, True])
def test_routed_saves_of_one_step_with_other_content_are_kept(tmp_path, full_first):
    io = CompressedCheckpointIO(checkpointer=_tiers(tmp_path))
    weights = {"global_step": 6, "state_dict": {"w": torch.ones(2)}}
    full = {**weights, "optimizer_states": [{"m": 1}]}
    saves = [(full, "last.ckpt"), (weights, "top.ckpt")] if full_first else [(weights, "top.ckpt"), (full, "last.ckpt")]
    for ckpt, name in saves:
        io.save_checkpoint(ckpt, tmp_path / name)
    assert io.load_checkpoint(tmp_path / "last.ckpt")["optimizer_states"] == [{"m": 1}]
    assert torch.equal(io.load_checkpoint(tmp_path / "top.ckpt")["state_dict"]["w"], torch.ones(2))
    io._ck.close()


def test_routed_save_without_global_step_is_refused(tmp_path):
    from dcp_tiered.errors import ConfigError

    io = CompressedCheckpointIO(checkpointer=_tiers(tmp_path))
    for it in range(2):  # Fabric's fabric.save(path, state): no global_step
        with pytest.raises(ConfigError, match="global_step"):
            io.save_checkpoint({"iteration": it, "w": torch.full((2,), float(it))}, tmp_path / f"ckpt-{it}.ckpt")
    assert not list(tmp_path.glob("*.ckpt"))
    io.save_checkpoint({"iteration": 2, "global_step": 2, "w": torch.ones(2)}, tmp_path / "ckpt-2.ckpt")
    assert io.load_checkpoint(tmp_path / "ckpt-2.ckpt")["iteration"] == 2
    io._ck.close()


@pytest.mark.parametrize("kind", ["quantized", "sparse", "meta", "quantized_linear"])
def test_quantized_sparse_and_meta_tensors_are_refused_naming_the_key(tmp_path, kind):
    from dcp_tiered.errors import UnsupportedFormatError

    if kind == "quantized_linear":
        value = {"fc": torch.ao.nn.quantized.Linear(4, 2).state_dict()}
        key = "fc._packed_params._packed_params.0"
    else:
        value = {"x": {"quantized": torch.quantize_per_tensor(torch.tensor([1.0, 2.5]), 0.1, 3, torch.qint8),
                       "sparse": torch.eye(3).to_sparse(), "meta": torch.empty(3, device="meta")}[kind]}
        key = "x"
    with pytest.raises(UnsupportedFormatError, match=f"'state_dict.{key}'.*not supported"):
        CompressedCheckpointIO().save_checkpoint({"state_dict": value}, tmp_path / "q.ckpt")
    assert not (tmp_path / "q.ckpt").exists()


def test_non_tensor_part_over_max_object_bytes_is_refused_at_save(tmp_path):
    from dcp_tiered.errors import ConfigError

    ckpt = {"global_step": 1, "w": torch.ones(2), "datamodule_state": {"seen": b"\x01" * 20_000}}
    with pytest.raises(ConfigError, match="'datamodule_state'.*max_object_bytes=10000"):
        CompressedCheckpointIO(max_object_bytes=10_000).save_checkpoint(ckpt, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    io = CompressedCheckpointIO(max_object_bytes=100_000)
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    assert len(io.load_checkpoint(tmp_path / "a.ckpt")["datamodule_state"]["seen"]) == 20_000
    from dcp_tiered.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError):  # the reader's limit is the plugin's
        CompressedCheckpointIO(max_object_bytes=10_000).load_checkpoint(tmp_path / "a.ckpt")


def test_stock_ckpt_file_on_s3_loads_through_the_plugin(s3_bucket):
    import io as _io

    import fsspec

    url, opts = s3_bucket
    buf = _io.BytesIO()
    torch.save({"global_step": 5, "state_dict": {"w": torch.ones(2)}}, buf)
    with fsspec.filesystem("s3", **opts).open(f"{url}/run/last.ckpt", "wb") as f:
        f.write(buf.getvalue())
    plugin = CompressedCheckpointIO(storage_options=opts)
    assert plugin.load_checkpoint(f"{url}/run/last.ckpt")["global_step"] == 5
    plugin.save_checkpoint({"global_step": 6, "w": torch.ones(2)}, f"{url}/run/ours.ckpt")  # a directory still loads
    assert plugin.load_checkpoint(f"{url}/run/ours.ckpt")["global_step"] == 6


def test_async_refuses_checkpoint_io_with_other_arguments():
    with pytest.raises(TypeError, match="codec='lz4', safe_globals, threads"):
        AsyncCompressedCheckpointIO("lz4", checkpoint_io=CompressedCheckpointIO("zstd"), threads=8, safe_globals=[int])
    assert AsyncCompressedCheckpointIO(checkpoint_io=CompressedCheckpointIO("lz4")).checkpoint_io.codec == "lz4"


def test_routed_reference_without_checkpointer_says_what_it_is(tmp_path):
    from dcp_tiered.errors import ConfigError

    io = CompressedCheckpointIO(checkpointer=_tiers(tmp_path))
    io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.ones(2)}}, tmp_path / "last.ckpt")
    io._ck.close()
    with pytest.raises(ConfigError, match="reference to step 4 of a TieredCheckpointer.*checkpointer="):
        CompressedCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    with pytest.raises(ConfigError, match="reference to step 4.*checkpoint_io="):
        load_from_checkpoint(script.Net, tmp_path / "last.ckpt")


def test_routed_reference_swap_killed_keeps_the_previous_reference(tmp_path):
    code = f"""
    import os, signal, torch
    import dcp_tiered.integrations._lightning_files as files
    from dcp_tiered import Tier, TieredCheckpointer
    from dcp_tiered.integrations.lightning import CompressedCheckpointIO
    d = {str(tmp_path)!r}
    io_ = CompressedCheckpointIO(checkpointer=TieredCheckpointer([Tier("local", d + "/tiers", keep=3)],
                                                                 resume_promotions=False))
    io_.save_checkpoint({{"global_step": 3, "w": torch.ones(2)}}, d + "/last.ckpt")
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    files.swap_in = die  # step 6 is committed in the tiers, its reference written but not swapped in
    io_.save_checkpoint({{"global_step": 6, "w": torch.ones(2) * 2}}, d + "/last.ckpt")
    """
    res = run_isolated(code, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.describe()
    io = CompressedCheckpointIO(checkpointer=_tiers(tmp_path))
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3  # never without a last.ckpt
    io.save_checkpoint({"global_step": 9, "w": torch.ones(2) * 3}, tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "tiers"]
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 9
    io._ck.close()
