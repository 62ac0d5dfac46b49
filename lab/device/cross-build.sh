#!/usr/bin/env bash
# The H200's CUDA llama-server and llama-bench built here, on a machine with no GPU, so that a device session spends
# its minutes measuring rather than compiling (run.sh's build step takes 260-300 s of a 30-minute session).
#
#   bash lab/device/cross-build.sh [OUT_DIR]       (from the project root; default OUT_DIR .devprebuilt)
#
# The CUDA 13.0 toolkit comes from PyPI (nvcc, cicc, the runtime, cuBLAS and CCCL wheels: the device has driver 580
# and CUDA 13.0), unpacked under CROSS_WORK (default /tmp/cross-cuda); libcuda, the driver, is not on PyPI, so the
# link takes a stub of the driver functions ggml-cuda calls (soname libcuda.so.1: the device's own driver answers
# at run time). The source is the bundle's (.devbundle/llama-src.tar.xz, the patched series `orchestrator build
# --export-source` writes), configured with `orchestrator build`'s own cmake arguments for --cuda --cuda-arch 90,
# except that the CPU code is compiled for the device's CPU (Sapphire Rapids: AVX-512 with VBMI/VNNI/BF16, AVX-VNNI,
# AMX) where the device's build says --native: fit-pinned runs experts on that CPU, and a portable build would
# handicap it. cuBLAS and the CUDA runtime stay shared libraries, found on the device through LD_LIBRARY_PATH
# (run.sh's CUDA_PREBUILT sets it from the device's nvcc). Two cores take about an hour; ninja resumes.
#
# Writes OUT_DIR/server/llama-server.xz and OUT_DIR/bench/llama-bench.xz, each with build.json (source sha256, cmake
# arguments, toolkit versions); run.sh uses them when CUDA_PREBUILT names the folder carried along, and builds as
# before when they do not run there (docs/bench.md, "The CUDA build made here").
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-.devprebuilt}
CW=${CROSS_WORK:-/tmp/cross-cuda}
SRC_ARCHIVE=${CROSS_SOURCE:-.devbundle/llama-src.tar.xz}
PY=${PYTHON:-.venv/bin/python}
CUDA_VERSION=13.0
[ -f "$SRC_ARCHIVE" ] || { echo "cross-build.sh: $SRC_ARCHIVE is missing (orchestrator build --export-source $SRC_ARCHIVE)" >&2; exit 2; }
mkdir -p "$CW/wheels" "$CW/toolkit"
TK=$CW/toolkit/nvidia/cu13
if [ ! -x "$TK/bin/nvcc" ]; then
  for p in nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt nvidia-cuda-runtime nvidia-cublas nvidia-cuda-cccl; do
    "$PY" -m pip download -q --no-deps -d "$CW/wheels" "$p==$CUDA_VERSION.*"
  done
  for w in "$CW"/wheels/*.whl; do unzip -q -o "$w" -d "$CW/toolkit"; done
  # the layout nvcc.profile and CMake's FindCUDAToolkit look for
  ln -sfn lib "$TK/lib64"
  for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$TK/lib/lib$l.so"; done
fi

SRC=$CW/src/llama-src
if [ ! -d "$SRC" ] || [ "$(cat "$CW/src.sha256" 2>/dev/null)" != "$(sha256sum "$SRC_ARCHIVE" | cut -d' ' -f1)" ]; then
  rm -rf "$CW/src" "$CW/build"; mkdir -p "$CW/src"
  tar xJf "$SRC_ARCHIVE" -C "$CW/src"
  sha256sum "$SRC_ARCHIVE" | cut -d' ' -f1 > "$CW/src.sha256"
fi

# orchestrator build's arguments for this build, then the device's CPU in place of --native
mapfile -t ARGS < <("$PY" - <<'EOF'
from orchestrator.backend.build import BuildOptions, cmake_args
for a in cmake_args(BuildOptions(native=False), cuda=True, archs=("90",)):
    print(a)
EOF
)
SPR=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
     -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON
     -DCMAKE_C_FLAGS=-march=sapphirerapids -DCMAKE_CXX_FLAGS=-march=sapphirerapids)
export CUDACXX=$TK/bin/nvcc CUDAToolkit_ROOT=$TK

# the driver stub: an empty libcuda.so.1 for CMake, then one with the functions the static ggml-cuda calls
stub() {
  mkdir -p "$TK/lib/stubs"
  local c=$CW/libcuda-stub.c
  { echo "/* link-time stand-in for the NVIDIA driver; never loaded on a machine with a GPU */"
    for s in "$@"; do echo "int $s(void) { return 999; }"; done; } > "$c"
  gcc -shared -fPIC -o "$TK/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$c"
}
[ -f "$TK/lib/stubs/libcuda.so" ] || stub
[ -f "$CW/build/build.ninja" ] || cmake -S "$SRC" -B "$CW/build" -G Ninja "${ARGS[@]}" "${SPR[@]}" > "$CW/cmake.log"
ninja -C "$CW/build" -j "${CROSS_JOBS:-$(nproc)}" ggml-cuda
stub $(nm -u "$CW/build/ggml/src/ggml-cuda/libggml-cuda.a" 2>/dev/null | awk '{print $2}' | grep -E '^cu[A-Z]' | sort -u)
ninja -C "$CW/build" -j "${CROSS_JOBS:-$(nproc)}" llama-server llama-bench

# one binary per folder: each is ~42 MB compressed (its kernels are compressed already), and a command carries at
# most 64 MiB with the working tree, so the server and llama-bench travel in separate commands
for t in llama-server llama-bench; do
  d=$OUT_DIR/${t#llama-}; mkdir -p "$d"
  strip -o "$CW/$t.stripped" "$CW/build/bin/$t"
  xz -T0 -6 -c "$CW/$t.stripped" > "$d/$t.xz.partial" && mv "$d/$t.xz.partial" "$d/$t.xz"
done
"$PY" - "$OUT_DIR/server/build.json" "$(cat "$CW/src.sha256")" "$TK" "${ARGS[@]}" "${SPR[@]}" <<'EOF'
import json, subprocess, sys
out, sha, tk, *args = sys.argv[1:]
nvcc = subprocess.run([f"{tk}/bin/nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
json.dump({"source_sha256": sha, "cmake": args, "nvcc": nvcc, "host_compiler": gcc,
           "built_on": "a machine without a GPU (lab/device/cross-build.sh)"}, open(out, "w"), indent=1)
EOF
cp "$OUT_DIR/server/build.json" "$OUT_DIR/bench/build.json"

# .devlean: the bundle without Ray, which leaves room for one binary in a command's 64 MiB: on-device.sh, the
# wheels plan, bench and synth-model import, and the source for a fallback build
LEAN=${CROSS_LEAN:-.devlean}
rm -rf "$LEAN"; mkdir -p "$LEAN/whl"
cp .devbundle/on-device.sh "$LEAN/"; cp "$SRC_ARCHIVE" "$LEAN/llama-src.tar.xz"   # where run.sh builds from
for w in pydantic pydantic_core annotated_types typing_inspection gguf rich markdown_it_py mdurl pygments; do
  cp .devbundle/whl/"$w"-[0-9]*.whl "$LEAN/whl/"
done
tar cJf "$LEAN/ray.tar.xz" -T /dev/null      # on-device.sh unpacks it: an empty archive
ls -la "$OUT_DIR"/* "$LEAN"
