"""The example backend of docs/architecture.md ("A storage backend.") works as the document says:
``Storage(url)`` picks it, and a DCP save and load, a tiered save with restore and
``dcp_tiered.inspect.verify`` all go through it.  It runs in a child process, because
``register_backend`` is process-wide and would take ``memory://`` from the other tests."""

from __future__ import annotations

import re
from pathlib import Path
from speed import scaled

from isolated import run_isolated

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def _example() -> str:
    doc = DOC.read_text()
    section = doc[doc.index("**A storage backend.**"):doc.index("**A tier policy.**")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the backend section should hold one python example"
    return blocks[0]


def test_doc_backend_example_serves_dcp_tiers_and_verify(tmp_path: Path) -> None:
    code = _example() + f"""
import torch
import torch.distributed.checkpoint as dcp
from dcp_tiered import CompressedReader, CompressedWriter, Tier, TieredCheckpointer
from dcp_tiered.inspect import verify

assert type(Storage("memory://doc/x")) is MemoryStorage and type(Storage("memory://doc/x").child("y")) is MemoryStorage
sd = {{"a": torch.randn(300), "b": torch.arange(10)}}
dcp.save(sd, storage_writer=CompressedWriter("memory://doc/ck"), no_dist=True)
out = {{k: torch.empty_like(v) for k, v in sd.items()}}
dcp.load(out, storage_reader=CompressedReader("memory://doc/ck"), no_dist=True)
assert all(torch.equal(sd[k], out[k]) for k in sd)
assert verify("memory://doc/ck").ok
tiers = [Tier("mem", "memory://doc/tier", every_steps=1, keep=2, codec="lz4"), Tier("disk", {str(tmp_path)!r}, every_steps=2)]
ckpt = TieredCheckpointer(tiers)
for step in range(1, 6):
    ckpt.maybe_save(step, sd)
ckpt.close(timeout={scaled(120)!r})
assert Storage("memory://doc/tier").listdir() == ["step_000000004", "step_000000005"]
ckpt = TieredCheckpointer(tiers)
out = {{k: torch.empty_like(v) for k, v in sd.items()}}
emit(ckpt.restore(out))
ckpt.close(timeout={scaled(120)!r})
assert all(torch.equal(sd[k], out[k]) for k in sd)
"""
    res = run_isolated(code, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.result == 5
