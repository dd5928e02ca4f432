"""Products for a few rows of activations at once, Y = X W^T (X [m, K], m up to 16): the verify
step's linears, with the GEMV's fusions (floorline.engine.kernels.gemv: NORM per row, SWIGLU
and GELU, BIAS, ACCUMULATE into the fp32 residual rows, SCALE for fp8's row scales).

Each program owns BLOCK_N output columns for every row and reads its slice of W once, as
tiles that go through the tensor cores against all m rows (padded to 16) together: at batch 1
the step is bound by reading W, so m rows cost about what one does until the arithmetic
catches up. W's tile enters the dot in the 16-bit dtype, exactly: a 16-bit matrix as stored,
fp8 values (each one a bf16) with the row scales applied after the sum, int4 as q - zero (small
integers) one group per tile, scaled per group after its dot. X is fp32 (the residual stream);
it enters as two 16-bit parts, hi + lo, two dots, so that its rounding is about 2^-16 rather
than the dtype's 2^-8. fp32 models take one fp32 dot in IEEE arithmetic.

A split along K (SPLIT_K programs per column block), as the GEMV's, for when N / BLOCK_N
programs cannot keep enough of W in flight: a plain accumulating product adds each split's
[m, BLOCK_N] sums into the fp32 rows with atomics; any other (REDUCE) adds them, with each row's
sum of squares for the norm (linear: x g before the dot, rstd per row after), into fp32 partials
(the GEMV's SplitPartials, BLOCK_M rows of them) with a count of the splits arrived per column
block, and the last to arrive finishes the block and leaves partials and count at zero. Unsplit,
a program's sums are whole and accumulation is a plain read-add-write, in a fixed order. The
launch (block sizes, warps, stages, splits) is tuned per GPU and shape as the GEMV's is
(floorline.engine.tuning); one configuration serves every m, all padded to BLOCK_M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from floorline.engine.kernels.arrival import meet_in_partials
from floorline.engine.kernels.gemv import GemvConfig, SplitPartials
from floorline.engine.quant import Fp8Weight, Int4Weight

BLOCK_M = 16  # rows of X per tile: the tensor cores' smallest


@triton.jit
def _dot(x, w, acc, SPLIT: tl.constexpr, EMULATE: tl.constexpr):
    """acc + x w^T (x [BLOCK_M, BK] fp32, w [BLOCK_N, BK] in the dot's dtype). EMULATE (Triton's
    CPU interpreter, whose 16-bit dots are wrong): the same 16-bit values, multiplied in fp32."""
    wt = tl.trans(w)
    if SPLIT:
        hi = x.to(w.dtype)
        lo = (x - hi.to(tl.float32)).to(w.dtype)
        if EMULATE:
            wt32 = wt.to(tl.float32)
            acc = tl.dot(hi.to(tl.float32), wt32, acc, input_precision="ieee")
            acc = tl.dot(lo.to(tl.float32), wt32, acc, input_precision="ieee")
        else:
            acc = tl.dot(lo, wt, tl.dot(hi, wt, acc))
    else:
        acc = tl.dot(x, wt, acc, input_precision="ieee")
    return acc


@triton.jit
def _int4_group(x, w_ptr, s_ptr, z_ptr, at, shift, meta, ok, n_ok, DOT: tl.constexpr,
                SPLIT: tl.constexpr, EMULATE: tl.constexpr):
    """x times one group of int4 columns: the dot with q - zero, then each row's scale."""
    q = (tl.load(w_ptr + at, mask=ok, other=0) >> shift) & 15
    z = tl.load(z_ptr + meta, mask=n_ok, other=0).to(tl.int32)
    s = tl.load(s_ptr + meta, mask=n_ok, other=0.0).to(tl.float32)
    part = _dot(x, (q - z[:, None]).to(tl.float32).to(DOT),
                tl.zeros((x.shape[0], q.shape[0]), tl.float32), SPLIT, EMULATE)
    return part * s[None, :]


