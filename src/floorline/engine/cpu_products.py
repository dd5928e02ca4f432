"""How the CPU step multiplies its 16-bit matrices, chosen by what this processor does fastest.

A matrix is always held as stored (its floor is its own bytes). Each product runs by one of three
routes, with the same arithmetic: x rounded to the weights' dtype, products summed in fp32, the
output rounded to the weights' dtype (floorline.engine.cpu). The routes differ only in the order
of the fp32 sums, so the choice leaves the step's quality as it was.
- NATIVE: in the 16-bit type, through ATen's own GEMV for up to ATEN_ROWS rows (torch.mv for one,
  oneDNN switched off around the product for two) and PyTorch's default, oneDNN's GEMM, for more.
- WIDENED: the matrix widened to fp32 as it is read (a temporary of 4 bytes a weight) and
  multiplied by fp32's GEMM.
- KERNEL: up to ATEN_ROWS rows through floorline's own AVX2 product (floorline.engine.cpu_kernel),
  where it could be built here.

Which is faster depends on the processor, most on whether it has bf16 dot products (AVX-512 BF16,
AMX). On 2 cores of an Intel Xeon with them (torch 2.13.0, SmolLM2-135M's 30 layers and head,
`bench/cpu_engine.py`, medians of 3 passes), 64 rows took 49 ms as stored and 188 ms widened;
with ATen and oneDNN held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, the
kernels a processor without AVX-512 runs) 909 ms as stored and 189 ms widened, at 16 rows 235
against 128, at 256 rows 2981 against 372. One row took 26-28 ms as stored either way and 76-87
ms widened. So plan_products times the routes on the model's own matrices when an engine loads,
for a few rows and for many, and leaves PyTorch's own product only where another is clearly
faster (WIDEN_BY, KERNEL_BY).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.backends.mkldnn as onednn
import torch.nn.functional as F

from floorline.engine import cpu_kernel
from floorline.engine.quant import dense

NATIVE, WIDENED, KERNEL = "native", "widened", "kernel"
ATEN_ROWS = cpu_kernel.ROWS  # NATIVE products of up to this many rows through ATen's GEMV
TRIAL_ROWS = 64  # the many-row trial: a chunk of a prefill or a quality window
TRIAL_BYTES = 32 << 20  # matrices timed in the many-row trial, taken layer by layer
FEW_TRIAL_BYTES = 1 << 30  # at most this much of a step's matrices in the few-row trial
TRIAL_ROUNDS = 3  # each route's median over this many passes, the routes interleaved
# Widening moves three times a 16-bit matrix's bytes (read it, write and read its fp32 copy):
# chosen only where it is this much faster, so that a close call on a noisy host stays native.
WIDEN_BY = 1.25
# The kernel reads what PyTorch's product reads; its margin only keeps a close call with PyTorch.
KERNEL_BY = 1.1


def aten_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T through ATen's own kernels: oneDNN switched off around the product."""
    enabled = onednn.enabled
    onednn.enabled = False
    try:
        return F.linear(x, w)
    finally:
        onednn.enabled = enabled


@dataclass(frozen=True)
class ProductPlan:
    """The route of a 16-bit product with few rows (up to ATEN_ROWS: a decode step, a verify
    step of two) and with more (prefill chunks, quality windows, longer verify steps), and the
    trials' medians it was chosen from (ms, by regime and route; empty where not measured), and
    why floorline's kernel was not among them where it could not be built."""
    few: str = NATIVE
    many: str = NATIVE
    trials: dict = field(default_factory=dict, compare=False)
    no_kernel: str = field(default="", compare=False)

    def route(self, x: torch.Tensor) -> str:
        return self.few if x.dim() == 1 or x.shape[0] <= ATEN_ROWS else self.many

    def describe(self, dtype: torch.dtype, trials: bool = True) -> str:
        """One line for a user: each regime's route, with the trial that chose it."""
        name = str(dtype).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")

        said = {NATIVE: f"{name} as stored", WIDENED: f"{name} widened to fp32",
                KERNEL: f"{name} by floorline's AVX2 kernel"}
        timed = {NATIVE: name, WIDENED: "widened", KERNEL: "kernel"}

        def regime(which: str, rows: str) -> str:
            line = f"{rows}: {said[getattr(self, which)]}"
            if trials:
                line += " (" + ", ".join(f"{ms:.3g} ms {timed[route]}" for route, ms
                                         in self.trials[which].items()) + " in its trial)"
            return line
        lines = [regime(which, rows) for which, rows in
                 (("few", f"1-{ATEN_ROWS} rows"), ("many", "more rows")) if which in self.trials]
        if self.no_kernel and lines:
            lines.append(f"floorline's AVX2 kernel: {self.no_kernel}")
        return "; ".join(lines)


