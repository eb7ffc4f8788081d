"""Build the optional C kernels; all other metadata lives in pyproject.toml.

`engram_serve.engram._hash_kernel` (the n-gram hash), `engram_serve.engram._gather_kernel` (the
staging gather of table rows), `engram_serve.model._linear_kernel` (the matmul),
`engram_serve.model._token_kernel` (the token-wise steps of the forward) and
`engram_serve.inputs._decode_kernel` (a decode step's inputs) need only a C compiler and
the CPython headers (no torch or numpy headers); `engram_serve._thread_pool` is the kernels' one thread pool
(pthreads and Linux futexes; elsewhere it has one thread), which each kernel imports at its init. They are optional: where one cannot be compiled, the
install still succeeds with a warning and the torch paths run (`engram_serve.model.exactness` pads small
matmul calls instead). `engram_serve.kernels` loads them (ENGRAM_SERVE_KERNELS switches them) and
`engram-serve env` says which loaded; docs/kernels.md describes them.
"""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """-O3 for gcc/clang, with IEEE float arithmetic kept as written (no contraction into FMA: the gather's
    decode must round exactly once) and no FP traps assumed (-fno-trapping-math: the compiler may then
    if-convert a loop's selects, so the AVX2 clones vectorise too; no value changes); MSVC gets /O2 (it has no unsigned __int128, so the optional hash
    kernel fails there)."""

    def build_extensions(self):
        flags = ["/O2"] if self.compiler.compiler_type == "msvc" else ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
        for ext in self.extensions:
            ext.extra_compile_args = flags
        super().build_extensions()


setup(
    ext_modules=[Extension("engram_serve._thread_pool", ["engram_serve/_thread_pool.c"],
                           depends=["engram_serve/_thread_pool.h"],
                           libraries=["pthread"] if sys.platform.startswith("linux") else [], optional=True)]
                + [Extension(f"engram_serve.{pkg}._{name}_kernel", [f"engram_serve/{pkg}/_{name}_kernel.c"],
                           include_dirs=["engram_serve"],  # _kernel_buffers.h: every kernel's conventions
                           depends=["engram_serve/_kernel_buffers.h", "engram_serve/_thread_pool.h",
                                    *(["engram_serve/model/_kernel_math.h", "engram_serve/model/_formats.h"] if pkg == "model" else [])],
                           libraries=["m"] if name == "token" and sys.platform != "win32" else [],  # log1pf
                           optional=True)
                 for pkg, name in (("engram", "hash"), ("engram", "gather"), ("model", "linear"), ("model", "token"),
                                   ("inputs", "decode"))],
    cmdclass={"build_ext": BuildExt},
)
