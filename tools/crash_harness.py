"""Randomized reliability harness: SIGKILL during saves, corruption campaigns, fuzzing.

Run from the repository root::

    .venv/bin/python -m tools.crash_harness --kills 200            # crash consistency
    .venv/bin/python -m tools.crash_harness --corruptions 300       # corruption + restore fallback
    .venv/bin/python -m tools.crash_harness --fuzz 5000             # malformed files (byte mutations)
    .venv/bin/python -m tools.crash_harness --hostile 10000         # crafted .metadata / intents, isolated

**Kills.**  A child process runs a deterministic training loop (a small MLP trained with
SGD+momentum on batches seeded by the step number) under ``TieredCheckpointer`` with 2 or
3 tiers on local directories, random codecs, sync or async saves, ``optimizer_every`` 1
or 2, small ``keep`` (retention runs all the time) and promotion to the slower tiers.  The
child first restores (resuming any unfinished promotion, exactly like a restarted job) and
continues training from the restored state.  It journals ``begin S`` before asking to save
step S and ``commit S`` only once the save is known committed.  The parent kills it with
SIGKILL after a random delay, then checks with a fresh ``TieredCheckpointer``:

* every directory listed as committed is complete, was begun by the child, loads with
  verification on, and equals the replayed state of its step exactly;
* ``restore`` of the model returns the newest committed step (never older than the last
  journaled commit: nothing lost), and ``restore`` of model+optimizer returns the newest
  committed step holding the optimizer (never older than the last journaled one);
* the restored values equal the replayed values bit for bit; no restore candidate fails.

Half the configurations hand the state over as DCP ``Stateful`` objects (whose
``state_dict()`` returns copies, so a restore that never calls ``load_state_dict`` is
caught); some make the fastest tier node-local and wipe it after a kill now and then, as
when a node is replaced: restore must then come from the slower tiers, exact, without hanging.

Trials are chained: the next child restarts on the directories the killed one left, so
kills also land during restore, promotion resume and retention of leftovers.

Children are forked from a ``multiprocessing`` fork server that has torch and this
package preloaded, so a trial costs its own run time, not an interpreter start.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import (CompressedReader, CompressedWriter, DcpTieredError, PromotionError, RestoreError, Tier,
                        TieredCheckpointer)
from dcp_tiered.storage.retry import RetryPolicy

CODECS = ("none", "lz4", "zstd", "zstd:3")
D_IN, HIDDEN, D_OUT, BATCH = 64, 384, 32, 16
FRAME = 64 << 10
FAST_RETRY = RetryPolicy(attempts=4, base=0.01, cap=0.05)
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# --------------------------------------------------------------------------- the training loop


def initial_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    shapes = {"l1.weight": (HIDDEN, D_IN), "l1.bias": (HIDDEN,), "l2.weight": (HIDDEN, HIDDEN),
              "l2.bias": (HIDDEN,), "l3.weight": (D_OUT, HIDDEN), "l3.bias": (D_OUT,)}
    model = {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}
    optim = {f"{k}.momentum": torch.zeros(s) for k, s in shapes.items()}
    return {"model": model, "optim": optim, "extra": {"step": 0}}


def zeros_like_state(state: dict[str, Any], keys: "frozenset[str] | None" = None) -> dict[str, Any]:
    """A state dict to load into: zeros, restricted to top-level parts present in ``keys``."""
    out: dict[str, Any] = {}
    for part, sub in state.items():
        if keys is not None and not any(k.startswith(part + ".") for k in keys):
            continue
        out[part] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in sub.items()}
    return out


def train_step(state: dict[str, Any], step: int) -> None:
    """One SGD+momentum step, in place, on a batch seeded by ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(100_000 + step)
    x, y = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)
    m = state["model"]
    names = list(m)
    params = [m[n].detach().clone().requires_grad_(True) for n in names]
    p = dict(zip(names, params))
    with torch.enable_grad():
        h = torch.relu(x @ p["l1.weight"].T + p["l1.bias"])
        h = torch.relu(h @ p["l2.weight"].T + p["l2.bias"])
        loss = ((h @ p["l3.weight"].T + p["l3.bias"] - y) ** 2).mean()
        grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for n, gr in zip(names, grads):
            mom = state["optim"][f"{n}.momentum"]
            mom.mul_(0.9).add_(gr)
            m[n].sub_(0.05 * mom)
    state["extra"]["step"] = step


@contextlib.contextmanager
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class Replay:
    """The exact training state after any step, replayed from cached snapshots."""

    def __init__(self, every: int = 50) -> None:
        self.every = every
        self.snaps: dict[int, dict[str, Any]] = {0: initial_state()}

    @staticmethod
    def _copy(state: dict[str, Any]) -> dict[str, Any]:
        return {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sub.items()} for p, sub in state.items()}

    def state(self, step: int) -> dict[str, Any]:
        base = max(s for s in self.snaps if s <= step)
        st = self._copy(self.snaps[base])
        with one_thread():
            for s in range(base + 1, step + 1):
                train_step(st, s)
                if s % self.every == 0 and s not in self.snaps:
                    self.snaps[s] = self._copy(st)
        return st