AS_STORED = ProductPlan()  # every product in the weights' own type
ALL_WIDENED = ProductPlan(WIDENED, WIDENED)


def linear(x: torch.Tensor, w: torch.Tensor, plan: ProductPlan = AS_STORED) -> torch.Tensor:
    """x W^T in W's dtype by the plan's route for x's rows (fp32 W as PyTorch chooses)."""
    if w.dtype == torch.float32:
        return F.linear(x, w)
    route = plan.route(x)
    if route == WIDENED:
        return F.linear(x.float(), w.float()).to(w.dtype)
    if route == KERNEL:
        return cpu_kernel.kernel().product(x, w)
    if x.dim() == 1:  # ATen's GEMV without linear's dispatch (equal to the bit, 5-15% faster)
        return torch.mv(w, x)
    if x.shape[0] > ATEN_ROWS:
        return F.linear(x, w)
    return aten_linear(x, w)


_plans: dict[tuple, ProductPlan] = {}  # this process's trials, by matrices' shapes and threads


def plan_products(weights) -> ProductPlan:
    """The faster route for few rows and for many on this processor (module docstring), timed
    once a process for the model's shapes, format and the thread count
    (floorline.engine.weights.DecoderWeights). A step's products are timed on what a step reads,
    every layer's matrices and the head (up to FEW_TRIAL_BYTES): a smaller sample stays in the
    processor's cache, where the routes rank otherwise. Many rows are timed on the first
    layers' matrices. Quantised matrices take the CPU's fp32 product for few rows
    (ReferenceOps), and a prefill's chunk multiplies them in the 16-bit dtype: for them only the
    many-row regime is timed, on their 16-bit form. Native where the model runs in fp32."""
    dtype = weights.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return AS_STORED
    step = [w for layer in weights.layers
            for w in (layer.wqkv, layer.wo, layer.wgate, layer.wup, layer.wdown)]
    if isinstance(weights.head, torch.Tensor):
        step.append(weights.head)
    stored = all(isinstance(w, torch.Tensor) for w in step)
    key = (dtype, stored, tuple(tuple(w.shape) for w in step), torch.get_num_threads())
    if key not in _plans:
        samples = {"many": [dense(w, dtype) for w in _first(step, TRIAL_BYTES)]}
        if stored:
            samples = {"few": _first(step, FEW_TRIAL_BYTES), **samples}
        _plans[key] = _trial(samples)
    return _plans[key]


def _first(matrices: list, size: int) -> list:
    """The first of matrices whose 16-bit forms hold at least size bytes (or all of them)."""
    taken, held = [], 0
    for w in matrices:
        if held >= size:
            break
        taken.append(w)
        held += math.prod(w.shape) * 2
    return taken


def _trial(samples: dict[str, list[torch.Tensor]]) -> ProductPlan:
    g = torch.Generator().manual_seed(0)
    trials, routes = {}, {"few": NATIVE}
    built = cpu_kernel.kernel()
    no_kernel = "" if isinstance(built, cpu_kernel.Kernel) else built
    for regime, sample in samples.items():
        rows = () if regime == "few" else (TRIAL_ROWS,)  # a decode step's x is one vector
        xs = {k: torch.randn(*rows, k, generator=g).to(sample[0].dtype)
              for k in {w.shape[1] for w in sample}}
        plans = {NATIVE: AS_STORED, WIDENED: ALL_WIDENED}
        if regime == "few" and not no_kernel:
            plans[KERNEL] = ProductPlan(KERNEL, NATIVE)
        times = {route: [] for route in plans}
        for rnd in range(TRIAL_ROUNDS + 1):  # the first pass of each warms it up
            for route, plan in plans.items():
                t0 = time.perf_counter()
                for w in sample:
                    linear(xs[w.shape[1]], w, plan)
                if rnd:
                    times[route].append((time.perf_counter() - t0) * 1e3)
        med = {route: statistics.median(t) for route, t in times.items()}
        trials[regime] = med
        route = WIDENED if med[WIDENED] * WIDEN_BY < med[NATIVE] else NATIVE
        if KERNEL in med and med[KERNEL] * KERNEL_BY < med[route]:
            route = KERNEL
        routes[regime] = route
    return ProductPlan(routes["few"], routes["many"], trials, no_kernel)
