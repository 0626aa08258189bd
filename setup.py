"""The package's metadata is in setup.cfg; this file adds the two compiled helpers.

Each is built as a plain shared library (no Python API, loaded with ctypes), named without the interpreter's tag so
that one build serves any Python. Both are optional: where no C compiler is found the install goes on without them,
and Python does the same work, holding the GIL longer:

- ``ppe_snapshot/engine/_files/hash_many.c``: the checksums of many chunks in one call
  (``ppe_snapshot.engine._files.chunk_hashes``);
- ``ppe_snapshot/storage/preadv_all.c``: a local read of many pieces, and what is to follow it, in one call
  (``ppe_snapshot.storage.local_reads``).
"""
import os

import setuptools
from setuptools.command.build_ext import build_ext


class PlainLibraries(build_ext):
    """Builds the extensions as plain shared libraries: ``<name>.so``, no ``PyInit_`` symbol asked for."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def get_export_symbols(self, ext: setuptools.Extension) -> list:
        return ext.export_symbols


setuptools.setup(
    ext_modules=[setuptools.Extension("ppe_snapshot.engine._files.libhash_many",
                                      sources=["ppe_snapshot/engine/_files/hash_many.c"], optional=True),
                 setuptools.Extension("ppe_snapshot.storage.libpreadv_all",
                                      sources=["ppe_snapshot/storage/preadv_all.c"], optional=True)],
    cmdclass={"build_ext": PlainLibraries},
)
