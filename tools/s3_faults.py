"""Fault injection on the S3 path: a loopback HTTP proxy in front of a moto server that loses
responses of requests it applied and fails requests before they apply, over real flows.

Run from the repository root::

    .venv/bin/python -m tools.s3_faults --trials 300 --seed 1     # prints the counts (--json FILE too)

**The proxy** (:class:`FaultProxy`) listens on 127.0.0.1 only and forwards to a server on
127.0.0.1 only (anything else is refused).  It reads each HTTP request of a kept-alive
connection whole and, on a seeded random schedule, either

* fails it *before it applies*: answers ``503 SlowDown`` without forwarding (``pre_503``), or
  closes the connection without forwarding (``pre_close``); or
* forwards it (the server applies it), then loses the response: closes the connection without
  answering (``post_close``), answers ``500 InternalError`` instead (``post_500``), or sends the
  headers and half the body and closes (``post_truncate``).

The clients are made to give up quickly (botocore retries 0 to 2 times in its legacy mode, s3fs
tries 1 or 2 times, drawn per trial), so that the faults reach the library and its own retries,
not only the SDK's.  The schedule is drawn in the order requests arrive: a seed reproduces the
fault rates and the flows, the exact request hit may differ between runs (requests run in threads).

**A trial** (:func:`run_trial`) drives, with faults on:

* ``CompressedWriter`` saves straight to S3 (exclusive commit, a conditional PUT), each retried
  once at the same path when it fails, as a user would, then loaded back;
* a ``TieredCheckpointer`` with a local fast tier and an S3 tier (``keep=2`` on both, saves
  written to S3 directly on the steps only it is due, promotions and retention on the others),
  ``wait()``, a restore, ``close()``;

and then, with faults off, checks: every save that returned success loads bit for bit (or, in
a tier, retention removed it while ``keep`` newer good steps are there); a restore (on the same
tiers, and on the S3 tier alone) returns the newest step saved or a newer one, with its exact
values; every committed checkpoint on S3 or on the local tier loads with its exact values; every
failure raised was a ``DcpTieredError`` (DCP's ``CheckpointException`` counts by its cause).
A trial that does not end within ``--trial-timeout`` is a hang (its stacks are printed and the
run stops).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import ipaddress
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PRE_FAULTS = ("pre_503", "pre_close")
POST_FAULTS = ("post_close", "post_500", "post_truncate")
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")


def _loopback(host: str) -> str:
    """``host`` if it is a loopback address (or ``localhost``); ValueError otherwise: the proxy never
    listens on, or forwards to, anything but this machine."""
    if host == "localhost":
        return "127.0.0.1"
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"{host} is not a loopback address: the fault proxy only uses 127.0.0.1/::1")
    return host


class FaultPlan:
    """The seeded schedule: each request draws a pre-apply fault with probability ``p_pre``, else
    (forwarded) a lost response with probability ``p_post``; ``enabled=False`` forwards everything.
    ``only(method, path)``: the requests that may be hit (all by default); ``limit``: at most that
    many faults in all."""

    def __init__(self, seed: int, p_pre: float = 0.0, p_post: float = 0.0, *,
                 only: Callable[[str, str], bool] | None = None, limit: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.p_pre, self.p_post = p_pre, p_post
        self.only, self.limit = only, limit
        self.enabled = True
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def _armed(self, method: str, path: str) -> bool:
        spent = sum(self.counts[f] for f in (*PRE_FAULTS, *POST_FAULTS))
        return (self.enabled and (self.limit is None or spent < self.limit)
                and (self.only is None or self.only(method, path)))

    def _count(self, fault: str, method: str) -> str:
        self.counts[fault] += 1
        self.counts[f"{fault}_{method}"] += 1
        return fault

    def pre(self, method: str, path: str) -> str | None:
        """Whether this request fails before it is forwarded, and how (counts every request)."""
        with self.lock:
            self.counts["requests"] += 1
            self.counts[f"requests_{method}"] += 1
            if self._armed(method, path) and self.rng.random() < self.p_pre:
                return self._count(self.rng.choice(PRE_FAULTS), method)
            return None

    def post(self, method: str, path: str, has_body: bool) -> str | None:
        """Whether the response of this applied request is lost, and how (truncated only when it has a body)."""
        with self.lock:
            if self._armed(method, path) and self.rng.random() < self.p_post:
                return self._count(self.rng.choice(POST_FAULTS if has_body else POST_FAULTS[:2]), method)
            return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and "Expect: 100-continue" answered
    wbufsize = 1 << 16  # a response leaves in one send (flushed after each request)
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms delayed-ACK stalls

    def handle_expect_100(self) -> bool:
        ok = super().handle_expect_100()
        self.wfile.flush()  # the client sends the body only once it has the 100 Continue
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = io.BytesIO()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return out.getvalue()
                out.write(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def _answer(self, status: int, reason: str, body: bytes) -> None:
        self.send_response(status, reason)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = self._conn = http.client.HTTPConnection(self.server.target[0], self.server.target[1], timeout=30)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if self.command not in ("GET", "HEAD", "DELETE") or body:
            headers["Content-Length"] = str(len(body))
        for attempt in (0, 1):  # a kept-alive upstream connection the server closed meanwhile: once more
            conn = self._upstream()
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _serve(self) -> None:
        body = self._body()
        pre = self.server.plan.pre(self.command, self.path)
        if pre == "pre_503":
            self._answer(503, "Slow Down", _SLOW_DOWN)
            return
        if pre == "pre_close":
            self._drop()
            return
        try:
            status, reason, headers, data = self._forward(body)
        except OSError:
            self._drop()
            return
        post = self.server.plan.post(self.command, self.path, bool(data) and self.command != "HEAD")
        if post == "post_close":
            self._drop()
            return
        if post == "post_500":
            self._answer(500, "Internal Server Error", _INTERNAL)
            return
        self.send_response(status, reason)
        for k, v in headers:
            if k.lower() not in _HOP and not (k.lower() == "content-length" and self.command != "HEAD"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if post == "post_truncate":
            self.wfile.write(data[: len(data) // 2])
            self._drop()
            return
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    plan: FaultPlan
    target: tuple[str, int]

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (it gave up on a dropped response): nothing to report


class FaultProxy:
    """An HTTP proxy on a loopback port in front of the S3 server at loopback ``target_port``,
    injecting the faults of ``plan`` (replace ``proxy.plan`` between trials)."""

    def __init__(self, target_port: int, plan: FaultPlan | None = None, host: str = "127.0.0.1",
                 target_host: str = "127.0.0.1") -> None:
        self._server = _Server((_loopback(host), 0), _Handler)
        self._server.target = (_loopback(target_host), int(target_port))
        self.plan = plan or FaultPlan(0)
        self.port = self._server.server_address[1]
        self.endpoint_url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="s3-fault-proxy")
        self._thread.start()

    @property
    def plan(self) -> FaultPlan:
        return self._server.plan

    @plan.setter
    def plan(self, plan: FaultPlan) -> None:
        self._server.plan = plan

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- a moto server of our own (the tool; the tests use the session fixture) --------------------


@contextlib.contextmanager
def moto_server() -> Iterator[int]:
    """A moto S3 server subprocess on a free loopback port; yields the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def make_bucket(port: int) -> str:
    import boto3

    name = f"f-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=name)
    return name


