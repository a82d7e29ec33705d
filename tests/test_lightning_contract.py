"""``CompressedCheckpointIO`` keeps the contracts Lightning's own ``TorchCheckpointIO`` has.

- ``map_location`` may be a callable returning None, which ``torch.load`` takes as "leave the
  tensor where it is" (Lightning's own ``_default_map_location`` does this); every tensor used
  to become None.
- A missing checkpoint raises ``Checkpoint file not found: <path>``, the message Lightning's tests
  and users match (still a ``FileNotFoundError``).
"""

from __future__ import annotations

import pytest
import torch

from dcp_tiered.integrations.lightning import CompressedCheckpointIO


def test_a_map_location_callable_returning_none_leaves_every_tensor(tmp_path):
    io = CompressedCheckpointIO()
    ckpt = {"state_dict": {"w": torch.arange(6.0)}, "epoch": 3}
    io.save_checkpoint(ckpt, tmp_path / "a.ckpt")
    got = io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: None)
    assert torch.equal(got["state_dict"]["w"], torch.arange(6.0)) and got["epoch"] == 3


def test_a_map_location_callable_still_maps(tmp_path):
    io = CompressedCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.arange(6.0)}}, tmp_path / "a.ckpt")
    got = io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda t, loc: t * 2)
    assert torch.equal(got["state_dict"]["w"], torch.arange(6.0) * 2)


def test_a_missing_checkpoint_says_what_lightning_says(tmp_path):
    path = tmp_path / "missing.ckpt"
    with pytest.raises(FileNotFoundError, match=f"Checkpoint file not found: {path}"):
        CompressedCheckpointIO().load_checkpoint(path)


def test_a_crafted_tensor_size_is_refused_before_anything_is_allocated(tmp_path):
    """A plugin checkpoint whose ``.metadata`` claims a 4 TiB tensor: a library error, not torch's
    ``RuntimeError`` from allocating it."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from dcp_tiered.dcp.metadata_io import unpack_metadata
    from dcp_tiered.errors import CorruptCheckpointError

    path = tmp_path / "a.ckpt"
    CompressedCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(4)}}, path)
    md = unpack_metadata((path / ".metadata").read_bytes())
    (fqn, tmd), = [(k, v) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")]
    tmd.size = torch.Size([1 << 40])
    tmd.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1 << 40]))]
    index = next(i for i in md.storage_data if i.fqn == fqn)
    md.storage_data[index] = _StorageInfo(relative_path=md.storage_data[index]["file"], offset=0, length=10)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError):
        CompressedCheckpointIO().load_checkpoint(path)


@pytest.mark.parametrize("body", ['{"dcp_tiered_tier_ref": 1, "step": "7"}', '{"dcp_tiered_tier_ref": 1, "step": null}',
                                  '{"dcp_tiered_tier_ref": 1, "step": [1]}', '{"dcp_tiered_tier_ref": 1, "step": -3}',
                                  '{"dcp_tiered_tier_ref": 1, "step": ' + "[" * 3000 + "]" * 3000 + "}"])
def test_a_malformed_tier_reference_is_a_library_error(tmp_path, body):
    from dcp_tiered.errors import CorruptCheckpointError

    path = tmp_path / "last.ckpt"
    path.write_text(body)
    with pytest.raises(CorruptCheckpointError, match="reference"):
        CompressedCheckpointIO(checkpointer=[]).load_checkpoint(path)
