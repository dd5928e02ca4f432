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
A quantised matrix's one-row product has two routes, with the reference's arithmetic (x and the
sums in fp32): from the matrix's fp32 form (NATIVE, ReferenceOps') or its int4, q4_1 or q8_0
values read as stored by floorline's kernel (KERNEL).

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

from floorline.engine import cpu_kernel, quant
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
    # a quantised matrix's one-row product: from its fp32 form (NATIVE, the reference's) or as
    # stored through floorline's kernel (KERNEL)
    blocks: str = NATIVE

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
        if "blocks" in self.trials:
            line = ("quantised, 1 row: " + ("as stored, by floorline's AVX2 kernel"
                                            if self.blocks == KERNEL else "from their fp32 form"))
            if trials:
                t = self.trials["blocks"]
                kernel = f", {t[KERNEL]:.3g} ms kernel" if KERNEL in t else ""
                line += f" ({t[NATIVE]:.3g} ms fp32 form{kernel} in its trial)"
            lines.append(line)
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
    (floorline.engine.weights.DecoderWeights). A step's 16-bit products are timed on what a
    step reads, every such matrix of its layers and head (up to FEW_TRIAL_BYTES): a smaller
    sample stays in the processor's cache, where the routes rank otherwise. Many rows are timed
    on the first layers' matrices, a quantised one in its 16-bit form (as a prefill's chunk
    multiplies it). A quantised matrix's one-row products are timed from its fp32 form (the
    reference's) and as stored through floorline's kernel, over every quantised matrix of a step
    (up to FEW_TRIAL_BYTES of their 16-bit forms). An fp32 model's unquantised products are
    PyTorch's."""
    dtype = weights.dtype
    sixteen = dtype in (torch.bfloat16, torch.float16)
    step = [w for layer in weights.layers
            for w in (layer.wqkv, layer.wo, layer.wgate, layer.wup, layer.wdown)]
    step.append(weights.head)
    quantised = [w for w in step if not isinstance(w, torch.Tensor)]
    if not sixteen and not quantised:
        return AS_STORED
    key = (dtype, tuple(quant.format_of(w) for w in step), tuple(tuple(w.shape) for w in step),
           torch.get_num_threads())
    if key not in _plans:
        samples = {}
        stored = [w for w in step if isinstance(w, torch.Tensor)]
        if sixteen and stored:
            samples["few"] = _first(stored, FEW_TRIAL_BYTES)
        if sixteen:
            samples["many"] = [dense(w, dtype) for w in _first(step, TRIAL_BYTES)]
        if quantised:
            samples["blocks"] = _first(quantised, FEW_TRIAL_BYTES)
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


def _trial(samples: dict[str, list]) -> ProductPlan:
    g = torch.Generator().manual_seed(0)
    trials, routes = {}, {"few": NATIVE, "many": NATIVE, "blocks": NATIVE}
    built = cpu_kernel.kernel()
    no_kernel = "" if isinstance(built, cpu_kernel.Kernel) else built
    for regime, sample in samples.items():
        rows = (TRIAL_ROWS,) if regime == "many" else ()  # a decode step's x is one vector
        dtype = torch.float32 if regime == "blocks" else sample[0].dtype
        xs = {k: torch.randn(*rows, k, generator=g).to(dtype) for k in {w.shape[1] for w in sample}}
        if regime == "blocks":  # the reference's fp32 form, made here for the trial alone
            forms = {id(w): dense(w) for w in sample}
            products = {NATIVE: lambda x, w, forms=forms: F.linear(x, forms[id(w)])}
            if not no_kernel and all(built.takes(w) for w in sample):
                products[KERNEL] = built.blocks
        else:
            products = {NATIVE: lambda x, w: linear(x, w, AS_STORED),
                        WIDENED: lambda x, w: linear(x, w, ALL_WIDENED)}
            if regime == "few" and not no_kernel:
                products[KERNEL] = lambda x, w: linear(x, w, ProductPlan(KERNEL, NATIVE))
        times = {route: [] for route in products}
        for rnd in range(TRIAL_ROUNDS + 1):  # the first pass of each warms it up
            for route, product in products.items():
                t0 = time.perf_counter()
                for w in sample:
                    product(xs[w.shape[1]], w)
                if rnd:
                    times[route].append((time.perf_counter() - t0) * 1e3)
        med = {route: statistics.median(t) for route, t in times.items()}
        trials[regime] = med
        route = WIDENED if WIDENED in med and med[WIDENED] * WIDEN_BY < med[NATIVE] else NATIVE
        if KERNEL in med and med[KERNEL] * KERNEL_BY < med[route]:
            route = KERNEL
        routes[regime] = route
    return ProductPlan(routes["few"], routes["many"], trials, no_kernel, routes["blocks"])
