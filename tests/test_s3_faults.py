"""Fault injection on the S3 path (issue 23): a loopback proxy in front of the moto server loses
responses of requests that applied and fails requests before they apply, over saves, promotion,
retention and restore.  The long run is ``python -m tools.s3_faults --trials 300`` (see
docs/reliability.md); this is its short version, plus the proxy's own behaviour."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import CompressedReader, CompressedWriter
from dcp_tiered.storage import Storage

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools import s3_faults as F


@pytest.fixture(scope="module")
def proxy(moto_server):
    p = F.FaultProxy(moto_server.port)
    yield p
    p.close()


@pytest.fixture
def one_try():
    """s3fs tries each call once (its retries are a class attribute): faults reach the library."""
    before, s3fs.S3FileSystem.retries = s3fs.S3FileSystem.retries, 1
    yield
    s3fs.S3FileSystem.retries = before


def test_the_proxy_uses_loopback_addresses_only():
    for target in ("10.0.0.1", "192.168.1.1", "8.8.8.8"):
        with pytest.raises(ValueError, match="not a loopback"):
            F.FaultProxy(9, target_host=target)
    with pytest.raises(ValueError, match="not a loopback"):
        F.FaultProxy(9, host="0.0.0.0")


def test_a_lost_response_was_applied_and_a_failed_request_was_not(moto_server, proxy, one_try):
    bucket = moto_server.make_bucket()
    clean = s3fs.S3FileSystem(**F.storage_options(moto_server.endpoint_url), skip_instance_cache=True)
    for name, plan in (("before", F.FaultPlan(0, p_pre=1.0)), ("after", F.FaultPlan(0, p_post=1.0))):
        proxy.plan = plan
        faulty = s3fs.S3FileSystem(**F.storage_options(proxy.endpoint_url), skip_instance_cache=True)
        with pytest.raises(Exception):  # noqa: B017 - whatever s3fs raises (OSError, ConnectionClosedError)
            faulty.pipe_file(f"{bucket}/{name}", b"data")
        assert clean.exists(f"{bucket}/{name}") == (name == "after"), name
    proxy.plan = F.FaultPlan(0)


def _metadata_put(method: str, path: str) -> bool:
    return method == "PUT" and path.split("?")[0].endswith("/.metadata")


@pytest.mark.parametrize("fault", ["post_500", "post_close"])
def test_a_commit_whose_response_is_lost_is_a_success(moto_server, proxy, one_try, fault, monkeypatch):
    """The conditional PUT of ``.metadata`` applied, its response lost and reported as an error (no
    retry got a 412 to read back): the save was reported failed although it had committed."""
    monkeypatch.setattr(F, "POST_FAULTS", (fault,))
    proxy.plan = F.FaultPlan(0, p_post=1.0, only=_metadata_put, limit=1)
    url, options = f"s3://{moto_server.make_bucket()}", F.storage_options(proxy.endpoint_url)
    state = {"w": torch.arange(100.0)}
    dcp.save(state, storage_writer=CompressedWriter(f"{url}/ck", storage_options=options), no_dist=True)
    assert proxy.plan.counts[fault] == 1, proxy.plan.counts
    out = {"w": torch.zeros(100)}
    dcp.load(out, storage_reader=CompressedReader(f"{url}/ck", storage_options=options), no_dist=True)
    assert torch.equal(out["w"], state["w"])
    proxy.plan = F.FaultPlan(0, p_post=1.0, only=lambda m, p: m == "PUT" and p.split("?")[0].endswith("/marker"),
                             limit=1)
    assert Storage(f"{url}/x", options).commit_bytes("marker", b"mine")  # an overwrite commit too
    proxy.plan = F.FaultPlan(0)


def test_save_promotion_retention_and_restore_under_s3_faults(moto_server, proxy, tmp_path, caplog):
    """A trial of the tool: 0 saves lost, 0 wrong loads, every failure a library error."""
    caplog.set_level(logging.CRITICAL, logger="dcp_tiered")  # every retry under the faults logs a warning
    total = F.Tally()
    total.merge(F.run_trial(5, moto_server.port, proxy, str(tmp_path), p_pre=0.08, p_post=0.08,
                            n=1024, writer_saves=2, steps=4))
    proxy.plan = F.FaultPlan(0)
    c = total.counts
    assert c["trials"] == 1 and c["saves_returned"] > 0 and c["restores"] > 0, dict(c)
    assert sum(c[f] for f in F.PRE_FAULTS) > 0 and sum(c[f] for f in F.POST_FAULTS) > 0, dict(c)
    bad = {k: c[k] for k in ("saves_lost", "wrong_loads", "broken_committed", "builtin_errors")}
    assert not any(bad.values()), (bad, total.problems)
