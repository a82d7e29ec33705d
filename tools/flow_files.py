"""Count the library files (modules under ``dcp_tiered/``) that the three hardest flows pass through.

Each flow is run for real and traced with ``sys.setprofile`` + ``threading.setprofile``: every Python
function called whose ``co_filename`` lies under the package directory is recorded (module bodies and
whatever runs while a library module is being imported are left out: an import is no step of a
flow).  The hook is installed before anything is constructed, so that every thread started later
(DCP's async thread, promotion lanes, replication threads) is traced too; it records only inside the
traced window.  Multi-process flows record in every rank and take the union.

- ``A``: ``TieredCheckpointer.maybe_save(2, sd)`` with ``async_save=True``, tiers
  ``[local <tmpdir>, durable s3://bucket/run]`` (``via_fastest`` default, a moto server on a loopback
  port), then ``wait()``; step 1 is saved (and waited for) before, untraced, so that retention of
  the second save has something to delete.  Construction is not traced.
- ``B``: ``restore(state)`` through peers after a lost node: 4 gloo ranks as 2 nodes of 2
  (``LOCAL_WORLD_SIZE=2``), ``local/{node}`` with ``replicas=2, replication_jump=2`` plus a shared tier
  (``tests/test_replication.py``'s tiers and state), steps 1 and 2 saved, node 1's directory deleted,
  then ``ckpt.restore(state)`` traced in every rank.
- ``C``: retention as ``dcp-tiered gc`` runs it: ``Retention.plan`` + ``apply`` on a local tier with
  ``keep=1`` holding three committed checkpoints (steps 1, 2, 4) and one old uncommitted leftover
  (step 3, two hours old): all but step 4 are deleted.

Only public names are used (``from dcp_tiered import Tier, TieredCheckpointer``; ``Retention`` from
``dcp_tiered.tiers.retention``), so the tool runs on the tree before the ``tiers/`` refactor too::

    PYTHONPATH=$PWD .venv/bin/python tools/flow_files.py [--flow A|B|C|all] [--json]

Each flow runs in a fresh subprocess of this script (``--flow all`` runs the three one after another).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tools.s3_faults import moto_server

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT / "tests"), str(ROOT)):  # tests/: gloo_ranks and test_replication (flow B)
    if _p not in sys.path:
        sys.path.insert(0, _p)

FLOWS = ("A", "B", "C")
TIERS_DIR = "dcp_tiered/tiers/"


# -- the tracer ------------------------------------------------------------------------------------


class Tracer:
    """A profile hook recording the library files of the Python functions called while active."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("dcp_tiered")  # the package's directory, without importing it
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("dcp_tiered is not importable (set PYTHONPATH to the tree to measure)")
        self.pkg_dir = os.path.realpath(list(spec.submodule_search_locations)[0])
        self.base = os.path.dirname(self.pkg_dir)
        self.active = False
        self.files: set[str] = set()
        self._rel: dict = {}  # code -> path relative to the tree, or None when not a library function
        self._module_body: dict = {}  # code -> whether it is the body of a library module
        self._done: set = set()  # codes recorded

    def _path(self, code) -> str | None:
        path = os.path.realpath(code.co_filename)
        return os.path.relpath(path, self.base) if path.startswith(self.pkg_dir + os.sep) else None

    def _importing(self, frame) -> bool:
        """Whether ``frame`` runs inside the import of a library module (a ``<module>`` frame above it)."""
        f = frame.f_back
        while f is not None:
            code = f.f_code
            body = self._module_body.get(code)
            if body is None:
                body = self._module_body[code] = code.co_name == "<module>" and self._path(code) is not None
            if body:
                return True
            f = f.f_back
        return False

    def hook(self, frame, event, arg) -> None:
        if event != "call" or not self.active:
            return
        code = frame.f_code
        if code in self._done:
            return
        rel = self._rel.get(code, 0)
        if rel == 0:
            rel = self._rel[code] = None if code.co_name == "<module>" else self._path(code)
        if rel is None or self._importing(frame):
            return
        self._done.add(code)
        self.files.add(rel)

    def install(self) -> "Tracer":
        """Install the hook on this thread and on every thread started from now on."""
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        return self

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def __enter__(self) -> "Tracer":
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False


