"""Stock DCP constructor arguments that ``CompressedWriter`` and ``CompressedReader`` accept.

So that swapping ``FileSystemWriter``/``FsspecWriter``/``FileSystemReader``/``FsspecReader``
for ours keeps working: the keywords that mean something here are honoured (``thread_count``,
``sync_files``, ``overwrite``, fsspec options as ``**kwargs``), the ones that do not are accepted
and documented as ignored, and the ones we cannot honour fail with a message saying why.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection, Mapping
from typing import Any

from dcp_tiered.checks import check_count
from dcp_tiered.errors import ConfigError


def refuse_positional(cls_name: str, args: tuple, example: str) -> None:
    """A TypeError for positional arguments after ``path``, naming the keyword form."""
    if args:
        shown = ", ".join(repr(a) for a in args[:3]) + (", ..." if len(args) > 3 else "")
        raise TypeError(f"{cls_name}() got positional argument(s) after path ({shown}): after path all arguments "
                        f"are keyword-only: {example}")


def storage_options_with(cls_name: str, path: object, storage_options: object, extra: Mapping[str, Any],
                         own: Collection[str]) -> dict[str, Any]:
    """``storage_options`` merged with fsspec options given as keywords (as ``FsspecWriter(path, **kwargs)``).

    A keyword close to one of ``own`` (a typo) or given for a local path is a TypeError, not a
    storage option; stock's experimental ``_extensions``/``serialization_format`` are refused.
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise ConfigError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    for key in extra:
        if key.startswith("_") or key == "serialization_format":
            raise TypeError(f"{cls_name}() does not take {key}= (stock DCP's experimental stream extensions and "
                            "serialization format): it stores every item in its own compressed format (codec=...)")
        close = difflib.get_close_matches(key, own, n=1, cutoff=0.8)
        if close:
            raise TypeError(f"{cls_name}() got an unexpected keyword argument {key!r}; did you mean {close[0]}=?")
    url = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
    if extra and "://" not in str(url):
        raise TypeError(f"{cls_name}() got unexpected keyword argument(s) {', '.join(sorted(extra))}: extra keywords "
                        "are fsspec storage options (as FsspecWriter takes them), and a local path takes none")
    options = dict(storage_options or {})
    clash = sorted(k for k in extra if k in options and options[k] != extra[k])
    if clash:
        raise ConfigError(f"{', '.join(clash)} given both in storage_options and as keyword(s), with different values")
    return {**options, **extra}


def writer_threads(threads: object, thread_count: object) -> int | None:
    """``threads``, or stock's ``thread_count`` (the same thing); both with different values is a ConfigError."""
    check_count(threads, "threads", optional=True)
    check_count(thread_count, "thread_count", optional=True)
    if threads is not None and thread_count is not None and threads != thread_count:
        raise ConfigError(f"threads={threads} and thread_count={thread_count} (stock DCP's name for threads) differ; "
                          "give one of them")
    return threads if threads is not None else thread_count  # type: ignore[return-value]


def check_stock_writer_args(single_file_per_rank: object, per_thread_copy_ahead: object,
                            cache_staged_state_dict: object) -> None:
    """Validate the stock writer keywords that are accepted without changing anything here."""
    if single_file_per_rank is not True:
        raise ConfigError(
            f"single_file_per_rank={single_file_per_rank!r} is not supported: CompressedWriter always writes one data "
            "file per rank (items are framed and read back frame by frame, so one file per item would only add "
            "files); leave it out or pass True"
        )
    check_count(per_thread_copy_ahead, "per_thread_copy_ahead", minimum=0, optional=True)
    if not isinstance(cache_staged_state_dict, bool):
        raise ConfigError(f"cache_staged_state_dict must be True or False, got {cache_staged_state_dict!r}")
