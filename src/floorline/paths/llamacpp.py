"""llama.cpp through llama-cpp-python's C API: `llamacpp-bf16`, `-q4_0`, `-q4_1` and `-q8_0`.

A local directory holding config.json and one .gguf file is loaded as it is; otherwise the
model's config is written once as a GGUF of seeded random weights (layouts/gguf.py) into the
cache directory (FLOORLINE_CACHE, default ~/.cache/floorline) and reused. Every layer is on
the GPU, the KV cache in f16, flash attention as llama.cpp decides (auto). A step is one
llama_decode of one token, llama_synchronize, and greedy argmax over the logits on the host:
llama.cpp's own step, synchronous, so the timer's events bracket all of it. llama.cpp replays
its own CUDA graphs inside llama_decode, so floorline's +graphs and +compile do not apply. A
llama.cpp that dies loading the file takes only its cell's process with it (measure/runner.py).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from pathlib import Path

from floorline.errors import FloorlineError
from floorline.layouts.gguf import WRITER_VERSION, file_type, write_random_gguf
from floorline.localcache import cache_dir
from floorline.models.gguf_checkpoint import gguf_files, model_gguf
from floorline.paths.base import DecodePath, Library, PathFacts, Session
from floorline.paths.quantised import library_missing, library_version

N_BATCH = 2048  # prefill tokens per llama_decode call, llama.cpp's default
_log_callback = None  # llama.cpp keeps the pointer: the callback must live as long as the process


def load_llama_cpp(device: str):
    """The ctypes bindings, with llama.cpp's logging silenced. A CUDA build links the CUDA
    runtime and cuBLAS, which a pip-installed torch carries under nvidia/*/lib: load those first
    so that the build finds them without LD_LIBRARY_PATH."""
    global _log_callback
    if device.startswith("cuda") and "llama_cpp" not in sys.modules:
        for name in ("libcudart.so.1[0-9]", "libcublasLt.so.1[0-9]", "libcublas.so.1[0-9]"):
            found = [f for p in sys.path
                     for f in glob.glob(os.path.join(p, "nvidia", "*", "lib", name))]
            if found:
                ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
    import llama_cpp

    if _log_callback is None:  # once per process
        _log_callback = llama_cpp.llama_log_callback(lambda level, text, data: None)
        if not os.environ.get("FLOORLINE_LLAMA_LOG"):  # set it to see llama.cpp's own log
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


def gguf_file(model_spec, fmt: str, seed: int) -> Path:
    """The GGUF this cell runs: the one .gguf file of a model directory, loaded as it is (its
    file type must be the path's); else seeded random weights of the model's config, written
    once into the cache."""
    import hashlib

    directory = model_spec.weights_dir or Path(model_spec.name)
    if gguf_files(model_spec):
        found = model_gguf(model_spec)  # one, or one line
        held = file_type(found)
        if held != fmt:
            advice = f"run it as llamacpp-{held}" if held else "floorline has no floor for its type"
            raise FloorlineError(f"{found} is not a {fmt} GGUF: {advice}")
        return found
    if model_spec.has_real_weights:
        raise FloorlineError(f"{directory} holds safetensors but no .gguf: convert it with "
                             "llama.cpp's convert_hf_to_gguf.py (random weights are drawn only "
                             "for a config alone)")
    config = model_spec.config.to_json_string(use_diff=False)
    key = hashlib.sha256(f"{WRITER_VERSION} {config}".encode()).hexdigest()[:16]
    path = cache_dir() / "gguf" / f"{directory.name}-{key}-{fmt}-seed{seed}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        try:
            write_random_gguf(model_spec.config, partial, fmt, seed)
        except BaseException:
            partial.unlink(missing_ok=True)  # several GB that no later run can use
            raise
        partial.rename(path)  # a file under the final name is always complete
    return path


def model_params(L, device: str):
    """llama_model_params of a cell: every layer on the GPU, or none on the CPU."""
    params = L.llama_model_default_params()
    params.n_gpu_layers = -1 if device.startswith("cuda") else 0
    return params


class LlamaCppSession(Session):
    not_static_reason = ("llama.cpp replays its own CUDA graphs inside llama_decode; floorline "
                         "cannot capture or compile its step")

    def __init__(self, L, file: Path, device: str, capacity: int, seed: int):
        import numpy as np

        self.L, self.seed = L, seed
        self.llama_model = L.llama_model_load_from_file(str(file).encode(), model_params(L, device))
        if not self.llama_model:
            raise FloorlineError(f"llama.cpp could not load {file}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = capacity, N_BATCH, 512, 1
        cp.type_k = cp.type_v = 1  # GGML_TYPE_F16
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.llama_model, cp)
        if not self.ctx:
            L.llama_model_free(self.llama_model)
            raise FloorlineError("llama.cpp could not create a context of "
                                 f"{capacity} tokens for {file}")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.llama_model))
        self.batch = L.llama_batch_init(N_BATCH, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(N_BATCH,))
        self.positions = np.ctypeslib.as_array(self.batch.pos, shape=(N_BATCH,))
        self.wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(N_BATCH,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(N_BATCH,))[:] = 1
        for i in range(N_BATCH):
            self.batch.seq_id[i][0] = 0
        self.position = 0
        self.token = None

    def _feed(self, tokens, every: bool = False) -> None:
        """Feeds `tokens` at the next positions, asking for the last one's logits (`every`:
        each one's)."""
        import numpy as np

        n = len(tokens)
        self.tokens[:n] = tokens
        self.positions[:n] = np.arange(self.position, self.position + n)
        self.wants_logits[:n] = 1 if every else 0
        self.wants_logits[n - 1] = 1
        self.batch.n_tokens = n
        code = self.L.llama_decode(self.ctx, self.batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} at position {self.position}")
        self.position += n
        self.L.llama_synchronize(self.ctx)

    def _logits(self, i: int):
        """The logits of the i-th token of the last batch fed."""
        import numpy as np

        return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i),
                                     shape=(self.vocab,))

    def _decode(self, tokens) -> int:
        """Feeds `tokens` at the next positions; returns the greedy next token."""
        self._feed(tokens)
        return int(self._logits(len(tokens) - 1).argmax())

    def window_logits(self, ids):
        """llama.cpp's logits at every position of `ids`, from position 0 of a cleared cache,
        as it computes them from the file's blocks."""
        import numpy as np
        import torch

        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        self.position = 0
        ids = ids.view(-1).tolist()
        out = np.empty((len(ids), self.vocab), np.float32)
        for start in range(0, len(ids), N_BATCH):
            chunk = ids[start:start + N_BATCH]
            self._feed(chunk, every=True)
            for i in range(len(chunk)):
                out[start + i] = self._logits(i)
        return torch.from_numpy(out)

    def prefill(self, ctx: int) -> None:
        import numpy as np

        prompt = np.random.default_rng(self.seed).integers(0, self.vocab, ctx, dtype=np.int32)
        for start in range(0, ctx, N_BATCH):
            self.token = self._decode(prompt[start:start + N_BATCH])

    def step(self) -> None:
        self.token = self._decode([self.token])

    def close(self) -> None:
        if self.batch is not None:
            self.L.llama_batch_free(self.batch)
        if self.ctx:
            self.L.llama_free(self.ctx)
        if self.llama_model:
            self.L.llama_model_free(self.llama_model)
        self.batch = self.ctx = self.llama_model = None


LLAMA_CPP = Library("llama_cpp", "llama-cpp-python", "llamacpp")


class LlamaCppPath(DecodePath):
    FACTS = {"bf16": PathFacts("llamacpp-bf16", "gguf-bf16", "fp16", library=LLAMA_CPP),
             **{fmt: PathFacts(f"llamacpp-{fmt}", f"gguf-{fmt}", "fp16",
                               reference="llamacpp-bf16", library=LLAMA_CPP)
                for fmt in ("q4_0", "q4_1", "q8_0")}}

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.facts = self.FACTS[fmt]

    def unavailable(self, device: str) -> str | None:
        lib = self.facts.library
        return (library_missing(lib.module, lib.distribution, lib.extra)
                or library_missing("gguf", "gguf", lib.extra))

    def versions(self) -> dict:
        distribution = self.facts.library.distribution
        return {distribution: library_version(distribution), "gguf": library_version("gguf")}

    def real_weights(self, model_spec) -> bool:
        return bool(gguf_files(model_spec))

    def open(self, model_spec, device: str, capacity: int, seed: int) -> Session:
        L = load_llama_cpp(device)
        if device.startswith("cuda") and not L.llama_supports_gpu_offload():
            raise FloorlineError("this llama-cpp-python was built without GPU support; rebuild it "
                                 "with CMAKE_ARGS=-DGGML_CUDA=on")
        return LlamaCppSession(L, gguf_file(model_spec, self.fmt, seed), device, capacity, seed)
