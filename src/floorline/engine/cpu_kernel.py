"""floorline's own products on the CPU (cpu_gemv.c): one or two rows with a 16-bit matrix, and one
fp32 row with a quantised matrix read as stored (int4, a GGUF file's Q4_1 and Q8_0 blocks). Built
at first use with the machine's C compiler and kept in floorline's cache.

Where the processor has no bf16 dot products (no AVX-512 BF16 or AMX: most laptops, and servers
with AVX2 alone), PyTorch's one-row bf16 product is bound by converting its weights, not by
reading them: it takes as long as fp32's on twice the bytes. The kernel converts 16 weights in
one instruction. On 2 cores of an Intel Xeon, SmolLM2-135M's one-row products (every layer's
matrices and the head, as the CPU step's trial times them; one run each, medians of 3 passes)
took 13.4 ms through it against 25.9 ms through torch.mv with ATen held to AVX2
(ATEN_CPU_CAPABILITY=avx2), and against 15.4 ms through torch.mv with the processor's AVX-512
BF16 dot products. It is one more route the CPU step times when it loads
(floorline.engine.cpu_products), never assumed.

It needs an x86-64 processor with AVX2, FMA and F16C, a C compiler (CC, else cc) and the OpenMP
runtime PyTorch itself loaded, which the kernel is linked against so that its threads are
PyTorch's. Where any is missing, `kernel()` says which.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from floorline.engine import quant
from floorline.localcache import cache_dir

SOURCE = Path(__file__).with_name("cpu_gemv.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC")
NEEDS = ("avx2", "fma", "f16c")  # /proc/cpuinfo's names for the instructions it uses
ROWS = 2  # the most rows of x one call takes
OPENMP = ("libgomp", "libiomp", "libomp")  # the runtimes PyTorch may link


class Kernel:
    """The loaded kernel: `product(x, w)` is x W^T for 1-ROWS rows, in W's 16-bit dtype."""

    def __init__(self, library: Path):
        self.library = library
        lib = ctypes.CDLL(str(library))
        self._fns = {}
        for dtype, name in ((torch.bfloat16, "gemv_bf16"), (torch.float16, "gemv_f16")):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
            self._fns[dtype] = fn
        self._int4, self._q8_0 = lib.gemv_int4, lib.gemv_q8_0
        self._int4.restype = self._q8_0.restype = ctypes.c_int
        self._int4.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3 + [ctypes.c_int]
        self._q8_0.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_int]

    def product(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows = 1 if x.dim() == 1 else x.shape[0]
        if (w.dtype not in self._fns or x.dtype != w.dtype or rows > ROWS
                or not w.is_contiguous() or x.shape[-1] != w.shape[1]):
            raise ValueError(f"the CPU kernel multiplies 1-{ROWS} rows with a contiguous bf16 or "
                             f"fp16 matrix of their dtype, not {tuple(x.shape)} {x.dtype} by "
                             f"{tuple(w.shape)} {w.dtype}")
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], w.shape[0], dtype=w.dtype)
        self._fns[w.dtype](w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, w.shape[0],
                           w.shape[1], torch.get_num_threads())
        return y

    def blocks(self, x: torch.Tensor, w) -> torch.Tensor:
        """x W^T in fp32 for one fp32 row x, W a quantised weight read as stored: int4 (and a
        GGUF file's Q4_0 blocks, which are int4), q4_1 or q8_0 (floorline.engine.quant)."""
        n, k = w.shape
        if x.dim() != 1 or x.dtype != torch.float32 or x.shape[0] != k:
            raise ValueError(f"the CPU kernel multiplies one fp32 row with a quantised matrix, "
                             f"not {tuple(x.shape)} {x.dtype} by {n}x{k}")
        x, y = x.contiguous(), torch.empty(n, dtype=torch.float32)
        threads = torch.get_num_threads()
        if isinstance(w, quant.Q8_0Weight):
            done = self._q8_0(w.qweight.data_ptr(), w.scales.data_ptr(), x.data_ptr(),
                              y.data_ptr(), n, k, threads)
        else:
            mins = getattr(w, "mins", None)
            zeros = getattr(w, "zeros", None)
            done = self._int4(w.qweight.data_ptr(), w.scales.data_ptr(),
                              None if zeros is None else zeros.data_ptr(),
                              None if mins is None else mins.data_ptr(), x.data_ptr(),
                              y.data_ptr(), n, k, w.group_size, threads)
        if done:
            raise ValueError(f"the CPU kernel cannot multiply a {quant.format_of(w)} matrix of "
                             f"{n}x{k} in groups of {w.group_size}")
        return y

    @staticmethod
    def takes(w) -> bool:
        """Whether `blocks` multiplies this quantised weight: int4 (groups of a multiple of
        16), q4_1 or q8_0, its tensors contiguous."""
        if isinstance(w, quant.Q8_0Weight):
            return w.qweight.is_contiguous() and w.scales.is_contiguous()
        return (isinstance(w, (quant.Int4Weight, quant.Q4_1Weight)) and w.group_size % 16 == 0
                and all(t.is_contiguous() for t in vars(w).values()
                        if isinstance(t, torch.Tensor)))


@functools.cache
def kernel() -> Kernel | str:
    """The kernel, built once a machine and loaded once a process, or why it cannot be (one
    line for a user)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"built for x86-64 Linux only, not {platform.system()} on {platform.machine()}"
    missing = [f for f in NEEDS if f not in _cpu_flags()]
    if missing:
        return f"this processor lacks {', '.join(missing)}"
    runtime = _openmp_runtime()
    if runtime is None:
        return "PyTorch here loads no OpenMP runtime for the kernel to share"
    cc = shlex.split(os.environ.get("CC") or "cc")
    if shutil.which(cc[0]) is None:
        return f"no C compiler ({cc[0]}; set CC to one)"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(cc + list(FLAGS)).encode(),
                                     str(runtime).encode()])).hexdigest()[:16]
    library = cache_dir() / "cpu-kernel" / f"gemv-{key}.so"
    if not library.exists():
        why = _build(cc, runtime, library)
        if why:
            return why
    try:
        return Kernel(library)
    except OSError as e:
        return f"built, but it would not load: {e}"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                 if line.startswith("flags")), set())


def _openmp_runtime() -> Path | None:
    """The OpenMP library mapped into this process, PyTorch's own (torch is imported)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = Path(line.split()[-1])
        if path.name.startswith(OPENMP) and ".so" in path.name:
            return path
    return None


def _build(cc: list[str], runtime: Path, library: Path) -> str | None:
    """Compiles and links the kernel into library (written whole, then renamed into place, so
    that processes building at once never load half a file); None, or why it failed."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        obj, out = Path(tmp) / "gemv.o", Path(tmp) / library.name
        # compiled with OpenMP, linked against PyTorch's runtime by path rather than the
        # compiler's own, so that the kernel's parallel loops run on PyTorch's threads
        for step in ([*cc, *FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                     [*cc, "-shared", str(obj), str(runtime), "-o", str(out)]):
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"{cc[0]} could not build it: {e}"
            if done.returncode:
                said = (done.stderr.strip().splitlines() or ["no message"])[0]
                return f"{cc[0]} could not build it: {said}"
        os.replace(out, library)
    return None
