"""Where a save to a node-local tier puts replicated items (``place_replicated``): kept in the
coordinator's directory, one node copy in each other directory whose ranks hold them, by the least
loaded holder; sharded items stay where DCP put them.  Plans stand in for DCP's global plan (each
item on one rank) and ``held`` for what every rank's local plan held.  In-process, no ranks."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcp_tiered.dcp.format import record_view
from dcp_tiered.tiers.config import Tier
from dcp_tiered.tiers.save.node_commit import copies_list, node_view, place_replicated, read_copies
from dcp_tiered.tiers.topology import dir_leaders


def tensor(fqn: str, rows: int) -> WriteItem:
    size = torch.Size([rows, 4])
    return WriteItem(MetadataIndex(fqn, torch.Size([0, 0])), WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0, 0]), size),
                                                 TensorProperties(dtype=torch.float32), size))


def obj(fqn: str) -> WriteItem:
    return WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO)


def fqns(items: list[WriteItem]) -> list[str]:
    return sorted(i.index.fqn for i in items)


A, B, C, SHARD = tensor("a", 10), tensor("b", 10), obj("lr"), tensor("w", 5)
NODES = [0, 0, 2, 2]  # dir_leaders of a {node} tier: 4 ranks, 2 per node


def test_dir_leaders() -> None:
    assert dir_leaders(Tier("l", "/x/{node}"), 4, per_node=2) == NODES
    assert dir_leaders(Tier("l", "/x/{rank}"), 3, per_node=2) == [0, 1, 2]
    assert dir_leaders(Tier("l", "/x/{node}"), 3, per_node=0) == [0, 0, 0]  # ranks per node unknown: one node


def test_ddp_items_stay_on_node_0_and_node_1_copies_them_balanced() -> None:
    """DCP put ``a``, ``b`` on ranks 0, 1 and ``lr`` on rank 2: ``lr`` moves to node 0 (the lowest of its
    equally loaded ranks), and node 1's two ranks share the copies of all three (``a`` to rank 3, which
    holds nothing yet; ``lr`` to the lowest of two equally loaded ranks)."""
    held = [[i.index for i in (A, B, C)]] * 4
    plans = [SavePlan([A]), SavePlan([B]), SavePlan([C]), SavePlan([])]
    new, copies = place_replicated(plans, held, NODES)
    assert [fqns(p.items) for p in new] == [["a", "lr"], ["b"], [], []]
    assert [fqns(c) for c in copies] == [[], [], ["b", "lr"], ["a"]]


def test_sharded_items_are_never_moved_or_copied() -> None:
    other = dataclasses.replace(SHARD, index=MetadataIndex("w", torch.Size([5, 0])))
    plans = [SavePlan([SHARD]), SavePlan([]), SavePlan([other]), SavePlan([])]
    new, copies = place_replicated(plans, [[SHARD.index], [], [other.index], []], NODES)
    assert new == plans and copies == [[]] * 4


def test_an_item_held_on_one_rank_of_each_node_moves_to_node_0_and_is_copied_once() -> None:
    """Held by ranks 1 and 3, kept by DCP on 3: rank 1 writes it, rank 3 copies it for node 1."""
    plans = [SavePlan([]), SavePlan([]), SavePlan([]), SavePlan([C])]
    new, copies = place_replicated(plans, [[], [C.index], [], [C.index]], NODES)
    assert [fqns(p.items) for p in new] == [[], ["lr"], [], []]
    assert [fqns(c) for c in copies] == [[], [], [], ["lr"]]


def test_items_held_by_other_nodes_only_stay_and_a_rank_tier_copies_into_every_directory() -> None:
    plans = [SavePlan([]), SavePlan([]), SavePlan([C]), SavePlan([])]
    new, copies = place_replicated(plans, [[], [], [C.index], [C.index]], NODES)  # node 1 holds it all
    assert new == plans and copies == [[]] * 4
    new, copies = place_replicated(plans, [[C.index]] * 4, [0, 1, 2, 3])  # {rank}: every rank its own directory
    assert [fqns(p.items) for p in new] == [["lr"], [], [], []]
    assert [fqns(c) for c in copies] == [[], ["lr"], ["lr"], ["lr"]]


def test_node_view_names_its_own_copies_only() -> None:
    """Each directory's view names the copies its own ranks listed, and nothing changes the save's records."""
    rec, copy = _StorageInfo("__0_0.distcp", 0, 8), _StorageInfo("__2_node_0.distcp", 0, 9)
    md = Metadata({}, storage_data={C.index: rec})
    node1, copied = node_view(md, [2, 3], [(C.index, copy)])
    assert record_view(node1.storage_data[C.index]).file == "__2_node_0.distcp" and copied == 9
    assert md.storage_data[C.index] is rec
    assert node_view(md, [0, 1], [(C.index, copy)])[0].storage_data == {C.index: rec}


def _listed(tmp_path, save_id, copies, rank: int = 2):
    from dcp_tiered.names import node_copies_list
    from dcp_tiered.storage import Storage

    store = Storage(str(tmp_path))
    store.makedirs()
    store.commit_bytes(node_copies_list(rank), copies if isinstance(copies, bytes) else copies_list(save_id, copies))
    return store


def test_a_node_copies_list_round_trips_and_anything_else_is_refused(tmp_path) -> None:
    """A rank's list of its node copies reads back as the records it wrote; a list that is missing, of
    another save, malformed, or naming another rank's file is refused, naming the list."""
    import json

    import pytest

    from dcp_tiered.errors import CorruptCheckpointError

    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedWriter

    md = dcp.save({"a": torch.arange(4.0)}, storage_writer=CompressedWriter(tmp_path / "ck", sync_files=False), no_dist=True)
    (index, rec), = md.storage_data.items()
    rec = {**rec, "file": "__2_node_0.distcp"}
    store = _listed(tmp_path / "ok", "s1", [(index, rec)])
    sdm = md.state_dict_metadata
    assert read_copies(store, 2, "s1", sdm) == [(index, rec)]
    bad = {
        "missing": None,
        "another save": copies_list("s0", [(index, rec)]),
        "not json": b"{",
        "deep": b"[" * 100000,
        "entry not a dict": json.dumps({"save_id": "s1", "copies": [5]}).encode(),
        "negative offset": copies_list("s1", [(index, rec)]).replace(b'"offset": [0]', b'"offset": [-1]'),
        "another rank's file": copies_list("s1", [(index, {**rec, "file": "__3_node_0.distcp"})]),
        "a bad record": copies_list("s1", [(index, {**rec, "raw": -1})]),
        "no item of the save": copies_list("s1", [(MetadataIndex("zzz", torch.Size([0])), rec)]),
        "no chunk of the tensor": copies_list("s1", [(MetadataIndex("a", torch.Size([5])), rec)]),
    }
    for case, data in bad.items():
        store = _listed(tmp_path / case.replace(" ", "-"), "s1", data) if data is not None else _listed(tmp_path / "none", "s1", [], rank=3)
        with pytest.raises(CorruptCheckpointError, match=r"\.node-copies-2\.json"):
            read_copies(store, 2, "s1", sdm)