def same_values(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """None when every entry of ``got`` equals ``want`` bit for bit, else the first difference."""
    for part, sub in got.items():
        for k, v in sub.items():
            w = want[part][k]
            if isinstance(v, torch.Tensor):
                if v.dtype != w.dtype or v.shape != w.shape or not torch.equal(v, w):
                    return f"{part}.{k} differs"
            elif v != w:
                return f"{part}.{k}: {v!r} != {w!r}"
    return None


# --------------------------------------------------------------------------- configurations


@dataclasses.dataclass(frozen=True)
class Config:
    codecs: tuple[str, ...]  # one per tier, fastest first
    async_save: bool
    optimizer_every: int
    keep: int = 2
    #: the state is handed to the checkpointer as DCP ``Stateful`` objects (the DCP tutorial's pattern)
    stateful: bool = False
    #: the fastest tier is node-local (``{node}`` in its URL), and a restart may find it wiped
    #: (the node was replaced): restore must come from the slower tiers, without hanging
    node_local: bool = False

    def tiers(self, root: "str | Path") -> list[Tier]:
        names, steps = ("local", "shared", "durable"), (1, 2, 3)
        urls = [str(Path(root) / n) for n in names]
        if self.node_local:
            urls[0] += "/node{node}"
        return [Tier(names[i], urls[i], every_steps=steps[i], keep=self.keep, codec=c)
                for i, c in enumerate(self.codecs)]

    def label(self) -> str:
        return (f"{'async' if self.async_save else 'sync'} {'/'.join(self.codecs)} opt_every={self.optimizer_every} "
                f"keep={self.keep}{' stateful' if self.stateful else ''}{' node-local' if self.node_local else ''}")


def random_config(rng: random.Random) -> Config:
    n = rng.choice((2, 3))
    return Config(tuple(rng.choice(CODECS) for _ in range(n)), rng.random() < 0.5, rng.choice((1, 2)), rng.choice((1, 2, 3)),
                  stateful=rng.random() < 0.5, node_local=rng.random() < 0.3)


class Part:
    """A DCP ``Stateful`` view of one part of the training state, as the DCP tutorial's ``AppState``.

    ``state_dict()`` returns copies, so values reach the training state only through
    ``load_state_dict``: a restore that forgets to call it leaves the state untouched and is caught.
    """

    def __init__(self, state: dict[str, Any], part: str) -> None:
        self.state, self.part = state, part

    def state_dict(self) -> dict[str, Any]:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.state[self.part].items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, v in sd.items():
            cur = self.state[self.part][k]
            if isinstance(cur, torch.Tensor):
                cur.copy_(v)
            else:
                self.state[self.part][k] = v


def as_saved(cfg: Config, state: dict[str, Any]) -> dict[str, Any]:
    """The state dict handed to the checkpointer: plain, or each top-level part as a ``Stateful``."""
    return {p: Part(state, p) for p in state} if cfg.stateful else state


def checkpointer(cfg: Config, root: "str | Path", **kw: Any) -> TieredCheckpointer:
    return TieredCheckpointer(cfg.tiers(root), async_save=cfg.async_save, optimizer_every=cfg.optimizer_every,
                              retry=FAST_RETRY, threads=2, frame_size=FRAME, **kw)


# --------------------------------------------------------------------------- the child


def child_main(root: str, cfg: Config, journal: str, max_steps: int = 3000, workaround: bool = True) -> None:
    """Restore, then train and save until killed; journal commits only once they are known."""
    logging.basicConfig(filename=os.path.join(root, "child.log"), level=logging.WARNING,
                        format=f"%(asctime)s pid{os.getpid()} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    try:
        ckpt = checkpointer(cfg, root)
        state = initial_state()
        saved = as_saved(cfg, state)
        restored = ckpt.restore(saved)
        note(f"start {restored if restored is not None else -1}")
        step = restored or 0
        # Work around a library bug (see docs/reliability.md, "Known bugs"): after restoring
        # step r, saving a step that a killed run already committed (a newer model-only save
        # when optimizer_every > 1) fails with CheckpointExistsError.  Training is
        # deterministic, so the child replays those steps without saving them again.
        existing = max((i.step for i in ckpt.list() if i.committed), default=0) if workaround else 0
        seen = 0
        for _ in range(max_steps):
            step += 1
            train_step(state, step)
            if step <= existing:
                continue
            note(f"begin {step}")
            ckpt.maybe_save(step, saved)
            if step % 7 == 0:
                try:
                    ckpt.wait()
                except PromotionError as exc:
                    # Reported, not fatal: training goes on and restore is checked as usual.
                    # (see docs/reliability.md, "Known bugs": resumed promotions of saves that
                    # never committed race with the restarted run re-saving the same step)
                    note("promotion_error " + json.dumps(str(exc)[:300]))
            for rep in ckpt.reports[seen:]:
                if rep.ok is None:
                    break
                seen += 1
                if rep.ok:
                    note(f"commit {rep.step} {int(rep.optimizer)}")
        try:
            ckpt.close()
        except PromotionError as exc:
            note("promotion_error " + json.dumps(str(exc)[:300]))
        for rep in ckpt.reports[seen:]:
            if rep.ok:
                note(f"commit {rep.step} {int(rep.optimizer)}")
        note("done")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the journal
        note("error " + json.dumps(f"{type(exc).__name__}: {exc}"))
        logging.getLogger("crash_harness").error("child failed:\n%s", traceback.format_exc())
        os._exit(3)
    os._exit(0)


# --------------------------------------------------------------------------- the parent


@dataclasses.dataclass
class Journal:
    started: int | None = None
    begun: set[int] = dataclasses.field(default_factory=set)
    commits: dict[int, bool] = dataclasses.field(default_factory=dict)  # step -> held optimizer
    errors: list[str] = dataclasses.field(default_factory=list)
    promotion_errors: list[str] = dataclasses.field(default_factory=list)
    done: bool = False

    @classmethod
    def read(cls, path: "str | Path", since: int = 0) -> "Journal":
        j = cls()
        text = Path(path).read_text() if Path(path).exists() else ""
        for line in text.splitlines()[since:]:
            kind, _, rest = line.partition(" ")
            if kind == "start" and rest:
                j.started = int(rest)
            elif kind == "begin":
                j.begun.add(int(rest))
            elif kind == "commit":
                s, o = rest.split()
                j.commits[int(s)] = o == "1"
            elif kind == "error":
                j.errors.append(json.loads(rest))
            elif kind == "promotion_error":
                j.promotion_errors.append(json.loads(rest))
            elif kind == "done":
                j.done = True
        return j


def check_after_crash(root: "str | Path", cfg: Config, replay: Replay, begun: set[int],
                      commits: dict[int, bool]) -> Counter:
    """Check the tiers a killed child left behind; return counters (see module docstring)."""
    c: Counter = Counter()
    ckpt = checkpointer(cfg, root, resume_promotions=False)
    try:
        infos = ckpt.list()
        committed = [i for i in infos if i.committed]
        c["uncommitted_dirs_seen"] += sum(1 for i in infos if not i.committed)
        c["committed_checkpoints_checked"] += len(committed)
        for info in committed:
            if not info.complete:
                c["FAIL_committed_but_incomplete"] += 1
                continue
            if info.step not in begun:
                c["FAIL_committed_step_never_saved"] += 1
                continue
            want = replay.state(info.step)
            got = zeros_like_state(want, info.keys)
            try:
                dcp.load(got, storage_reader=CompressedReader(info.url, threads=2), no_dist=True)
            except BaseException as exc:  # noqa: BLE001
                c["FAIL_committed_checkpoint_does_not_load"] += 1
                logging.getLogger("crash_harness").error("%s does not load: %r", info.url, exc)
                continue
            if same_values(got, want) is not None:
                c["FAIL_wrong_values_in_committed_checkpoint"] += 1
        good = [i for i in committed if i.complete]
        newest = max((i.step for i in good), default=None)
        newest_optim = max((i.step for i in good if i.has_prefix(["optim"])), default=None)
        last = max(commits, default=None)
        last_optim = max((s for s, o in commits.items() if o), default=None)
        for what, template, expect_newest, last_journaled in (
            ("model", {"model": initial_state()["model"]}, newest, last),
            ("full", initial_state(), newest_optim, last_optim),
        ):
            target = zeros_like_state(template)
            try:
                r = ckpt.restore(as_saved(cfg, target))
            except RestoreError:
                # checkpoints exist, none holds every key asked for: refused, never "start from 0"
                c[f"restore_{what}_refused"] += 1
                r = None
            if last_journaled is not None and (r is None or r < last_journaled):
                c[f"FAIL_lost_{what}"] += 1  # a journaled commit does not restore
            if r != expect_newest:
                c[f"FAIL_restore_{what}_not_newest"] += 1
            if r is None:
                c[f"restore_{what}_none"] += 1
                continue
            if same_values(target, replay.state(r)) is not None:
                c[f"FAIL_restore_{what}_wrong_values"] += 1
            else:
                c[f"restore_{what}_correct"] += 1
            if last_journaled is not None and r > last_journaled:
                c[f"restore_{what}_newer_than_journal"] += 1  # committed, killed before journaling
        c["FAIL_restore_candidate_failed"] += ckpt.restore_failures
    finally:
        ckpt.close()
    return +c


def _wait_for(pred, timeout: float, poll: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll)
    return pred()


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tools.crash_harness"])
    return ctx


def run_kills(kills: int, root: "str | Path", *, seed: int = 0, chain: int = 8, max_delay: float = 1.2,
              configs: "list[Config] | None" = None, workaround: bool = True, log=print) -> dict[str, Any]:
    """Run ``kills`` SIGKILL trials in chains of ``chain`` on fresh directories; return a summary."""
    rng = random.Random(seed)
    ctx = _context()
    root = Path(root)
    totals: Counter = Counter()
    per_config: list[dict[str, Any]] = []
    trial = 0
    t_start = time.monotonic()
    chain_no = 0
    while trial < kills:
        cfg = configs[chain_no % len(configs)] if configs else random_config(rng)
        d = root / f"chain{chain_no:03d}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        journal = d / "journal.txt"
        replay = Replay()
        begun: set[int] = set()
        commits: dict[int, bool] = {}
        chain_counts: Counter = Counter()
        for _ in range(min(chain, kills - trial)):
            lines_before = len(journal.read_text().splitlines()) if journal.exists() else 0
            p = ctx.Process(target=child_main, args=(str(d), cfg, str(journal), 3000, workaround),
                            daemon=True)
            t0 = time.monotonic()
            p.start()
            early = rng.random() < 0.15
            if early:  # kill while the child restores / resumes promotions / starts up
                time.sleep(rng.uniform(0.0, 0.3))
            else:
                _wait_for(lambda: Journal.read(journal, lines_before).started is not None or not p.is_alive(), 120)
                time.sleep(rng.uniform(0.0, max_delay))
            alive = p.is_alive()
            if alive:
                os.kill(p.pid, signal.SIGKILL)
            p.join(30)
            j = Journal.read(journal, lines_before)
            begun |= j.begun
            commits.update(j.commits)
            counts: Counter = Counter()
            counts["kills"] += 1
            if cfg.node_local and rng.random() < 0.3:
                # the node is replaced: its local tier is gone, with any promotion intents in it;
                # what was journaled there is legitimately lost, the slower tiers must serve
                shutil.rmtree(d / "local", ignore_errors=True)
                commits.clear()
                counts["local_tier_lost"] += 1
            if not alive:
                counts["child_exited_before_kill"] += 1
            if j.errors:
                counts["FAIL_child_error"] += 1
                log(f"  child error: {j.errors[0]}")
            counts["saves_committed_in_trial"] += len(j.commits)
            if j.promotion_errors:
                counts["KNOWN_BUG_spurious_promotion_error_at_wait"] += len(j.promotion_errors)
                log(f"  promotion error reported to the child: {j.promotion_errors[0][:200]}")
            counts += check_after_crash(d, cfg, replay, begun, commits)
            fails = {k: v for k, v in counts.items() if k.startswith("FAIL")}
            trial += 1
            chain_counts += counts
            log(f"[{trial:4d}/{kills}] {cfg.label():42s} ran {time.monotonic() - t0:5.2f}s"
                f" {'early ' if early else ''}commits={len(j.commits):3d} newest={max(commits, default=None)}"
                f"{'  ' + str(fails) if fails else ''}")
        totals += chain_counts
        per_config.append({"config": cfg.label(), **dict(chain_counts)})
        if not any(k.startswith("FAIL") for k in chain_counts):
            shutil.rmtree(d, ignore_errors=True)  # keep failing chains for diagnosis
        chain_no += 1
    totals["seconds"] = round(time.monotonic() - t_start)
    return {"totals": dict(totals), "chains": per_config}


# --------------------------------------------------------------------------- corruption campaign

CORRUPTIONS = ("bitflip", "truncate", "delete")


def corrupt_file(path: Path, how: str, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if how == "delete":
        path.unlink()
        return "deleted"
    if how == "truncate":
        cut = rng.randrange(0, len(data))
        path.write_bytes(bytes(data[:cut]))
        return f"truncated to {cut}/{len(data)}"
    pos, bit = rng.randrange(len(data)), rng.randrange(8)
    data[pos] ^= 1 << bit
    path.write_bytes(bytes(data))
    return f"bit {bit} of byte {pos}/{len(data)}"


def build_corruption_fixture(root: Path, steps: int = 3) -> tuple[list[Tier], Replay]:
    """Steps 1..steps, each committed on three tiers with different codecs."""
    tiers = [Tier("local", str(root / "local"), keep=10, codec="lz4"),
             Tier("shared", str(root / "shared"), keep=10, codec="zstd"),
             Tier("durable", str(root / "durable"), keep=10, codec="none")]
    replay = Replay()
    ck = TieredCheckpointer(tiers, retry=FAST_RETRY, threads=2, frame_size=FRAME)
    for s in range(1, steps + 1):
        ck.maybe_save(s, replay.state(s), force=True)
    ck.close()
    return tiers, replay


def direct_load_detects(url: Path, replay: Replay, step: int) -> str:
    """'detected' (error), 'absent' (not a checkpoint), 'equal' (harmless), or 'WRONG'."""
    want = replay.state(step)
    got = zeros_like_state(want)
    try:
        dcp.load(got, storage_reader=CompressedReader(url, threads=2), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - DCP wraps reader errors in CheckpointException
        inner = getattr(exc, "failures", None)
        if inner:
            exc = next(iter(inner.values()))
            exc = exc[0] if isinstance(exc, tuple) else exc
        if isinstance(exc, FileNotFoundError) and not (url / ".metadata").exists():
            return "absent"
        return "detected" if isinstance(exc, DcpTieredError) else f"detected-foreign:{type(exc).__name__}"
    return "equal" if same_values(got, want) is None else "WRONG"


def run_corruptions(n: int, root: "str | Path", *, seed: int = 0, log=print) -> dict[str, Any]:
    """``n`` trials: corrupt 1-3 random files of the newest step(s) on random tiers; restore must fall back."""
    rng = random.Random(seed)
    root = Path(root)
    pristine = root / "pristine"
    shutil.rmtree(root, ignore_errors=True)
    tiers, replay = build_corruption_fixture(pristine)
    totals: Counter = Counter()
    t0 = time.monotonic()
    for t in range(n):
        work = root / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        wt = [dataclasses.replace(x, url=str(work / x.name)) for x in tiers]
        damaged: set[tuple[int, str]] = set()
        for _ in range(rng.choice((1, 1, 2, 3))):
            tier = rng.choice(wt)
            step = rng.choice((3, 3, 2))
            d = Path(tier.url) / f"step_{step:09d}"
            files = sorted(p for p in d.iterdir() if p.name == ".metadata" or p.name.endswith(".distcp"))
            if not files:
                continue
            f = rng.choice(files)
            how = rng.choice(CORRUPTIONS)
            corrupt_file(f, how, rng)
            kind = "metadata" if f.name == ".metadata" else "data"
            totals[f"injected_{how}_{kind}"] += 1
            damaged.add((step, tier.name))
            outcome = direct_load_detects(d, replay, step)
            totals[f"direct_load_{outcome.split(':')[0]}"] += 1
            if outcome == "WRONG" or outcome.startswith("detected-foreign"):
                totals["FAIL_" + outcome] += 1
                log(f"  trial {t}: {how} of {f} -> {outcome}")
        # restore must give the newest step that has an undamaged copy, exactly
        intact = [(s, i) for s in (3, 2, 1) for i, x in enumerate(wt) if (s, x.name) not in damaged]
        expect = max(s for s, _ in intact)
        ck = TieredCheckpointer(wt, resume_promotions=False, threads=2)
        target = zeros_like_state(initial_state())
        r = ck.restore(target)
        ck.close()
        totals["trials"] += 1
        if r is None:
            totals["FAIL_nothing_restored"] += 1
        elif r < expect:
            totals["FAIL_restored_older_than_an_intact_copy"] += 1
        elif same_values(target, replay.state(r)) is not None:
            totals["FAIL_restored_wrong_values"] += 1
        else:
            totals["restore_correct"] += 1
            totals["restore_fell_back_to_older_step" if r < 3 else "restore_newest_step"] += 1
        if ck.restore_failures:
            totals["restore_candidates_skipped_as_corrupt"] += ck.restore_failures
    totals["seconds"] = round(time.monotonic() - t0)
    shutil.rmtree(root, ignore_errors=True)
    return {"totals": dict(totals)}


# --------------------------------------------------------------------------- fuzzing


def _mutate(buf: bytearray, rng: random.Random) -> bytearray:
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(("flip", "set", "cut", "insert", "delete", "splice"))
        pos = rng.randrange(max(1, len(buf)))
        if kind == "flip" and buf:
            buf[pos] ^= 1 << rng.randrange(8)
        elif kind == "set" and buf:
            buf[pos] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        elif kind == "cut":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == "delete":
            del buf[pos:pos + rng.randint(1, 16)]
        elif kind == "splice" and len(buf) > 8:  # copy a run of bytes elsewhere (plausible-looking garbage)
            a = rng.randrange(len(buf) - 4)
            run = buf[a:a + rng.randint(1, 32)]
            buf[pos:pos + len(run)] = run
    return buf


def run_fuzz(n: int, root: "str | Path", *, seed: int = 0, log=print) -> dict[str, Any]:
    """``n`` random mutations of a real checkpoint's data file and/or ``.metadata``, loaded with verify on.

    An outcome is ``detected`` (a ``DcpTieredError``), ``unchanged-equal`` (the mutation left the
    loaded values intact, e.g. bytes after the data), or a failure: wrong values, or any other
    exception escaping the reader.  Runs under an address-space cap so a reader that trusted a
    lying size fails fast instead of exhausting memory.
    """
    import resource

    rng = random.Random(seed)
    root = Path(root)
    shutil.rmtree(root, ignore_errors=True)
    g = torch.Generator().manual_seed(seed)
    sd = {"f32": torch.randn(5000, generator=g), "bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
          "i64": torch.randint(0, 9, (900,), generator=g), "zeros": torch.zeros(4000), "meta": {"epoch": 3, "name": "x"}}
    ckpts = []
    for codec in ("none", "lz4", "zstd"):
        path = root / codec
        dcp.save(sd, storage_writer=CompressedWriter(path, codec=codec, frame_size=4096, threads=2), no_dist=True)
        ckpts.append((path, (path / "__0_0.distcp").read_bytes(), (path / ".metadata").read_bytes()))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), hard))
    totals: Counter = Counter()
    t0 = time.monotonic()
    try:
        for t in range(n):
            path, data, meta = rng.choice(ckpts)
            target = rng.choice(("data", "data", "metadata", "both"))
            new_data = _mutate(bytearray(data), rng) if target in ("data", "both") else bytearray(data)
            new_meta = _mutate(bytearray(meta), rng) if target in ("metadata", "both") else bytearray(meta)
            (path / "__0_0.distcp").write_bytes(bytes(new_data))
            (path / ".metadata").write_bytes(bytes(new_meta))
            out = {"f32": torch.zeros(5000), "bf16": torch.zeros(3000, dtype=torch.bfloat16),
                   "i64": torch.zeros(900, dtype=torch.int64), "zeros": torch.ones(4000), "meta": {"epoch": 0, "name": ""}}
            outcome = "equal"
            try:
                dcp.load(out, storage_reader=CompressedReader(path, threads=1), no_dist=True)
            except BaseException as exc:  # noqa: BLE001
                inner = getattr(exc, "failures", None)
                if inner:
                    e = next(iter(inner.values()))
                    exc = e[0] if isinstance(e, tuple) else e
                outcome = "detected" if isinstance(exc, DcpTieredError) else f"FOREIGN {type(exc).__name__}: {str(exc)[:120]}"
            if outcome == "equal":
                same = all(torch.equal(out[k], sd[k]) for k in ("f32", "bf16", "i64", "zeros")) and out["meta"] == sd["meta"]
                changed = bytes(new_meta) != meta or bytes(new_data[:len(data)]) != data or len(new_data) < len(data)
                if not same:
                    outcome = "WRONG VALUES"
                elif changed:
                    outcome = "equal-despite-change"  # e.g. a flip inside unused pickle padding
                else:
                    outcome = "unchanged-equal"
            key = outcome if outcome in ("detected", "equal-despite-change", "unchanged-equal") else "FAIL " + outcome
            totals[f"{target}:{key.split(':')[0]}"] += 1
            totals["cases"] += 1
            if key.startswith("FAIL"):
                totals["FAIL"] += 1
                log(f"  case {t} ({path.name}, {target}): {outcome}")
            if (t + 1) % 1000 == 0:
                log(f"[{t + 1}/{n}] {dict(totals)}")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        shutil.rmtree(root, ignore_errors=True)
    totals["seconds"] = round(time.monotonic() - t0)
    return {"totals": dict(totals)}


# --------------------------------------------------------------------------- hostile-input fuzzing
#
# ``--hostile N``: N crafted inputs, each loaded in a child process under a timeout and an
# address-space limit.  A case is one of
#
# * ``opcode``: a real ``.metadata`` (native zstd/lz4/none, stock, stock+zstd) split into
#   pickle opcodes (``pickletools.genops``) and mutated as opcodes: delete, duplicate, swap,
#   move or repeat opcodes, change their arguments (ints, strings, memo indices), inject
#   BUILD/REDUCE/NEWOBJ/GLOBAL of allowed and disallowed names, deep nesting, huge counts,
#   colliding keys, huge lengths;
# * ``bytes``: the same pickles mutated as bytes;
# * ``record``: one field of one table or record set to a hostile value (wrong type,
#   negative, huge, nested, None), re-pickled;
# * ``intent``: a valid promotion intent (``.promote-0.json``) mutated as JSON (wrong types,
#   ``[]``, nesting, target == source, missing or extra fields), then a ``TieredCheckpointer``
#   is built (resuming promotions), waited for, restored and listed;
# * ``table``, ``paths``, ``marker``, ``lightning_ref``, ``accelerate``, ``deepdir``: format-3
#   tables of tensors in 600-1,100 chunks, planner paths through ``convert``, replica markers
#   through ``dcp-tiered ls --replicas``/``gc`` and retention, the Lightning plugin's references,
#   Accelerate's ``save_state``/``load_state``, trees 1,100+ deep in a tier (tools/hostile_classes.py).
#
# ``hostile_kind`` draws each case's class from ``HOSTILE_WEIGHTS`` by its seed and number; every
# outcome counts as one of ``CATEGORIES`` (``outcome_category``).  A case running past
# ``case_timeout`` is interrupted by SIGALRM, counted as a hang, and its child replaced.
#
# The mutated pickle is written with a correct integrity trailer or none (stock style), so
# the checksum does not hide the loader.  Every exception must be a ``DcpTieredError``.
# After every case the same child saves and loads a small checkpoint (poisoning check) and,
# for intents, checks that the committed steps still load.  A child that crashes or hangs
# is replaced; its case is pinned from the per-case journal and rerun alone.

_HOSTILE_BASES = ("zstd", "lz4", "none", "stock", "stock-zstd")
_STRINGS = ("", "..", "../../etc/passwd", "/etc/passwd", "a" * 70000, "\x00", "float32", "__class__", "__getstate__",
            "torch.float32", "fmt", "frames", "file", "bytes", "tensor", "zstd:99", "bytegroup", "model.w")
_INTS = (0, 1, -1, 2, 255, 4096, 65535, 2**31 - 1, 2**32, 2**62, 2**63 - 1, 2**64, -2**63, 10**18)
_ALLOWED_GLOBALS = (("torch.distributed.checkpoint.metadata", "Metadata"), ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
                    ("torch.distributed.checkpoint.metadata", "TensorProperties"), ("torch.distributed.checkpoint.metadata", "StorageMeta"),
                    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"), ("torch", "Size"), ("torch", "float32"),
                    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict"),
                    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"),
                    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"))
_BAD_GLOBALS = (("os", "system"), ("builtins", "eval"), ("posix", "system"), ("builtins", "getattr"), ("torch", "load"),
                ("pathlib", "Path.write_text"), ("collections", "Counter"))


def _p_str(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return (b"\x8c" + bytes([len(raw)]) + raw) if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little") + raw


def _p_int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + v.to_bytes(2, "little")
    if -2**31 <= v < 2**31:
        return b"J" + v.to_bytes(4, "little", signed=True)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _p_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _snippet(rng: random.Random) -> bytes:
    """One hostile opcode sequence that leaves one object on the stack (or breaks the pickle)."""
    g = _p_global(*rng.choice(_ALLOWED_GLOBALS))
    k = rng.choice((10, 100, 1000, 100_000, 1_000_000))
    kind = rng.randrange(16)
    if kind == 0:  # BUILD with slot state on an allowed class / function
        return g + b"N}" + _p_str(rng.choice(("__getstate__", "__init__", "__reduce_ex__", "__hash__"))) + _p_global("builtins", "dict") + b"s\x86b"
    if kind == 1:  # BUILD with a dict on a class
        return g + b"}" + _p_str(rng.choice(("__getstate__", "x", "__dict__"))) + b"Nsb"
    if kind == 2:  # REDUCE of an allowed name with random arguments
        args = rng.choice((b")", b"N\x85", _p_int(rng.choice(_INTS)) + b"\x85", _p_str(rng.choice(_STRINGS)) + b"\x85",
                           b"(" + _p_int(1) * rng.choice((2, 70, 5000)) + b"t\x85", b"}\x85", b"]\x85"))
        return g + args + b"R"
    if kind == 3:
        return _p_global(*rng.choice(_BAD_GLOBALS)) + _p_str("true") + b"\x85R"
    if kind == 4:  # deep nesting
        return b"N" + rng.choice((b"\x85", b"\x85\x85", b"]")) * k if rng.random() < 0.5 else b"N" + b"\x85" * k + b"N" + b"\x86"
    if kind == 5:  # deep key
        return b"}" + b"N" + b"\x85" * k + b"Ns"
    if kind == 6:  # huge count
        return b"(" + _p_int(rng.choice((1, 300))) * k + rng.choice((b"t", b"l", b"\x91", b"d", b"0"))
    if kind == 7:  # colliding keys
        mod = (1 << 61) - 1
        return b"}(" + b"".join(_p_int(i * mod) + b"N" for i in range(1, rng.choice((100, 20000)))) + b"u"
    if kind == 8:
        return b"\x8b" + struct.pack("<i", rng.choice((2**30, 2**31 - 1, 100, -5))) + b"\x00" * 16
    if kind == 9:
        return rng.choice((b"\x8e", b"\x8d", b"\x96")) + struct.pack("<Q", rng.choice((2**40, 2**63, 100)))
    if kind == 10:
        return b"\x95" + struct.pack("<Q", rng.choice((2**50, 0, 7)))
    if kind == 11:
        return b"N" + rng.choice((b"r" + struct.pack("<I", rng.choice((2**31, 2**32 - 1, 10**6))), b"j" + struct.pack("<I", 2**32 - 1)))
    if kind == 12:  # NEWOBJ / NEWOBJ_EX with arguments, or on a non-dataclass
        return g + rng.choice((b"(K\x01t\x81", b")\x81", b")}\x92", b"(N\x85t\x81"))
    if kind == 13:
        return rng.choice((b"(itorch\nSize\n", b"(" + g + b"o", b"P1\n", b"\x82\x01", b"Q"))
    if kind == 14:  # BUILD on a fresh instance with odd state
        state = rng.choice((b"N}\x86", b"}" + _p_str("__class__") + b"Ns", b"(NNNNNt", b"]", b"}" + _p_int(5) + b"Ns"))
        return _p_global("torch.distributed.checkpoint.metadata", rng.choice(("StorageMeta", "TensorProperties", "MetadataIndex"))) + b")\x81" + state + b"b"
    return b"\x8f(" + _p_str("a") + _p_int(1) + b"\x90"  # ADDITEMS with a non-str member


def _split_ops(body: bytes) -> list[bytes]:
    import pickletools

    pos = [p for _, _, p in pickletools.genops(body)]
    return [body[a:b] for a, b in zip(pos, pos[1:] + [len(body)])]


def _mutate_arg(seg: bytes, rng: random.Random) -> bytes:
    op = seg[:1]
    if op in (b"K", b"M", b"J", b"\x8a", b"\x8b"):
        return _p_int(rng.choice(_INTS) if rng.random() < 0.7 else rng.randrange(-5, 70000))
    if op in (b"\x8c", b"X", b"\x8d"):
        return _p_str(rng.choice(_STRINGS) if rng.random() < 0.7 else "".join(rng.choice("ab./_\x00") for _ in range(5)))
    if op in (b"h", b"q"):
        return op + bytes([rng.randrange(256)])
    if op in (b"j", b"r"):
        return op + struct.pack("<I", rng.choice((0, 1, rng.randrange(400), 2**31, 2**32 - 1)))
    if op in (b"\x88", b"\x89", b"N"):
        return rng.choice((b"\x88", b"\x89", b"N", b")", b"}", b"]"))
    if op in (b"c",) or op == b"\x93":
        return _p_global(*rng.choice(_ALLOWED_GLOBALS + _BAD_GLOBALS))
    return seg


def mutate_pickle_ops(body: bytes, rng: random.Random) -> bytes:
    """Mutate a pickle at the opcode level (see the section comment)."""
    segs = _split_ops(body)
    for _ in range(rng.choice((1, 1, 2, 3))):
        inner = max(1, len(segs) - 1)  # keep STOP last most of the time
        i, j = rng.randrange(1, inner) if inner > 1 else 0, rng.randrange(1, inner) if inner > 1 else 0
        how = rng.randrange(8)
        if how == 0:
            del segs[i]
        elif how == 1:
            segs.insert(i, segs[j])
        elif how == 2:
            segs[i], segs[j] = segs[j], segs[i]
        elif how == 3:
            segs.insert(j, segs.pop(i))
        elif how == 4:
            segs[i:i + 1] = [segs[i]] * rng.choice((2, 10, 1000, 100_000))
        elif how in (5, 6):
            segs[i] = _mutate_arg(segs[i], rng)
        else:
            segs.insert(i, _snippet(rng) + (b"0" if rng.random() < 0.5 else b""))
    return b"".join(segs)


_HOSTILE_VALUES = (None, -1, 0, 2**64, 2**62, "x", "", [], {}, (), (1,), [1, 2], {"a": 1}, 1.5, True, b"x", ((((1,),),),),
                   tuple(range(70)), "../x", "/etc/passwd", float("nan"))


def mutate_record(md: Any, rng: random.Random) -> None:
    """Set one field of one table or record of a plain-unpickled Metadata to a hostile value."""
    value = rng.choice(_HOSTILE_VALUES)
    where = rng.randrange(6)
    if where <= 2 and md.storage_data:
        index = rng.choice(list(md.storage_data))
        rec = md.storage_data[index]
        if isinstance(rec, dict):
            field = rng.choice(sorted(rec) + ["extra"])
            rec[field] = value if rng.random() < 0.8 else (tuple(rec.get(field) or ()) * 3 if field in ("frames", "sums", "shape") else value)
        else:
            setattr(rec, rng.choice(("relative_path", "offset", "length", "transform_descriptors")), value)
        if rng.random() < 0.1:
            md.storage_data[value if isinstance(value, (str, int, tuple)) and not isinstance(value, bool) else str(value)] = rec
    elif where == 3 and md.state_dict_metadata:
        fqn = rng.choice(sorted(md.state_dict_metadata))
        item = md.state_dict_metadata[fqn]
        target = rng.choice([item] + list(getattr(item, "chunks", []) or []) + ([item.properties] if hasattr(item, "properties") else []))
        setattr(target, rng.choice(("chunks", "size", "offsets", "sizes", "dtype", "properties")), value)
    elif where == 4:
        setattr(md, rng.choice(("planner_data", "storage_meta", "version", "state_dict_metadata", "storage_data")), value)
    else:
        md.state_dict_metadata[rng.choice(("x", "w"))] = value


def mutate_intent(doc: dict, rng: random.Random) -> Any:
    """A JSON-level mutation of a valid promotion intent."""
    how = rng.randrange(10)
    if how == 0:
        return rng.choice(([], None, 5, "x", [doc], {"a": doc}))
    if how == 1:
        deep: Any = doc
        for _ in range(rng.choice((50, 5000, 100_000))):
            deep = [deep]
        return deep
    doc = json.loads(json.dumps(doc))
    field = rng.choice(sorted(doc) + ["extra"])
    if how == 2:
        doc.pop(field, None)
    elif how == 3:
        doc["targets"] = doc["meta"] = [doc.get("source", "local")]  # target == source
    elif how == 4:
        doc["source"], doc["name"] = rng.choice((("durable", doc["name"]), ("local", "step_000000001"), ("nope", doc["name"]),
                                                  ("local", "../step_000000001"), ("local", "step_000000002/..")))
    elif how == 5:
        doc["data_file"] = rng.choice(("../../x", "/etc/passwd", None, 5, ".metadata", "__0_0.distcp"))
    elif how == 6 and doc.get("records"):
        rec = rng.choice(doc["records"])
        rec[rng.randrange(2)] = rng.choice((None, 5, "x", [], [[]], {"fmt": 1}))
    else:
        doc[field] = rng.choice((None, 5, -1, "x", [], {}, [[["deep"]]], [5], ["local", "local"], True, 1.5, "local"))
    return doc


def _hostile_fixtures(work: Path) -> dict[str, Any]:
    """Build the base checkpoints and tiers one child works on."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    from dcp_tiered.dcp.metadata_io import encode_metadata  # noqa: F401 - imported for the child

    g = torch.Generator().manual_seed(7)
    sd = {"w": torch.randn(3000, generator=g), "h": torch.randn(2000, generator=g).to(torch.bfloat16),
          "ids": torch.arange(700), "meta": {"epoch": 3, "name": "x"}}
    bases = {}
    for name in _HOSTILE_BASES:
        path = work / "bases" / name
        if name.startswith("stock"):
            ext = [ZStandard()] if name == "stock-zstd" else []
            dcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=False, _extensions=ext), no_dist=True)
        else:
            dcp.save(sd, storage_writer=CompressedWriter(path, codec=name, frame_size=4096, threads=1, sync_files=False), no_dist=True)
        raw = (path / ".metadata").read_bytes()
        body = raw[: -len(b"\x00dcp_tiered.md1") - 8] if raw[-23:-8] == b"\x00dcp_tiered.md1" else raw
        bases[name] = (path, raw, body)
    tiers_root = work / "tiers"
    tiers = [Tier("local", str(tiers_root / "local"), keep=5, codec="lz4"), Tier("durable", str(tiers_root / "durable"), keep=5, codec="zstd")]
    ck = TieredCheckpointer(tiers, retry=FAST_RETRY, threads=1, frame_size=4096)
    ck.maybe_save(1, sd, force=True)
    ck.close()
    # step 2 committed on the fast tier only, with the intent its promotion would have written
    dcp.save(sd, storage_writer=CompressedWriter(tiers_root / "local" / "step_000000002", codec="lz4", frame_size=4096, threads=1,
                                                 sync_files=False), no_dist=True)
    from dcp_tiered.dcp.format import record_view
    from dcp_tiered.dcp.metadata_io import decode_metadata
    from dcp_tiered.tiers.promote.intents import index_to_json

    step2 = tiers_root / "local" / "step_000000002"
    md = decode_metadata((step2 / ".metadata").read_bytes(), "x")
    intent = {"name": "step_000000002", "source": "local", "data_file": "__0_0.distcp",
              "records": [[index_to_json(i), record_view(r).to_json()] for i, r in md.storage_data.items()], "targets": ["durable"], "meta": ["durable"],
              "save_id": getattr(md.storage_meta, "save_id", None)}
    snapshot = work / "tiers-pristine"
    shutil.copytree(tiers_root, snapshot)
    return {"sd": sd, "bases": bases, "tiers": tiers, "tiers_root": tiers_root, "snapshot": snapshot, "intent": intent}


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0, "name": ""} for k, v in sd.items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k] for k in b)


def _error_of(exc: BaseException) -> BaseException:
    inner = getattr(exc, "failures", None)
    if inner:
        e = next(iter(inner.values()))
        return e[0] if isinstance(e, tuple) else e
    return exc


def _from_dcp_planner(err: BaseException) -> bool:
    """Raised by DCP's default load planner (state dict vs checkpoint mismatch), not by this package."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.endswith(os.path.join("torch", "distributed", "checkpoint", "default_planner.py"))


#: Share of each case class in a run (the ``.metadata`` pickle classes first, then tools/hostile_classes.py's).
HOSTILE_WEIGHTS = {"opcode": 0.22, "record": 0.09, "bytes": 0.05, "intent": 0.06, "table": 0.18, "paths": 0.11,
                   "marker": 0.08, "lightning_ref": 0.06, "accelerate": 0.10, "deepdir": 0.05}


def hostile_kind(seed: int, i: int, kinds: tuple[str, ...] | None = None) -> str:
    """The class of case ``i`` of a run with ``seed`` (deterministic; ``kinds`` restricts the classes)."""
    weights = {k: w for k, w in HOSTILE_WEIGHTS.items() if kinds is None or k in kinds}
    roll = random.Random(f"{seed}:{i}:kind").random() * sum(weights.values())
    for kind, w in weights.items():
        roll -= w
        if roll < 0:
            return kind
    return kind


def _hostile_case(fx: dict, seed: int, i: int, kinds: tuple[str, ...] | None = None) -> str:
    """Run case ``i``; return its outcome ``kind:outcome`` (see ``outcome_category``)."""
    kind = hostile_kind(seed, i, kinds)
    rng = random.Random(f"{seed}:{i}")
    if kind == "intent":
        return "intent:" + _intent_case(fx, rng)
    if kind not in ("opcode", "record", "bytes"):
        from tools import hostile_classes

        hostile_classes.NOTE.clear()
        hostile_classes.NOTE["case"] = i
        return f"{kind}:" + getattr(hostile_classes, f"{kind}_case")(fx["classes"], rng)
    return f"{kind}:" + _metadata_case(fx, kind, rng)


def _metadata_case(fx: dict, kind: str, rng: random.Random) -> str:
    import pickle as _pickle

    from dcp_tiered.codecs import checksum as _checksum

    base = rng.choice(_HOSTILE_BASES)
    path, raw, body = fx["bases"][base]
    if kind == "record":
        md = _pickle.loads(body)
        mutate_record(md, rng)
        try:
            new = _pickle.dumps(md, protocol=rng.choice((2, 4, 5)))
        except Exception:  # noqa: BLE001 - an unpicklable value: nothing to test
            return "skipped"
    elif kind == "bytes":
        new = bytes(_mutate(bytearray(body), rng))
    else:
        new = mutate_pickle_ops(body, rng)
    if rng.random() < 0.5:  # a correct trailer: the checksum must not be what stops it
        new = new + b"\x00dcp_tiered.md1" + _checksum((new,)).to_bytes(8, "little")
    (path / ".metadata").write_bytes(new)
    out = _zeros(fx["sd"])
    try:
        try:
            dcp.load(out, storage_reader=CompressedReader(path, threads=1, max_object_bytes=64 << 20), no_dist=True)
        except BaseException as exc:  # noqa: BLE001
            err = _error_of(exc)
            if isinstance(err, DcpTieredError):
                return "detected"
            if _from_dcp_planner(err):
                # a well-formed checkpoint of another state dict: DCP's planner compares it with
                # the caller's state dict before any reader code runs
                return "KNOWN_dcp_planner_mismatch"
            return f"FAIL builtin {type(err).__name__}: {str(err)[:160]}"
        if _same(out, fx["sd"]):
            return "loaded"
        # stock checkpoints carry no checksums: a changed offset can select other valid bytes
        return "KNOWN_stock_loaded_other_values" if base.startswith("stock") else f"FAIL wrong: loaded other values ({base})"
    finally:
        (path / ".metadata").write_bytes(raw)


def _intent_case(fx: dict, rng: random.Random) -> str:
    root, snap = fx["tiers_root"], fx["snapshot"]
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(snap, root)
    doc = mutate_intent(fx["intent"], rng)
    text = json.dumps(doc) if not (isinstance(doc, list) and doc and isinstance(doc[0], list)) else "[" * 100_000 + "]" * 100_000
    tier, name = rng.choice((("local", "step_000000002"), ("local", "step_000000002"), ("local", "step_000000001"),
                             ("durable", "step_000000001")))
    (root / tier / name / ".promote-0.json").write_text(text)
    outcome = "ok"
    try:
        ck = TieredCheckpointer(fx["tiers"], retry=FAST_RETRY, threads=1, frame_size=4096)
        t_wait = time.monotonic()
        try:
            ck.wait()
        except DcpTieredError:
            outcome = "promotion-error"
        if time.monotonic() - t_wait > 2.5:  # waited for fragments until metadata_timeout (1 h by default)
            outcome = "KNOWN_metadata_wait_timeout"
        out = _zeros(fx["sd"])
        step = ck.restore(out)
        ck.list()
        ck.close()
    except BaseException as exc:  # noqa: BLE001
        if not isinstance(exc, DcpTieredError):
            return f"FAIL builtin {type(exc).__name__}: {str(exc)[:160]}"
        outcome = "detected"
    else:
        if step is None or not _same(out, fx["sd"]):
            return f"FAIL wrong: restore gave {step}"
    for tier in ("local", "durable"):  # the committed step 1 must survive on both tiers
        back = _zeros(fx["sd"])
        try:
            dcp.load(back, storage_reader=CompressedReader(root / tier / "step_000000001", threads=1), no_dist=True)
        except BaseException as exc:  # noqa: BLE001
            return f"FAIL wrong: committed step 1 on {tier} damaged: {type(_error_of(exc)).__name__}"
        if not _same(back, fx["sd"]):
            return f"FAIL wrong: committed step 1 on {tier} has other values"
    return "loaded" if outcome == "ok" else outcome


def _poisoned(work: Path, n: int) -> str | None:
    """Save and load a small checkpoint in this process: None if it round-trips."""
    path = work / "poison" / str(n)
    sd = {"x": torch.arange(3000, dtype=torch.float32), "m": {"k": n}}
    try:
        dcp.save(sd, storage_writer=CompressedWriter(path, threads=1, sync_files=False), no_dist=True)
        back = {"x": torch.zeros(3000), "m": {"k": -1}}
        dcp.load(back, storage_reader=CompressedReader(path, threads=1), no_dist=True)
    except BaseException as exc:  # noqa: BLE001
        return f"{type(_error_of(exc)).__name__}: {str(_error_of(exc))[:160]}"
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return None if torch.equal(back["x"], sd["x"]) and back["m"] == sd["m"] else "other values"


#: Exit status of a child that stopped after a case ran past its time (the parent starts a fresh one).
_EXIT_TIMED_OUT = 75


class _CaseTimeout(BaseException):
    """Raised by SIGALRM in a case that ran past ``case_timeout``."""


def hostile_child(work: str, seed: int, cases: list[int], journal: str, case_timeout: float = 8.0,
                  kinds: tuple[str, ...] | None = None) -> None:
    """Child entry point: run ``cases``, journal one JSON line per case (before and after).

    A case still running after ``case_timeout`` seconds is interrupted (SIGALRM), journaled as a hang,
    and the child exits: what the interrupted code left behind must not count against the next cases."""
    logging.disable(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    w = Path(work)
    from tools.hostile_classes import Fixtures, remove_deep

    remove_deep(w)
    fx = _hostile_fixtures(w)
    fx["classes"] = Fixtures(w / "classes")
    # A resumed intent whose metadata commit waits for other ranks' fragments would wait an
    # hour (metadata_timeout); 3 s here, so such a case is counted, not a stalled child.
    from dcp_tiered.tiers.promote.promoter import Promoter

    Promoter.__init__.__kwdefaults__["metadata_timeout"] = 3.0
    late = []
    from tools.hostile_classes import NOTE

    def on_alarm(signum: int, frame: Any) -> None:
        if NOTE.get("case") == current[0] and "how" not in NOTE:
            # the harness still prepares the case (copies, fixtures): the clock starts at the entry point
            signal.setitimer(signal.ITIMER_REAL, case_timeout)
            return
        if NOTE.get("case") == current[0] and "entry_t" in NOTE:
            # timed from the case's entry (its ``how``), with the extra time it was granted (the
            # filesystem's own measured cost of what it built: deep trees delete as slowly as made)
            left = NOTE["entry_t"] + case_timeout + NOTE.get("extra_s", 0.0) - time.monotonic()
            if left > 0.01:
                signal.setitimer(signal.ITIMER_REAL, left)
                return
        late.append(True)  # the case may catch the exception (DCP wraps it): the flag decides
        raise _CaseTimeout(f"over {case_timeout} s")

    current = [None]

    signal.signal(signal.SIGALRM, on_alarm)
    with open(journal, "a") as j:
        for i in cases:
            j.write(json.dumps({"start": i}) + "\n")
            j.flush()
            current[0] = i
            if hostile_kind(seed, i, kinds) in fx["classes"].builders:
                fx["classes"].get(hostile_kind(seed, i, kinds))  # built before the clock starts
            t0 = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, case_timeout)
            try:
                outcome = _hostile_case(fx, seed, i, kinds)
            except _CaseTimeout:
                outcome = ""
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if late:
                outcome = (f"{hostile_kind(seed, i, kinds)}:FAIL hang: still running after {case_timeout} s, interrupted"
                           + (f" [{NOTE['how']}]" if NOTE.get("case") == i and "how" in NOTE else ""))
            seconds = round(time.monotonic() - t0, 3)
            poison = None if late else _poisoned(w, i)
            j.write(json.dumps({"case": i, "outcome": outcome, "poisoned": poison, "s": seconds}) + "\n")
            j.flush()
            if late:
                os._exit(_EXIT_TIMED_OUT)


def _run_hostile_batch(work: Path, seed: int, cases: list[int], timeout: float, memory_mb: int,
                       stall_s: float = 90.0, case_timeout: float = 8.0,
                       kinds: tuple[str, ...] | None = None) -> tuple[dict[int, dict], int | None, str]:
    """Run ``cases`` in one child; return per-case results, the case it died in (or None) and how."""
    import subprocess

    journal = work / f"journal-{cases[0]}.jsonl"
    journal.unlink(missing_ok=True)
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory_mb << 20}, {memory_mb << 20}))\n"
            f"from tools.crash_harness import hostile_child\n"
            f"hostile_child({str(work / 'child')!r}, {seed}, {cases!r}, {str(journal)!r}, {case_timeout!r}, {kinds!r})\n")
    errfile = work / f"stderr-{cases[0]}.txt"
    with open(errfile, "wb") as errf:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parent.parent),
                                stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True)
    how = ""
    # a hang is a case that makes no progress for ``stall_s`` (the journal does not grow), or a
    # batch past ``timeout`` overall
    start = last_change = time.monotonic()
    last_size = -1
    while proc.poll() is None:
        time.sleep(0.5)
        size = journal.stat().st_size if journal.exists() else 0
        now = time.monotonic()
        if size != last_size:
            last_size, last_change = size, now
        if now - last_change > stall_s or now - start > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            how = "hang"
            break
    proc.wait()
    if not how and proc.returncode not in (0, _EXIT_TIMED_OUT):
        how = f"crash (exit {proc.returncode}): {errfile.read_text(errors='replace')[-300:]}"
    done: dict[int, dict] = {}
    started = None
    if journal.exists():
        for line in journal.read_text().splitlines():
            rec = json.loads(line)
            if "start" in rec:
                started = rec["start"]
            else:
                done[rec["case"]] = rec
    died_in = started if how and started is not None and started not in done else None
    return done, died_in, how


