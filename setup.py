"""The package's metadata is in setup.cfg; this file adds the one compiled helper.

``ppe_snapshot/engine/_files/hash_many.c`` is built as a plain shared library (no Python API, loaded with ctypes),
named without the interpreter's tag so that one build serves any Python. It is optional: where no C compiler is
found the install goes on without it, and the checksums are computed in Python, with the GIL held
(``ppe_snapshot.engine._files.chunk_hashes``).
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
                                      sources=["ppe_snapshot/engine/_files/hash_many.c"], optional=True)],
    cmdclass={"build_ext": PlainLibraries},
)