# -- helpers ---------------------------------------------------------------------------------------


def _disk_tmp() -> str:
    """A temporary folder off tmpfs: a ``Tier`` on tmpfs is a memory tier, which changes the flows."""
    base = tempfile.gettempdir()
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
        best = max((m for m in mounts if os.path.realpath(base).startswith(m[1].rstrip("/") + "/") or m[1] == "/"),
                   key=lambda m: len(m[1]))
        if best[2] == "tmpfs":
            base = "/var/tmp"
    except (OSError, ValueError):
        pass
    return tempfile.mkdtemp(prefix="flow-files-", dir=base)


def _state(step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)},
            "extra": {"lr": 0.1 * step, "step": step}}


# -- flow A: an async save ending in a committed S3 object -----------------------------------------


def flow_a(tracer: Tracer, work: Path) -> dict:
    from dcp_tiered import Tier, TieredCheckpointer
    import s3fs

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    with moto_server() as port:  # the fault tool's server: a free loopback port, stopped on exit
        options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                   "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}}
        import boto3  # as tests/conftest.py does (s3fs's mkdir sends a location constraint moto refuses)

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="flow-a")
        tiers = [Tier("local", str(work / "local"), every_steps=1, keep=1),
                 Tier("durable", "s3://flow-a/run", every_steps=1, keep=1, storage_options=options)]
        ckpt = TieredCheckpointer(tiers, async_save=True)
        try:
            ckpt.maybe_save(1, _state(1))
            ckpt.wait()
            sd = _state(2)
            with tracer:
                report = ckpt.maybe_save(2, sd)
                ckpt.wait()
            listed = sorted((i.tier, i.step, bool(i.committed)) for i in ckpt.list())
        finally:
            ckpt.close()
        objects = sorted(p.split("/", 2)[-1] for p in s3fs.S3FileSystem(**options).find("flow-a/run"))
    committed = ("durable", 2, True) in listed and any(o.endswith("/.metadata") for o in objects)
    if not committed:
        raise RuntimeError(f"flow A: step 2 is not committed on S3: {listed} {objects}")
    return {"saved_to": list(getattr(report, "tiers", ())), "listed": listed, "s3_objects": objects}


# -- flow B: a restore through peers after a lost node ---------------------------------------------


WS, LOCAL = 4, 2


def _b_save(rank: int, world_size: int, data: str) -> None:
    import test_replication as tr
    from dcp_tiered import TieredCheckpointer

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = tr._mesh()
    ckpt = TieredCheckpointer(tr.tiers(Path(data)))
    try:
        for step in (1, 2):
            ckpt.maybe_save(step, tr.make_state(mesh, rank, step))
            ckpt.wait()
    finally:
        ckpt.close()


def _b_restore(rank: int, world_size: int, data: str, out: str) -> None:
    tracer = Tracer().install()  # before the checkpointer: its threads are traced too
    import test_replication as tr
    from dcp_tiered import TieredCheckpointer

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    mesh = tr._mesh()
    ckpt = TieredCheckpointer(tr.tiers(Path(data)))
    events: list = []
    ckpt.events.hooks.append(events.append)
    try:
        sd = tr.make_state(mesh, rank, 0)
        with tracer:
            got = ckpt.restore(sd)
        facts = {"step": got, "diffs": tr.diffs(sd, rank, got) if isinstance(got, int) else ["nothing restored"],
                 "restores": [{k: e.get(k) for k in ("step", "tier", "through_peers", "fetched_bytes")}
                              for e in events if e.get("event") == "restore"]}
    finally:
        ckpt.close()
        tracer.uninstall()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"files": sorted(tracer.files), "facts": facts}))


