"""Build the optional native byte-grouping kernel; the package works without it (numpy fallback)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dcp_tiered.codecs._bytegroup",
            sources=["dcp_tiered/codecs/_bytegroup.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
