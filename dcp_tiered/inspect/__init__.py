"""Whole-checkpoint operations: describe, verify, load and convert one checkpoint.

Works on checkpoints of this package, of stock DCP (``FileSystemWriter``/``FsspecWriter``)
and, for ``load_any``, ``save_any`` and ``convert``, on single ``torch.save`` files (paths ending
in ``.pt``, ``.pth``, ``.bin``, ``.ckpt``); ``describe`` and ``verify`` take checkpoint directories.
The ``dcp-tiered`` commands ``inspect``, ``verify``, ``convert``, ``export`` and ``import`` only print
what these functions return (``export_safetensors``/``import_safetensors``: a Hugging Face safetensors
checkpoint, shard by shard)::

    from dcp_tiered import inspect as ckpt

    print(ckpt.describe("ckpt/step_000000100").summary())
    result = ckpt.verify("s3://bucket/run/step_000001000", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}})
    assert result.ok, result.problems
    ckpt.convert("stock_ckpt/", "compressed_ckpt/", codec="zstd:3")
    state = ckpt.load_any("model.pt")
    ckpt.export_safetensors("ckpt/step_000001000", "hf_model/", prefix="model.", max_shard_size="2GB")
    ckpt.import_safetensors("hf_model/", "ckpt/local/step_000000000", prefix="model.")

Every function returns a plain dataclass (or a state dict).  ``progress`` arguments take a
factory called as ``progress(total, desc, unit="")`` that returns a context manager with
``update(n)``; nothing is drawn by default.  Importing this package imports no torch.
"""

from __future__ import annotations

from dcp_tiered.inspect.checks import VerifyResult, verify
from dcp_tiered.inspect.conversion import STOCK, ConvertResult, convert, load_any, save_any
from dcp_tiered.inspect.progress import NoProgress, ProgressBar, ProgressFactory
from dcp_tiered.inspect.safetensors_export import DEFAULT_EXPORT_EXCLUDE, ExportResult, export_safetensors
from dcp_tiered.inspect.safetensors_files import DEFAULT_MAX_SHARD_SIZE, INDEX_NAME, WEIGHTS_NAME
from dcp_tiered.inspect.safetensors_import import ImportResult, import_safetensors
from dcp_tiered.inspect.sources import TORCH_SAVE_SUFFIXES, is_torch_save_path, open_reader, stored_size
from dcp_tiered.inspect.summary import Description, ItemRow, describe, fp32_bytes

__all__ = [
    "DEFAULT_EXPORT_EXCLUDE",
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "STOCK",
    "TORCH_SAVE_SUFFIXES",
    "WEIGHTS_NAME",
    "ConvertResult",
    "Description",
    "ExportResult",
    "ImportResult",
    "ItemRow",
    "NoProgress",
    "ProgressBar",
    "ProgressFactory",
    "VerifyResult",
    "convert",
    "describe",
    "export_safetensors",
    "fp32_bytes",
    "import_safetensors",
    "is_torch_save_path",
    "load_any",
    "open_reader",
    "save_any",
    "stored_size",
    "verify",
]
