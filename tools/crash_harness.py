"""Randomized reliability harness: SIGKILL during saves, corruption campaigns, fuzzing.

Run from the repository root::

    .venv/bin/python -m tools.crash_harness --kills 200            # crash consistency
    .venv/bin/python -m tools.crash_harness --corruptions 300       # corruption + restore fallback
    .venv/bin/python -m tools.crash_harness --fuzz 5000             # hostile/malformed files

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


# --------------------------------------------------------------------------- CLI


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.crash_harness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=0, help="SIGKILL trials (crash consistency)")
    ap.add_argument("--corruptions", type=int, default=0, help="corruption + restore-fallback trials")
    ap.add_argument("--fuzz", type=int, default=0, help="mutated-checkpoint load cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chain", type=int, default=8, help="kills per configuration before starting on fresh directories")
    ap.add_argument("--max-delay", type=float, default=1.2, help="longest run of a child before the kill (s)")
    ap.add_argument("--no-workaround", action="store_true",
                    help="let restarted children re-save steps a killed run already committed (shows the known bug)")
    ap.add_argument("--root", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args(argv)
    if not (args.kills or args.corruptions or args.fuzz):
        ap.error("nothing to do: pass --kills, --corruptions and/or --fuzz")
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
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, sort_keys=True))
    failed = any(k.startswith("FAIL") for part in ("kills", "corruptions", "fuzz") if part in summary
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