def flow_b(tracer: Tracer, work: Path) -> dict:
    from gloo_ranks import run_ranks

    data = work / "data"
    run_ranks(_b_save, WS, work, str(data), timeout=900.0, pg_timeout=600.0)
    shutil.rmtree(data / "local" / "1")  # node 1 replaced: its local directory is gone
    out = work / "records"
    out.mkdir()
    run_ranks(_b_restore, WS, work, str(data), str(out), timeout=900.0, pg_timeout=600.0)
    facts = {}
    for r in range(WS):
        rec = json.loads((out / f"rank{r}.json").read_text())
        tracer.files.update(rec["files"])
        facts[f"rank{r}"] = rec["facts"]
        if rec["facts"]["diffs"] or not any(x.get("through_peers") for x in rec["facts"]["restores"]):
            raise RuntimeError(f"flow B: rank {r} did not restore through peers bit-exact: {rec['facts']}")
    facts["per_rank_files"] = {f"rank{r}": len(json.loads((out / f"rank{r}.json").read_text())["files"])
                               for r in range(WS)}
    return facts


# -- flow C: retention (dcp-tiered gc) -------------------------------------------------------------


def flow_c(tracer: Tracer, work: Path) -> dict:
    from dcp_tiered import Tier, TieredCheckpointer

    Retention = importlib.import_module("dcp_tiered.tiers.retention").Retention
    path = work / "local"
    ckpt = TieredCheckpointer([Tier("local", str(path), keep=10)])
    try:
        for step in (1, 2, 4):
            ckpt.maybe_save(step, _state(step))
        ckpt.wait()
        names = {i.step: i.name for i in ckpt.list()}
    finally:
        ckpt.close()
    # a leftover older than the newest committed step: the data file of a save that crashed before
    # it committed, two hours old
    leftover = path / names[1].replace(f"{1:09d}", f"{3:09d}")
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"\0" * 1024)
    old = time.time() - 7200
    for p in (leftover / "__0_0.distcp", leftover):
        os.utime(p, (old, old))
    tier = Tier("local", str(path), keep=1)
    retention = Retention([tier])  # as ``dcp-tiered gc`` builds it (default leftover grace: 1 h)
    with tracer:
        plan = retention.plan(tier)
        deleted = retention.apply(plan)
    left = sorted(p.name for p in path.iterdir())
    if sorted(i.step for i in deleted) != [1, 2, 3]:
        raise RuntimeError(f"flow C: retention deleted {[i.step for i in deleted]}, not steps 1, 2, 3")
    return {"deleted": sorted((i.step, bool(i.committed)) for i in deleted), "left": left}


# -- driver ----------------------------------------------------------------------------------------


def run_one(flow: str) -> dict:
    """Run one flow in this process and return its record."""
    tracer = Tracer().install()
    work = Path(_disk_tmp())
    t0 = time.monotonic()
    try:
        facts = {"A": flow_a, "B": flow_b, "C": flow_c}[flow](tracer, work)
    finally:
        tracer.uninstall()
        shutil.rmtree(work, ignore_errors=True)
    files = sorted(tracer.files)
    return {"flow": flow, "package": tracer.pkg_dir, "files": len(files),
            "in_tiers": sum(f.startswith(TIERS_DIR) for f in files), "list": files, "facts": facts,
            "seconds": round(time.monotonic() - t0, 1)}


def run_child(flow: str) -> dict:
    """Run one flow in a fresh interpreter (no state left over from another flow)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), "--flow", flow, "--_record", f.name]
        proc = subprocess.run(cmd, cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"flow {flow} failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
        return json.loads(Path(f.name).read_text())


def print_text(records: list[dict]) -> None:
    print(f"package: {records[0]['package']}")
    print(f"{'flow':<6}{'files':>7}{'in tiers/':>11}{'seconds':>10}")
    for r in records:
        print(f"{r['flow']:<6}{r['files']:>7}{r['in_tiers']:>11}{r['seconds']:>10}")
    for r in records:
        print(f"\nflow {r['flow']}: {r['files']} files, {r['in_tiers']} in {TIERS_DIR}")
        for f in r["list"]:
            print(f"  {f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flow", default="all", choices=[*FLOWS, "all"], type=lambda s: s if s == "all" else s.upper())
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--_record", help=argparse.SUPPRESS)  # internal: run one flow here, write its record there
    args = p.parse_args(argv)
    if args._record:
        Path(args._record).write_text(json.dumps(run_one(args.flow)))
        return 0
    records = [run_child(f) for f in (FLOWS if args.flow == "all" else (args.flow,))]
    if args.json:
        print(json.dumps(records if args.flow == "all" else records[0], indent=2))
    else:
        print_text(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
