#!/usr/bin/env bash
# Build llama.cpp's llama-bench (CPU only, Release, native) from the source that the llama-cpp-python sdist
# vendors, for `engram-serve bench peers --suite llamacpp`.
#
#   scripts/build_llama_cpp.sh [SDIST.tar.gz] [BUILD_DIR]
#
# SDIST defaults to llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION (0.3.36) fetched with pip; BUILD_DIR defaults
# to /work/llama.cpp-build. The binary lands in BUILD_DIR/bin/llama-bench. JOBS (default 2) and NICE (default
# 10) set ninja's parallelism and priority. Needs cmake, ninja and a C/C++ compiler.
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
sdist="${1:-}"
build="${2:-/work/llama.cpp-build}"
jobs="${JOBS:-2}"
python="${PYTHON:-python3}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [[ -z "$sdist" ]]; then
    "$python" -m pip download --quiet --no-binary :all: --no-deps -d "$work" "llama-cpp-python==$version"
    sdist="$(ls "$work"/llama_cpp_python-*.tar.gz)"
fi
[[ -f "$sdist" ]] || { echo "no sdist at $sdist" >&2; exit 1; }

# The sources stay beside the build, so that a rebuild or a debugger finds them.
src="$build/src"
rm -rf "$src" && mkdir -p "$src"
tar -xzf "$sdist" -C "$src" --strip-components=1
llama="$src/vendor/llama.cpp"
[[ -f "$llama/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in $sdist" >&2; exit 1; }

# GCC 12's dead-store elimination miscompiles ggml's AMX path (it crashes at load); switch it off there.
flags=""
if "${CC:-cc}" -v 2>&1 | grep -qE '^gcc version 12\.'; then
    flags="-fno-dse -fno-tree-dse"
fi

cmake -S "$llama" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
nice -n "${NICE:-10}" ninja -C "$build" -j "$jobs" llama-bench
"$build/bin/llama-bench" --help > /dev/null
echo "built $build/bin/llama-bench"
