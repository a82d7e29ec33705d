"""Found by ``tools/crash_harness --hostile`` (class ``lightning_ref``): a file holding a dcp-tiered
reference that ``parse_ref`` (dcp_tiered/integrations/lightning_io.py) did not take for one was handed
to Lightning's ``torch.load`` as a stock ``.ckpt``, which raised a builtin ``UnpicklingError``
("Weights only load failed ...") instead of a ``CorruptCheckpointError`` naming the file."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lightning")

from dcp_tiered import CorruptCheckpointError
from dcp_tiered.integrations.lightning_io import REF_KEY, CompressedCheckpointIO


@pytest.mark.parametrize("text", [
    json.dumps({REF_KEY: 2, "step": 2}),  # the reference marker is not 1
    " " + json.dumps({REF_KEY: 1, "step": "2"}),  # leading white space, then a damaged step
    "\ufeff" + json.dumps({REF_KEY: 1, "step": None}),  # a byte order mark, then a damaged step
    json.dumps({"pad": "x" * 5000, REF_KEY: 1, "step": -1}),  # after the 4 KiB read first, a damaged step
    json.dumps({"pad": "x" * 70_000, REF_KEY: 1, "step": 2}),  # longer than any reference
    json.dumps({"unrelated": 1}),  # JSON, no reference: not a checkpoint either
    json.dumps({REF_KEY: True, "step": 2}),  # True == 1 in Python
], ids=["marker-2", "space", "bom", "key-after-4k", "too-long", "other-json", "marker-true"])
def test_a_damaged_reference_is_a_corrupt_checkpoint(tmp_path, text):
    path = tmp_path / "last.ckpt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(CorruptCheckpointError):
        CompressedCheckpointIO().load_checkpoint(str(path))


def test_white_space_or_a_byte_order_mark_before_a_reference_keeps_it_a_reference():
    """What an editor adds around an intact reference changes nothing: it still names its step."""
    from dcp_tiered.integrations.lightning_io import parse_ref

    for text in (" " + json.dumps({REF_KEY: 1, "step": 2}) + "\n", "\ufeff" + json.dumps({REF_KEY: 1, "step": 2}),
                 json.dumps({"pad": "x" * 5000, REF_KEY: 1, "step": 2})):
        assert parse_ref(text.encode("utf-8"), "last.ckpt")["step"] == 2