def storage_options(endpoint_url: str, retries: int = 0) -> dict[str, Any]:
    """s3fs options for the server at ``endpoint_url``; botocore retries a failed request ``retries`` times."""
    return {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": retries, "mode": "legacy"}, "connect_timeout": 2,
                              "read_timeout": 10}}


# -- one trial ---------------------------------------------------------------------------------


def state_for(tag: int, n: int) -> dict[str, Any]:
    """A state whose values identify ``tag`` (a mixed-up step or save is caught)."""
    import torch

    g = torch.Generator().manual_seed(tag)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.full((16,), float(tag))},
            "extra": {"tag": tag}}


def _template(n: int) -> dict[str, Any]:
    import torch

    return {"model": {"w": torch.zeros(n), "b": torch.zeros(16)}, "extra": {"tag": -1}}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return (torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"])
            and a["extra"] == b["extra"])


class Tally:
    """The counts of a run (summed over trials) and samples of what went wrong."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()  # library error types raised, by name
        self.problems: list[str] = []  # builtin errors, lost saves, wrong loads: what and where
        self.failed_paths: dict[str, str] = {}  # this trial's failed CompressedWriter saves: path -> last error
        self.failed_steps: dict[int, str] = {}  # this trial's failed maybe_save calls: step -> error
        self.notes: list[str] = []  # saves reported failed whose commit applied: what they raised

    def failure(self, exc: BaseException, where: str) -> str:
        """Count a raised error: a library error (by its root cause inside DCP's wrapper) or a builtin one;
        returns it in one line."""
        from dcp_tiered.errors import DcpTieredError
        from dcp_tiered.tiers.events import describe_error, root_cause

        cause = root_cause(exc)
        if isinstance(cause, DcpTieredError):
            self.counts["library_errors"] += 1
            self.errors[type(cause).__name__] += 1
        else:
            self.counts["builtin_errors"] += 1
            self.problem(f"{where}: builtin {type(cause).__name__}: {str(cause)[:300]}")
        return describe_error(exc)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)

    def merge(self, other: Tally) -> None:
        self.counts.update(other.counts)
        self.errors.update(other.errors)
        for p in other.problems:
            self.problem(p)
        self.notes += other.notes[: max(0, 20 - len(self.notes))]


def _load(path: str, options: dict[str, Any], n: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedReader

    out = _template(n)
    dcp.load(out, storage_reader=CompressedReader(path, storage_options=options), no_dist=True)
    return out


def _committed(options: dict[str, Any], prefix: str) -> list[str]:
    """The directories under ``prefix`` (an ``s3://`` URL) holding a ``.metadata``."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    base = prefix[len("s3://"):].rstrip("/")
    return sorted(p.rsplit("/", 1)[0] for p in fs.find(base) if p.endswith("/.metadata"))


def _writer_flow(t: Tally, seed: int, url: str, faulty: dict[str, Any], n: int, saves: int) -> dict[str, int]:
    """``CompressedWriter`` saves straight to S3 (exclusive commit); a failed one retried once; loads."""
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedWriter

    rng = random.Random(seed)
    returned: dict[str, int] = {}
    for i in range(saves):
        tag = seed * 1000 + 500 + i
        path = f"{url}/cw/save_{i}"
        codec = rng.choice(["lz4", "zstd", "none"])
        for attempt in (1, 2):
            t.counts["saves_attempted"] += 1
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.save(state_for(tag, n), storage_writer=CompressedWriter(path, storage_options=faulty, codec=codec),
                             no_dist=True)
            except BaseException as exc:  # every failure is classified
                if isinstance(exc, KeyboardInterrupt):
                    raise
                t.counts["saves_failed"] += 1
                t.failed_paths[path] = t.failure(exc, f"CompressedWriter save {path} (attempt {attempt})")
                continue
            t.counts["saves_returned"] += 1
            returned[path] = tag
            break
    for path, tag in returned.items():  # faults still on: exact, or a library error
        t.counts["loads_with_faults"] += 1
        try:
            got = _load(path, faulty, n)
        except BaseException as exc:  # every failure is classified
            if isinstance(exc, KeyboardInterrupt):
                raise
            t.counts["loads_failed"] += 1
            t.failure(exc, f"load {path}")
            continue
        if not _equal(got, state_for(tag, n)):
            t.counts["wrong_loads"] += 1
            t.problem(f"wrong values loaded from {path} (faults on)")
    return returned


def _tiers(local: str, url: str, options: dict[str, Any], every: tuple[int, int]) -> list[Any]:
    from dcp_tiered import Tier

    return [Tier("local", local, every_steps=every[0], keep=2, codec="lz4"),
            Tier("s3", f"{url}/run", every_steps=every[1], keep=2, codec="zstd", storage_options=options)]


def _guard(t: Tally, where: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as exc:  # every failure is classified
        if isinstance(exc, KeyboardInterrupt):
            raise
        exc.described = t.failure(exc, where)  # type: ignore[attr-defined]
        return exc


def _restore(t: Tally, ck: Any, n: int, where: str, seed: int) -> int | None:
    """``ck.restore`` into a template: the step (values checked), None, or a library error counted (-1)."""
    out = _template(n)
    got = _guard(t, where, lambda: ck.restore(out))
    if isinstance(got, BaseException):
        t.counts["restores_failed"] += 1
        return -1
    if got is None:
        return None
    t.counts["restores"] += 1
    if not _equal(out, state_for(seed * 1000 + got, n)):
        t.counts["wrong_loads"] += 1
        t.problem(f"{where}: restore returned step {got} with wrong values")
    return got


def _checkpointer_flow(t: Tally, seed: int, url: str, local: str, faulty: dict[str, Any], n: int,
                       steps: int) -> tuple[set[int], tuple[int, int]]:
    from dcp_tiered import TieredCheckpointer
    from dcp_tiered.storage.retry import RetryPolicy

    rng = random.Random(seed + 1)
    every = rng.choice([(1, 1), (1, 2), (2, 1)])  # (2, 1): odd steps go to S3 directly
    retry = RetryPolicy(attempts=rng.choice([2, 3, 4]), base=0.01, cap=0.05)
    returned: set[int] = set()
    ck = _guard(t, "TieredCheckpointer()", lambda: TieredCheckpointer(_tiers(local, url, faulty, every), retry=retry))
    if isinstance(ck, BaseException):
        return returned, every
    try:
        for step in range(1, steps + 1):
            t.counts["saves_attempted"] += 1
            report = _guard(t, f"maybe_save({step})", lambda s=step: ck.maybe_save(s, state_for(seed * 1000 + s, n)))
            if report is None:
                t.counts["saves_attempted"] -= 1
            elif not isinstance(report, BaseException) and report.ok:
                t.counts["saves_returned"] += 1
                returned.add(step)
            else:
                t.counts["saves_failed"] += 1
                t.failed_steps[step] = getattr(report, "described", None) or f"report.ok is False: {report.error}"
        _guard(t, "wait()", ck.wait)
        got = _restore(t, ck, n, "restore (faults on)", seed)
        if got is not None and got >= 0 and returned and got < max(returned):
            t.counts["restores_older"] += 1  # allowed with faults on (a candidate failed); counted
    finally:
        _guard(t, "close()", ck.close)
    return returned, every


def _verify(t: Tally, seed: int, url: str, local: str, clean: dict[str, Any], n: int,
            cw_returned: dict[str, int], ck_returned: set[int], every: tuple[int, int]) -> None:
    """Faults off: nothing returned is lost, nothing committed is wrong, restores are exact."""
    from dcp_tiered import Tier, TieredCheckpointer
    from dcp_tiered.tiers.catalog import list_tier

    for path, tag in cw_returned.items():
        got = _guard(t, f"load {path} (faults off)", lambda p=path: _load(p, clean, n))
        if isinstance(got, BaseException) or not _equal(got, state_for(tag, n)):
            t.counts["saves_lost"] += 1
            t.problem(f"seed {seed}: CompressedWriter save {path} returned but does not load exactly")
    for path in _committed(clean, f"{url}/cw"):  # failed saves may have committed: then exactly
        i = int(path.rsplit("_", 1)[1])
        if f"s3://{path}" in t.failed_paths and f"s3://{path}" not in cw_returned:
            t.counts["failed_but_committed"] += 1  # every attempt reported failed, yet one's commit applied
            t.notes.append(f"seed {seed}: s3://{path}: {t.failed_paths[f's3://{path}']}")
        got = _guard(t, f"load s3://{path}", lambda p=path: _load(f"s3://{p}", clean, n))
        t.counts["committed_checked"] += 1
        if isinstance(got, BaseException) or not _equal(got, state_for(seed * 1000 + 500 + i, n)):
            t.counts["broken_committed"] += 1
            t.problem(f"seed {seed}: committed s3://{path} does not load exactly")

    tiers = _tiers(local, url, clean, every)
    with TieredCheckpointer(tiers) as ck:  # a restart: resumes what promotions were left
        got = _restore(t, ck, n, "restore (faults off)", seed)
    if ck_returned and (got is None or got < max(ck_returned)):
        t.counts["saves_lost"] += 1
        t.problem(f"seed {seed}: restore returned {got}, the newest save returned was {max(ck_returned)}")
    s3_only = [Tier("s3", f"{url}/run", keep=2, codec="zstd", storage_options=clean)]
    with TieredCheckpointer(s3_only) as ck:  # the local disk lost: S3 alone
        _restore(t, ck, n, "restore from S3 alone (faults off)", seed)

    good: dict[str, set[int]] = {}
    for tier in tiers:
        good[tier.name] = set()
        for entry in list_tier(tier):
            if not entry.committed:
                t.counts["uncommitted_left"] += 1  # a failed save's or promotion's files: garbage, not a checkpoint
                continue
            where = f"{tier.name} step {entry.step}"
            got = _guard(t, f"load {where}", lambda e=entry, tr=tier: _load(e.url, tr.storage_options, n))
            t.counts["committed_checked"] += 1
            if isinstance(got, BaseException) or not _equal(got, state_for(seed * 1000 + entry.step, n)):
                t.counts["broken_committed"] += 1
                t.problem(f"seed {seed}: committed {where} does not load exactly")
            else:
                good[tier.name].add(entry.step)
    for step, error in t.failed_steps.items():
        if any(step in g for g in good.values()):
            t.counts["failed_but_committed"] += 1
            t.notes.append(f"seed {seed}: step {step} (tiers every {every}): {error}")
    keep = {tier.name: tier.keep for tier in tiers}
    for step in ck_returned:
        if any(step in g for g in good.values()):
            continue
        if any(sum(1 for s in g if s > step) >= keep[name] for name, g in good.items()):
            continue  # retention of an older step: keep newer good ones are there
        t.counts["saves_lost"] += 1
        t.problem(f"seed {seed}: step {step} returned, is in no tier, and no tier holds keep newer good steps")


def run_trial(seed: int, port: int, proxy: FaultProxy, workdir: str, *, p_pre: float = 0.05,
              p_post: float = 0.05, n: int = 4096, writer_saves: int = 3, steps: int = 6) -> Tally:
    """One trial against the S3 server on loopback ``port`` through ``proxy``; returns its counts."""
    t = Tally()
    rng = random.Random(seed)
    bucket = make_bucket(port)
    url = f"s3://{bucket}"
    plan = FaultPlan(seed, p_pre, p_post)
    proxy.plan = plan
    sdk_retries, s3fs_retries = rng.choice([(0, 1), (0, 1), (0, 2), (1, 1), (2, 2)])
    faulty = storage_options(proxy.endpoint_url, sdk_retries)
    clean = storage_options(f"http://127.0.0.1:{port}")
    local = tempfile.mkdtemp(prefix=f"s3f{seed}-", dir=workdir)
    import s3fs

    retries, s3fs.S3FileSystem.retries = s3fs.S3FileSystem.retries, s3fs_retries  # a class attribute only
    try:
        cw = _writer_flow(t, seed, url, faulty, n, writer_saves)
        ck, every = _checkpointer_flow(t, seed, url, local, faulty, n, steps)
        plan.enabled = False
        _verify(t, seed, url, local, clean, n, cw, ck, every)
    finally:
        plan.enabled = False
        s3fs.S3FileSystem.retries = retries
        shutil.rmtree(local, ignore_errors=True)
    for k, v in plan.counts.items():
        t.counts[k] += v
    t.counts["trials"] += 1
    return t


# -- the command -------------------------------------------------------------------------------


def run(trials: int, seed: int, port: int, *, trial_timeout: float = 300.0, progress: bool = False,
        **kwargs: Any) -> Tally:
    """``trials`` trials (seeds ``seed``, ``seed + 1``, ...) behind one proxy; stops at a hang."""
    total = Tally()
    proxy = FaultProxy(port)
    workdir = tempfile.mkdtemp(prefix="s3-faults-")
    try:
        for i in range(trials):
            box: dict[str, Any] = {}

            def one(s: int = seed + i, box: dict[str, Any] = box) -> None:
                try:
                    box["tally"] = run_trial(s, port, proxy, workdir, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - the harness itself failed: reported
                    box["error"] = exc
                    box["trace"] = traceback.format_exc()

            worker = threading.Thread(target=one, daemon=True, name=f"trial-{seed + i}")
            worker.start()
            worker.join(trial_timeout)
            if worker.is_alive():
                total.counts["hangs"] += 1
                total.problem(f"seed {seed + i}: trial did not end within {trial_timeout:.0f} s")
                import faulthandler

                faulthandler.dump_traceback(file=sys.stderr)
                break
            if "error" in box:
                total.counts["harness_errors"] += 1
                total.problem(f"seed {seed + i}: the trial itself failed: {box['trace'][-1500:]}")
                continue
            total.merge(box["tally"])
            if progress and (i + 1) % 10 == 0:
                c = total.counts
                print(f"{i + 1}/{trials} trials: {c['saves_returned']} saves returned, {c['saves_lost']} lost, "
                      f"{c['wrong_loads']} wrong, {c['builtin_errors']} builtin errors", file=sys.stderr, flush=True)
    finally:
        proxy.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return total


def summary(t: Tally) -> dict[str, Any]:
    c = t.counts
    faults = {k: c[k] for k in (*PRE_FAULTS, *POST_FAULTS)}
    by_method = {k: v for k, v in sorted(c.items()) if k.startswith(("pre_", "post_")) and k not in faults}
    keys = ("trials", "requests", "saves_attempted", "saves_returned", "saves_failed", "failed_but_committed",
            "saves_lost", "wrong_loads", "broken_committed", "committed_checked", "uncommitted_left",
            "loads_with_faults", "loads_failed", "restores", "restores_failed", "restores_older", "library_errors",
            "builtin_errors", "hangs", "harness_errors")
    return {**{k: c[k] for k in keys}, "faults": faults, "faults_by_method": by_method,
            "library_error_types": dict(t.errors.most_common()), "problems": t.problems,
            "failed_but_committed_notes": t.notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--p-pre", type=float, default=0.05, help="chance a request fails before it applies")
    parser.add_argument("--p-post", type=float, default=0.05, help="chance a forwarded request loses its response")
    parser.add_argument("--trial-timeout", type=float, default=300.0)
    parser.add_argument("--json", help="write the counts there too")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("dcp_tiered").setLevel(logging.CRITICAL)  # the faults make every retry log a warning
    started = time.monotonic()
    with moto_server() as port:
        tally = run(args.trials, args.seed, port, trial_timeout=args.trial_timeout, progress=True,
                    p_pre=args.p_pre, p_post=args.p_post)
    out = summary(tally) | {"wall_s": round(time.monotonic() - started, 1), "seed": args.seed,
                            "p_pre": args.p_pre, "p_post": args.p_post}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    bad = sum(out[k] for k in ("saves_lost", "wrong_loads", "broken_committed", "builtin_errors", "hangs",
                               "harness_errors"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
