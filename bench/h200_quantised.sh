#!/usr/bin/env bash
# The quantised paths on an H200, beside their 16-bit references, into one
# results database. Resumable: cells already valid under the same environment are skipped.
#   bash bench/h200_quantised.sh setup            install the carried wheels
#   bash bench/h200_quantised.sh build-llamacpp   build llama.cpp with CUDA (sm_90) for llama-cpp-python
#   bash bench/h200_quantised.sh smoke            every path on qwen2.5-1.5b, few steps
#   bash bench/h200_quantised.sh hf|packed|compile|llamacpp   stages of the qwen2.5-7b grid
#   bash bench/h200_quantised.sh gguf bf16|q4_0   write a llamacpp cell's GGUF ahead of it
#   bash bench/h200_quantised.sh llama-bench      llama.cpp's own timing of those GGUFs
#   bash bench/h200_quantised.sh llamacpp-debug   the llamacpp path on a small model under cuda-gdb
# Carried in .whl/ (no registry there): wheels of bitsandbytes (CUDA 13.0 library only),
# torchao, exllamav2, gguf, diskcache; the llama-cpp-python sdist as .tar.xz, stripped of what a
# build does not need; floorline_marlin.so (third_party/marlin/build.sh). Built artefacts are kept in
# .whl/built/ when a run copies them back.
# Where each run copies the working tree to the GPU machine anew, tracked databases included, a
# sweep left running in the background across runs loses its rows to the fresh copy. Give such
# a run DB=/tmp/... and copy that back (sqlite3's backup folds in the WAL).
set -euo pipefail
cd "$(dirname "$0")/.."
DB=${DB:-bench/results/h200-quantised/h200_quantised.db}
mkdir -p "$(dirname "$DB")"
SITE=/tmp/site
export PYTHONPATH=src:$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_RUN_LABEL="$(basename "$0") ${1:-}"  # names the runs it makes
# the awq-marlin path's library: one named before this script runs, else the one carried in .whl
export FLOORLINE_MARLIN_LIB=${FLOORLINE_MARLIN_LIB:-$PWD/.whl/floorline_marlin.so}
export FLOORLINE_CACHE=/tmp/floorline-cache
export TORCH_EXTENSIONS_DIR=/tmp/torch-ext MAX_JOBS=${MAX_JOBS:-16}
export LLAMA_CPP_LIB_PATH=${LLAMA_CPP_LIB_PATH:-$SITE/llama_cpp/lib}
fl() { python3 -m floorline "$@"; }
MODEL=qwen2.5-7b CTX=2048,16384

