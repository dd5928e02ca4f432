#!/usr/bin/env bash
# Builds floorline_marlin.so for the awq-marlin path: the AWQ 4-bit Marlin kernels of the
# marlin-kernels 0.2.0 sdist (vLLM csrc/quantization/gptq_marlin, mid-2024; its 0.3.x sdists
# ship no sources) plus torch_bindings.cpp, for sm_90 (TORCH_CUDA_ARCH=90 to change).
#   bash third_party/marlin/build.sh [marlin-kernels-0.2.0.tar.gz]
# Needs nvcc and the CUDA build of torch the library will run under (TORCH_DIR overrides where
# its headers and libraries are). Prints the FLOORLINE_MARLIN_LIB to set.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$here/build
mkdir -p "$work"
sdist=${1:-$work/marlin-kernels-0.2.0.tar.gz}
[[ -f $sdist ]] || python3 -m pip download -q --no-deps --no-binary :all: marlin-kernels==0.2.0 -d "$work"
tar -xzf "$sdist" -C "$work"
src=$work/marlin-kernels-0.2.0/marlin_kernels/gptq_marlin
# Dispatch only the AWQ 4-bit kernels (uint4 with zero points): 128 instantiations of the
# 576, so the one large file compiles in minutes.
sed -i -E '/^\s+GPTQ_CALL_IF\(|^\s+AWQ_CALL_IF\(8,/d' "$src/gptq_marlin.cu"
# The stream and device guard come from c10, not ATen/cuda/CUDAContext.h, whose cuBLAS and
# cuSPARSE headers a pip-installed toolkit may lack.
sed -i 's|#include <ATen/cuda/CUDAContext.h>|#include <c10/cuda/CUDAGuard.h>\n#include <c10/cuda/CUDAStream.h>|' "$src/marlin.cuh"
sed -i 's/at::cuda::OptionalCUDAGuard/c10::cuda::OptionalCUDAGuard/; s/at::cuda::getCurrentCUDAStream/c10::cuda::getCurrentCUDAStream/' \
  "$src/gptq_marlin.cu" "$src/awq_marlin_repack.cu"
torch_dir=${TORCH_DIR:-$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")}
cuda=$(dirname "$(dirname "$(command -v nvcc)")")
inc="-I$torch_dir/include -I$torch_dir/include/torch/csrc/api/include -I$cuda/include"
flags="-O3 -std=c++17 -Xcompiler -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 --expt-relaxed-constexpr
  --expt-extended-lambda --use_fast_math -gencode arch=compute_${TORCH_CUDA_ARCH:-90},code=sm_${TORCH_CUDA_ARCH:-90}"
rm -f "$work"/*.o
pids=()
for f in gptq_marlin awq_marlin_repack; do
  nvcc -c "$src/$f.cu" -o "$work/$f.o" $inc $flags & pids+=($!)
done
g++ -c "$here/torch_bindings.cpp" -o "$work/torch_bindings.o" -O2 -std=c++17 -fPIC \
  -D_GLIBCXX_USE_CXX11_ABI=1 $inc
for p in "${pids[@]}"; do wait "$p"; done
g++ -shared -o "$work/floorline_marlin.so" "$work"/{gptq_marlin,awq_marlin_repack,torch_bindings}.o \
  -L"$torch_dir/lib" -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -ltorch -L"$cuda/lib64" -lcudart
echo "export FLOORLINE_MARLIN_LIB=$work/floorline_marlin.so"
