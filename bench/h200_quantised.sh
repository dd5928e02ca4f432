#!/usr/bin/env bash
# The quantised paths on the lent H200 (issue 4), beside their 16-bit references, into one
# results database. Resumable: cells already valid under the same environment are skipped.
#   bash bench/h200_quantised.sh setup            install the carried wheels
#   bash bench/h200_quantised.sh build-llamacpp   build llama-cpp-python with CUDA (sm_90)
#   bash bench/h200_quantised.sh smoke            every path on qwen2.5-1.5b, few steps
#   bash bench/h200_quantised.sh hf|packed|compile|llamacpp   stages of the qwen2.5-7b grid
# Carried in .whl/ (no registry there): wheels of bitsandbytes (CUDA 13.0 library only),
# torchao, exllamav2, gguf, diskcache; the llama-cpp-python sdist (stripped of what a build
# does not need); floorline_marlin.so (kernels/marlin/build.sh). Built artefacts are kept in
# .whl/built/ when a call carries them back.
set -euo pipefail
cd "$(dirname "$0")/.."
DB=${DB:-bench/results/h200_quantised.db}
SITE=/tmp/site
export PYTHONPATH=src:$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLOORLINE_MARLIN_LIB=$PWD/.whl/floorline_marlin.so FLOORLINE_CACHE=/tmp/floorline-cache
export TORCH_EXTENSIONS_DIR=/tmp/torch-ext MAX_JOBS=${MAX_JOBS:-16}
export LLAMA_CPP_LIB_PATH=${LLAMA_CPP_LIB_PATH:-$SITE/llama_cpp/lib}
fl() { python3 -m floorline "$@"; }
MODEL=qwen2.5-7b CTX=2048,16384

build_llamacpp() {
  python3 -c "import llama_cpp" 2>/dev/null && return
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA_QUANTS=f16-f16 \
    -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$MAX_JOBS \
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target $SITE \
    .whl/llama_cpp_python-*.tar.gz
}

case ${1:?stage} in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl
    # an exllamav2 extension built by an earlier call (see `artefacts`) spares its ~200 s build
    for f in .whl/built/*.xz; do [[ -e $f ]] && xz -dc "$f" > "$SITE/$(basename "${f%.xz}")"; done ;;
  build-llamacpp) build_llamacpp ;;
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
  python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA wal_checkpoint(TRUNCATE)')" "$DB"
  fl show --db "$DB" --json > "${DB%.db}_cells.json"
  fl show --db "$DB" --csv > "${DB%.db}_cells.csv"
  fl show --db "$DB"
fi