@triton.jit
def _rows_kernel(x_ptr, w_ptr, up_ptr, s_ptr, z_ptr, up_s_ptr, up_z_ptr, bias_ptr, norm_ptr,
                 out_ptr, part_ptr, count_ptr, M, N, K, eps, NORM: tl.constexpr,
                 SWIGLU: tl.constexpr, GELU: tl.constexpr, BIAS: tl.constexpr,
                 ACCUMULATE: tl.constexpr, REDUCE: tl.constexpr, FORMAT: tl.constexpr,
                 GROUP: tl.constexpr, SPLIT: tl.constexpr, EMULATE: tl.constexpr,
                 DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """FORMAT 0: a 16-bit (or fp32) W [N, K]; 1: fp8 W with row scales s; 2: int4 in the
    engine's layout (floorline.engine.quant), BLOCK_K = GROUP. DOT: the dot's input dtype.
    Program (i, j) owns column block i and K-split j, a run of whole BLOCK_Ks (int4: groups)."""
    pid = tl.program_id(0)
    if SPLIT_K == 1:
        pid_k, k_lo, k_hi = 0, 0, K
    else:
        pid_k = tl.program_id(1)
        span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * span
        k_hi = tl.minimum(k_lo + span, K)
    m = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    squares = tl.zeros((BLOCK_M,), tl.float32)
    W: tl.constexpr = GROUP // 8  # int4: words per group and row
    block, r = n // 4, n % 4  # int4: rows interleaved by four
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K  # a split ends on a block's end, or K's
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        if NORM:
            squares += tl.sum(x * x, axis=1)
            x *= tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        ok = n_ok[:, None] & k_ok[None, :]
        if FORMAT == 2:
            g = k0 // GROUP
            within = k - k0  # j * W + i: nibble j of word position i
            at = (block.to(tl.int64)[:, None] * (K // 8 * 4)
                  + (g * W + within % W)[None, :] * 4 + r[:, None])
            shift = (within // W * 4)[None, :]
            meta = block.to(tl.int64) * (K // GROUP * 4) + g * 4 + r
            acc += _int4_group(x, w_ptr, s_ptr, z_ptr, at, shift, meta, ok, n_ok, DOT, SPLIT,
                               EMULATE)
            if SWIGLU:
                acc_up += _int4_group(x, up_ptr, up_s_ptr, up_z_ptr, at, shift, meta, ok, n_ok,
                                      DOT, SPLIT, EMULATE)
        else:
            at = n.to(tl.int64)[:, None] * K + k[None, :]
            acc = _dot(x, tl.load(w_ptr + at, mask=ok, other=0.0).to(DOT), acc, SPLIT, EMULATE)
            if SWIGLU:
                acc_up = _dot(x, tl.load(up_ptr + at, mask=ok, other=0.0).to(DOT), acc_up,
                              SPLIT, EMULATE)
    if FORMAT == 1:  # per column: a split's part may be scaled alone
        acc *= tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
        if SWIGLU:
            acc_up *= tl.load(up_s_ptr + n, mask=n_ok, other=0.0)[None, :]
    at = m[:, None] * N + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    squares = squares[:, None]
    if REDUCE:  # partials: each of BLOCK_M rows' sums, gate then up, then each block's squares
        last, acc, acc_up, squares = meet_in_partials(
            acc, acc_up, squares, at, ok, (pid * BLOCK_M + m)[:, None], part_ptr,
            part_ptr + BLOCK_M * N, part_ptr + 2 * BLOCK_M * N, count_ptr + pid, SWIGLU, NORM,
            SPLIT_K)
        if last:  # whole sums, finished as an only split's would be (zero where masked off:
            # undefined there, and the norm's rstd of a padded row is large)
            _finish(tl.where(ok, acc, 0.0), tl.where(ok, acc_up, 0.0), squares, n, n_ok, at, ok,
                    0, bias_ptr, out_ptr, K, eps, NORM, SWIGLU, GELU, BIAS, ACCUMULATE, False)
    else:
        _finish(acc, acc_up, squares, n, n_ok, at, ok, pid_k, bias_ptr, out_ptr, K, eps, NORM,
                SWIGLU, GELU, BIAS, ACCUMULATE, SPLIT_K > 1)


@triton.jit
def _finish(acc, acc_up, squares, n, n_ok, at, ok, pid_k, bias_ptr, out_ptr, K, eps,
            NORM: tl.constexpr, SWIGLU: tl.constexpr, GELU: tl.constexpr, BIAS: tl.constexpr,
            ACCUMULATE: tl.constexpr, PART: tl.constexpr):
    """The rest of the fusions on split `pid_k`'s sums. PART: a part of K, only in a plain
    accumulating product: added with atomics, its bias with the first split."""
    if NORM:  # squares [BLOCK_M, 1]: whole, as the norm's rstd needs
        rstd = tl.rsqrt(squares / K + eps)
        acc *= rstd
        acc_up *= rstd
    if SWIGLU and GELU:
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)) * acc_up
    elif SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if BIAS:
        b = tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if PART:
            b = tl.where(pid_k == 0, b, 0.0)
        acc += b
    if ACCUMULATE and PART:
        tl.atomic_add(out_ptr + at, acc, mask=ok, sem="relaxed")
    else:
        if ACCUMULATE:
            acc += tl.load(out_ptr + at, mask=ok, other=0.0)
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=ok)


def default_config(w) -> GemvConfig:
    """The launch without a tuned one (the CPU's): 64 columns a program, K whole, BLOCK_K 64
    (int4: the group)."""
    return GemvConfig(64, w.group_size if isinstance(w, Int4Weight) else 64)


def _check(config: GemvConfig, w) -> None:
    if config.block_n < 16 or config.block_k < 16:
        raise ValueError(f"block_n {config.block_n} and block_k {config.block_k}: the tensor "
                         "cores take tiles of at least 16")
    if isinstance(w, Int4Weight) and config.block_k != w.group_size:
        raise ValueError(f"block_k {config.block_k}: the int4 rows product reads one group of "
                         f"{w.group_size} a tile")


def rows_product(x, w, out, *, config: GemvConfig | None = None, norm=None, eps: float = 0.0,
                 up=None, bias=None, accumulate: bool = False, act: str = "silu",
                 partials: SplitPartials | None = None) -> None:
    """out [m, N] = X W^T (or out += it) for x [m, K], m <= 16, with the GEMV's contract
    (floorline.engine.kernels.gemv.gemv) and W in any of the engine's formats. `config`
    (default_config(w) where None) is the launch: block_n, block_k, num_warps, num_stages and
    split_k (words is the int4 GEMV's alone); a K-split of a product that does not simply
    accumulate meets in `partials`."""
    n, k = w.shape
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or tuple(out.shape) != (m, n) or not 1 <= m <= BLOCK_M:
        raise ValueError(f"W is {n}x{k}: x must be [m, {k}] with m <= {BLOCK_M} and out "
                         f"[m, {n}], not {tuple(x.shape)} and {tuple(out.shape)}")
    if accumulate and out.dtype != torch.float32:
        raise ValueError("accumulate adds into fp32 residual rows")
    if up is not None and (bias is not None or type(up) is not type(w)):
        raise ValueError("SWIGLU takes no bias, and its gate and up matrices share a format")
    config = config or default_config(w)
    _check(config, w)
    reduce = config.split_k > 1 and not (accumulate and norm is None and up is None)
    if reduce and partials is None:
        raise ValueError("a K-split of a product that stores, normalises or gates needs "
                         "partials (SplitPartials) where its splits meet")
    u = w if up is None else up
    if isinstance(w, Int4Weight):
        fmt, group = 2, w.group_size
        mats = (w.qweight, u.qweight, w.scales, w.zeros, u.scales, u.zeros)
    elif isinstance(w, Fp8Weight):
        fmt, group = 1, 8
        mats = (w.weight, u.weight, w.scale, w.scale, u.scale, u.scale)
    else:
        fmt, group = 0, 8
        mats = (w, u, w, w, w, w)
    # the model's 16-bit dtype where any operand has it (the fp32 residual rows do not)
    dtype = next((t.dtype for t in (mats[0], x, out, norm)
                  if t is not None and t.dtype in (torch.bfloat16, torch.float16)), torch.float32)
    dot = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
           torch.float16: tl.float16}[dtype]
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    sums, counts = (partials.get(n, grid[0], out.device, rows=BLOCK_M) if reduce
                    else (out, out))  # unread without REDUCE
    # unread pointers stand in where there is no bias or norm: tensors, which the GPU's
    # compiler specialises (a quantised weight's object it cannot)
    _rows_kernel[grid](
        x, *mats, x if bias is None else bias, x if norm is None else norm, out, sums, counts,
        m, n, k, eps, NORM=norm is not None, SWIGLU=up is not None, GELU=act == "gelu_tanh",
        BIAS=bias is not None, ACCUMULATE=accumulate, REDUCE=reduce, FORMAT=fmt, GROUP=group,
        SPLIT=dtype != torch.float32, EMULATE=not x.is_cuda, DOT=dot, BLOCK_M=BLOCK_M,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