#: The columns of the per-class summary, as ``outcome_category`` names them.
CATEGORIES = ("refused", "verified", "known", "skipped", "crash", "hang", "builtin", "wrong", "poisoned")


def outcome_category(outcome: str) -> str:
    """What a case's outcome counts as: ``refused`` (a ``DcpTieredError`` or a documented exit code),
    ``verified`` (it succeeded and what it gave was checked exactly), ``known`` (a known limit or filed bug),
    ``skipped``, or the failures ``hang``, ``builtin`` (an error that is no ``DcpTieredError``, or exit 70)
    and ``wrong`` (succeeded with other values, or lost or changed something)."""
    if outcome.startswith("FAIL hang"):
        return "hang"
    if outcome.startswith(("FAIL builtin", "FAIL foreign")):
        return "builtin"
    if outcome.startswith("FAIL"):
        return "wrong"
    if outcome.startswith("KNOWN"):
        return "known"
    if outcome.startswith("skipped"):
        return "skipped"
    return "verified" if outcome == "loaded" else "refused"


def run_hostile(n: int, root: "str | Path", *, seed: int = 0, batch: int = 250, per_case_s: float = 6.0,
                memory_mb: int = 6144, case_timeout: float = 8.0, kinds: tuple[str, ...] | None = None,
                log=print) -> dict[str, Any]:
    """``n`` hostile-input cases in isolated children (see the section comment); return the counters."""
    from tools.hostile_classes import remove_deep  # trees deeper than shutil.rmtree can delete

    root = Path(root)
    remove_deep(root)
    root.mkdir(parents=True)
    totals: Counter = Counter()
    per_class: dict[str, Counter] = {}
    outcomes: dict[str, Counter] = {}  # class -> outcome (known reasons, refusals, failure kinds)
    failures: list[dict] = []
    pending = list(range(n))
    t0 = time.monotonic()

    def count(i: int, kind: str, category: str, outcome: str, extra: "dict | None" = None) -> None:
        c = per_class.setdefault(kind, Counter())
        c["cases"] += 1
        c[category] += 1
        totals["cases"] += 1
        if category in ("crash", "hang", "builtin", "wrong"):
            totals[f"FAIL_{category}"] += 1
            failures.append({"case": i, "class": kind, "outcome": outcome, **(extra or {})})
            log(f"  case {i} ({kind}): {outcome[:300]}")
        if category in ("known", "crash", "hang", "builtin", "wrong"):
            outcomes.setdefault(kind, Counter())[_outcome_key(category, outcome)] += 1

    while pending:
        cases, pending = pending[:batch], pending[batch:]
        done, died_in, how = _run_hostile_batch(root, seed, cases, 60 + per_case_s * len(cases), memory_mb,
                                                case_timeout=case_timeout, kinds=kinds)
        if how and died_in is None and not done:
            failures.append({"case": None, "how": how})
            totals["FAIL_child_setup"] += 1
            log(f"  child failed before its first case: {how}")
            break
        for i, rec in sorted(done.items()):
            kind, _, outcome = rec["outcome"].partition(":")
            count(i, kind, outcome_category(outcome), outcome, {"seconds": rec.get("s")})
            if rec["poisoned"]:
                per_class[kind]["poisoned"] += 1
                totals["FAIL_poisoned"] += 1
                failures.append({"case": i, "class": kind, "poisoned": rec["poisoned"]})
                log(f"  case {i} ({kind}) poisoned the process: {rec['poisoned']}")
        if died_in is not None:
            # pin it: rerun that case alone in a fresh child
            alone, _, how_alone = _run_hostile_batch(root, seed, [died_in], 60 + 10 * per_case_s, memory_mb,
                                                     case_timeout=case_timeout, kinds=kinds)
            label = "hang" if how == "hang" else "crash"
            count(died_in, hostile_kind(seed, died_in, kinds), label, f"FAIL {label}: {how[:200]}",
                  {"alone": how_alone or alone.get(died_in)})
        pending = [c for c in cases if c not in done and c != died_in] + pending
        log(f"[{totals['cases']}/{n}] {time.monotonic() - t0:.0f}s "
            + " ".join(f"{k}={v}" for k, v in sorted(totals.items()) if k != "cases"))
    totals["seconds"] = round(time.monotonic() - t0)
    remove_deep(root)
    return {"totals": dict(totals), "per_class": {k: dict(v) for k, v in sorted(per_class.items())},
            "outcomes": {k: dict(v.most_common()) for k, v in sorted(outcomes.items())}, "failures": failures[:500]}