def test_a_packed_node_view_swaps_rows_without_unpacking_or_packing(tmp_path, monkeypatch) -> None:
    """The view of what ``dcp.save`` returned (packed records): the copies' rows swapped over the table's
    columns, the first row's included; the same records, file sizes and committed bytes as a view
    built from the plain dicts, and no record packed or unpacked on the way."""
    import torch.distributed.checkpoint as dcp

    from dcp_tiered import CompressedWriter
    from dcp_tiered.dcp import record_table
    from dcp_tiered.dcp.format import expected_sizes
    from dcp_tiered.dcp.metadata_io import encode_metadata, unpack_metadata

    state = {f"w{i}": torch.full((3, 4), float(i)) for i in range(6)} | {"lr": torch.tensor(0.5)}
    md = dcp.save(state, storage_writer=CompressedWriter(tmp_path / "ck", sync_files=False), no_dist=True)
    assert type(md.storage_data) is record_table.PackedRecords
    plain = dict(record_table.PackedRecords(md.state_dict_metadata, md.storage_data.packed).items())
    first, middle = list(plain)[0], list(plain)[3]
    copies = tuple((i, {**plain[i], "file": "__2_node_0.distcp", "offset": 7 * n}) for n, i in enumerate((first, middle)))
    calls = {"add": 0, "unpack": 0}
    add, unpack = record_table._Packer.add, record_table.unpack_storage
    monkeypatch.setattr(record_table._Packer, "add", lambda *a: (calls.__setitem__("add", calls["add"] + 1), add(*a))[1])
    monkeypatch.setattr(record_table, "unpack_storage",
                        lambda *a, **k: (calls.__setitem__("unpack", calls["unpack"] + 1), unpack(*a, **k))[1])
    view, copied = node_view(md, [2, 3], copies)
    sizes = expected_sizes(view.storage_data.values())
    data = encode_metadata(view)
    assert calls == {"add": 0, "unpack": 0}
    want = {**plain, **dict(copies)}
    assert copied == sum(r["length"] for _i, r in copies)
    assert sizes == expected_sizes(want.values())
    assert dict(unpack_metadata(data).storage_data.items()) == want
