"""Build the optional C hash kernel; all other metadata lives in pyproject.toml.

`engram_serve.engram._hash_kernel` needs only a C compiler and the CPython headers (no torch or
numpy headers). It is optional: where it cannot be compiled, the install still succeeds with a
warning and `engram_serve.engram.hashing` falls back to the torch path.
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """-O3 for gcc/clang; MSVC gets /O2 (it has no unsigned __int128, so the optional build fails there)."""

    def build_extensions(self):
        flag = "/O2" if self.compiler.compiler_type == "msvc" else "-O3"
        for ext in self.extensions:
            ext.extra_compile_args = [flag]
        super().build_extensions()


setup(
    ext_modules=[Extension("engram_serve.engram._hash_kernel", ["engram_serve/engram/_hash_kernel.c"], optional=True)],
    cmdclass={"build_ext": BuildExt},
)