# llama.cpp from llama-cpp-python's source package (stripped: no models/, docs/, .git), built by
# CMake alone so that the same build gives the library the Python package loads and llama.cpp's
# own llama-bench; with debug symbols, so that a crash can be placed (cuda-gdb; there is no gdb).
# --exclude-libs: with the device's CUDA 13 toolkit, libggml-cuda.so exported a copy of
# libstdc++'s stream code from a static archive linked into it, libllama's std::ostream calls bound to
# that copy, whose locale was never set up, and model loading segfaulted in print_info
# (bench/results/h200-quantised/h200_llamacpp_segfault.log); hiding the archives' symbols fixes it.
LLAMA_SRC=/tmp/llama-src LLAMA_BUILD=/tmp/llama-build
build_llamacpp() {
  [[ -e $SITE/llama_cpp/lib/libllama.so ]] && return
  mkdir -p $LLAMA_SRC $SITE/llama_cpp/lib
  tar -xJf .whl/llama_cpp_python-*.tar.xz -C $LLAMA_SRC --strip-components=1
  cmake -S $LLAMA_SRC/vendor/llama.cpp -B $LLAMA_BUILD -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL
  cmake --build $LLAMA_BUILD --target llama llama-bench -j $MAX_JOBS
  cp -r $LLAMA_SRC/llama_cpp $SITE/ && cp -P $LLAMA_BUILD/bin/*.so* $SITE/llama_cpp/lib/
}
ggufs() { ls $FLOORLINE_CACHE/gguf/${MODEL}-*-seed0.gguf; }

case ${1:?stage} in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl
    # an exllamav2 extension built by an earlier call (see `artefacts`) spares its ~200 s build
    for f in .whl/built/*.xz; do [[ -e $f ]] && xz -dc "$f" > "$SITE/$(basename "${f%.xz}")"; done ;;
  build-llamacpp) build_llamacpp ;;
  gguf)  # the GGUFs the llamacpp cells load, written ahead of them into the cache
    python3 -c "import sys; from floorline.models.zoo import resolve_model
from floorline.paths.llamacpp import gguf_file
print(gguf_file(resolve_model(sys.argv[1]), sys.argv[2], 0))" $MODEL "${2:?bf16 or q4_0}"; exit ;;
  llamacpp-debug)  # the llamacpp path on a small model under cuda-gdb: where a crash is
    FLOORLINE_LLAMA_LOG=1 cuda-gdb -batch -ex run -ex "bt 40" -ex "info sharedlibrary" --args \
      python3 -m floorline sweep --db /tmp/llamacpp-debug.db --models qwen2.5-1.5b --ctx 512 \
      --steps 8 --warmup 2 --paths llamacpp-q4_0,llamacpp-bf16; exit ;;
  llama-bench)  # llama.cpp's own batch-1 decode timing of the same files, beside the path's
    for f in $(ggufs); do
      $LLAMA_BUILD/bin/llama-bench -m "$f" -ngl 99 -p 0 -n 64 -d ${CTX} -r 3 -o jsonl
    done; exit ;;
  fl) shift; fl "$@"; exit ;;
  py) shift; python3 "$@"; exit ;;
  sh) shift; source "$@"; exit ;;
  artefacts)  # what the builds made, xz-compressed into $2, to carry back as .whl/built
    find $TORCH_EXTENSIONS_DIR -name 'exllamav2_ext*.so' -exec xz -T0 -k -c {} \; > "$2/exllamav2_ext.so.xz"
    tar -C $SITE -cJf "$2/llama_cpp.tar.xz" llama_cpp 2>/dev/null || true
    ls -la "$2"; exit ;;
  smoke)
    python3 bench/quantised_check.py
    fl sweep --db "${DB%.db}_smoke.db" --models qwen2.5-1.5b --ctx 512 --steps 8 --warmup 2 --paths \
      hf-static,hf-static+graphs,bnb-nf4,bnb-nf4+graphs,bnb-int8,bnb-int8+graphs,gptq-exllamav2,gptq-exllamav2+graphs,awq-marlin,awq-marlin+graphs,torchao-int4,torchao-int4+graphs,llamacpp-bf16,llamacpp-q4_0
    ;;
  hf) fl sweep --db "$DB" --models $MODEL --ctx $CTX --paths \
        hf-static,hf-static+graphs,bnb-nf4,bnb-nf4+graphs,bnb-int8,bnb-int8+graphs,torchao-int4,torchao-int4+graphs ;;
  packed) fl sweep --db "$DB" --models $MODEL --ctx $CTX --paths \
        gptq-exllamav2,gptq-exllamav2+graphs,awq-marlin,awq-marlin+graphs ;;
  compile) fl sweep --db "$DB" --models $MODEL --ctx $CTX --paths \
        hf-static+compile+graphs,torchao-int4+compile+graphs ;;
  llamacpp) fl sweep --db "$DB" --models $MODEL --ctx $CTX --paths llamacpp-bf16,llamacpp-q4_0 ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
if [[ $1 != setup && $1 != build-llamacpp && $1 != smoke ]]; then
  # one self-contained file to commit: the write-ahead log folded in and removed
  python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA journal_mode=DELETE')" "$DB" 2>/dev/null || true
  fl show --db "$DB" --json > "${DB%.db}_cells.json"
  fl show --db "$DB" --csv > "${DB%.db}_cells.csv"
  fl show --db "$DB"
fi