def _outcome_key(category: str, outcome: str) -> str:
    """An outcome without its particulars (values, paths), to count alike ones together: the known reason,
    or the failure's kind, error type and the mutation that caused it (the ``[...]`` a case appends)."""
    if category == "known":
        return outcome.split(" (")[0]
    head, _, tag = outcome.rpartition(" [") if outcome.endswith("]") else (outcome, "", "")
    words = head.replace(":", " ").split()
    key = " ".join(words[:3] if category == "builtin" else words[:5])
    return f"{key} [{tag.split()[0].rstrip(']:')}]" if tag else key


def hostile_table(summary: dict[str, Any]) -> str:
    """The per-class counts of a ``run_hostile`` summary as a Markdown table."""
    cols = ("cases", *CATEGORIES)
    rows = ["| class | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    per = summary["per_class"]
    order = [k for k in HOSTILE_WEIGHTS if k in per] + sorted(set(per) - set(HOSTILE_WEIGHTS))
    for kind in order + ["all"]:
        c = per.get(kind) or Counter({col: sum(p.get(col, 0) for p in per.values()) for col in cols})
        rows.append(f"| {kind} | " + " | ".join(str(c.get(col, 0)) for col in cols) + " |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- CLI


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.crash_harness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=0, help="SIGKILL trials (crash consistency)")
    ap.add_argument("--corruptions", type=int, default=0, help="corruption + restore-fallback trials")
    ap.add_argument("--fuzz", type=int, default=0, help="mutated-checkpoint load cases")
    ap.add_argument("--hostile", type=int, default=0,
                    help="hostile-input cases (opcode-level .metadata, records, bytes, intents, format-3 tables, planner "
                         "paths, replica markers, Lightning references, Accelerate state, deep directories), in isolated "
                         "children")
    ap.add_argument("--batch", type=int, default=250, help="hostile cases per child process")
    ap.add_argument("--classes", default=None,
                    help=f"comma-separated hostile case classes (default all: {','.join(HOSTILE_WEIGHTS)})")
    ap.add_argument("--case-timeout", type=float, default=8.0, help="seconds a hostile case may run before it is a hang")
    ap.add_argument("--memory-mb", type=int, default=6144, help="address-space limit of a hostile child (MiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chain", type=int, default=8, help="kills per configuration before starting on fresh directories")
    ap.add_argument("--max-delay", type=float, default=1.2, help="longest run of a child before the kill (s)")
    ap.add_argument("--no-workaround", action="store_true",
                    help="let restarted children re-save steps a killed run already committed (shows the known bug)")
    ap.add_argument("--root", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args(argv)
    if not (args.kills or args.corruptions or args.fuzz or args.hostile):
        ap.error("nothing to do: pass --kills, --corruptions, --fuzz and/or --hostile")
    root = Path(args.root or tempfile.mkdtemp(prefix="crash_harness-"))
    root.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"command": "python -m tools.crash_harness " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.kills:
        summary["kills"] = run_kills(args.kills, root / "kills", seed=args.seed, chain=args.chain, max_delay=args.max_delay,
                                     workaround=not args.no_workaround)
        print(json.dumps(summary["kills"]["totals"], indent=1, sort_keys=True))
    if args.corruptions:
        summary["corruptions"] = run_corruptions(args.corruptions, root / "corrupt", seed=args.seed)
        print(json.dumps(summary["corruptions"]["totals"], indent=1, sort_keys=True))
    if args.fuzz:
        summary["fuzz"] = run_fuzz(args.fuzz, root / "fuzz", seed=args.seed)
        print(json.dumps(summary["fuzz"]["totals"], indent=1, sort_keys=True))
    if args.hostile:
        kinds = tuple(args.classes.split(",")) if args.classes else None
        if kinds and set(kinds) - set(HOSTILE_WEIGHTS):
            ap.error(f"unknown hostile classes {sorted(set(kinds) - set(HOSTILE_WEIGHTS))}; known: {', '.join(HOSTILE_WEIGHTS)}")
        summary["hostile"] = run_hostile(args.hostile, root / "hostile", seed=args.seed, batch=args.batch,
                                         memory_mb=args.memory_mb, case_timeout=args.case_timeout, kinds=kinds)
        print(json.dumps(summary["hostile"]["totals"], indent=1, sort_keys=True))
        print(hostile_table(summary["hostile"]))
        print(json.dumps(summary["hostile"]["outcomes"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, sort_keys=True))
    failed = any(k.startswith("FAIL") for part in ("kills", "corruptions", "fuzz", "hostile") if part in summary
                 for k in summary[part]["totals"])
    print("RESULT:", "FAIL" if failed else "OK", f"(work dir {root})")
    if not args.root and not failed:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    # Run the importable module's code, so that the fork server pickles the child's target
    # and config by module name (tools.crash_harness), not as __main__.
    from tools.crash_harness import main as _main

    sys.exit(_main())
