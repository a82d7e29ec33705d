"""Found by ``tools/crash_harness --hostile`` (class ``lightning_ref``): a file holding a dcp-tiered
reference that ``parse_ref`` (dcp_tiered/integrations/lightning_io.py) does not take for one is handed
to Lightning's ``torch.load`` as a stock ``.ckpt``, which raises a builtin ``UnpicklingError``
("Weights only load failed ...") instead of a ``CorruptCheckpointError`` naming the file."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lightning")

from dcp_tiered import CorruptCheckpointError
from dcp_tiered.integrations.lightning_io import REF_KEY, CompressedCheckpointIO


@pytest.mark.xfail(strict=True, reason="parse_ref returns None (a stock .ckpt) for these references: "
                                       "load_checkpoint raises pickle.UnpicklingError from torch.load")
@pytest.mark.parametrize("text", [
    json.dumps({REF_KEY: 2, "step": 2}),  # the reference marker is not 1
    " " + json.dumps({REF_KEY: 1, "step": 2}),  # leading white space
    "\ufeff" + json.dumps({REF_KEY: 1, "step": 2}),  # a byte order mark
    json.dumps({"pad": "x" * 5000, REF_KEY: 1, "step": 2}),  # the key after the 4 KiB read first
], ids=["marker-2", "space", "bom", "key-after-4k"])
def test_a_damaged_reference_is_a_corrupt_checkpoint(tmp_path, text):
    path = tmp_path / "last.ckpt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(CorruptCheckpointError):
        CompressedCheckpointIO().load_checkpoint(str(path))
