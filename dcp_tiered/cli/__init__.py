"""The ``dcp-tiered`` command line: ``python -m dcp_tiered.cli`` or the ``dcp-tiered`` script.

Nothing here is imported by ``import dcp_tiered``; see ``dcp_tiered/cli/__main__.py``.
"""
