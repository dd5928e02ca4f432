"""Scratch: int4 GEMV with its first tile's weights read before the PDL wait (PEEL)."""
import sys, json
import torch, triton
import triton.language as tl
sys.path.insert(0, ".devrun")
from int4_variants import _xint, _dots, _isums
from floorline.engine.kernels.gemv import (_load_int4, _load_groups, _x_factors, _products,
                                           _group_sums, _epilogue, SplitPartials, gemv_reference)
from floorline.engine.tuning import random_like, rotation_copies, time_graph
from floorline.engine.quant import Int4Weight, nbytes


@triton.jit
def _tile(x_ptr, norm_ptr, groups, g_ok, position, low_half, squares, words, s, z, words_up,
          s_up, z_up, acc, acc_up, W: tl.constexpr, GROUP: tl.constexpr, NORM: tl.constexpr,
          SWIGLU: tl.constexpr, EVEN: tl.constexpr, INT: tl.constexpr):
    x_at = groups * GROUP + position
    if INT:
        p02, p46, p13, p57, unscale, x_sum, squares = _xint(x_ptr, norm_ptr, x_at, W, g_ok,
                                                            squares, NORM, EVEN)
        acc = _isums(_dots(words, p02, p46, p13, p57), unscale, s, z, x_sum, acc)
        if SWIGLU:
            acc_up = _isums(_dots(words_up, p02, p46, p13, p57), unscale, s_up, z_up, x_sum,
                            acc_up)
    else:
        x0, x1, x2, x3, unscale, x_sum, squares = _x_factors(
            x_ptr, norm_ptr, x_at, W, g_ok, low_half, squares, NORM, EVEN)
        acc = _group_sums(_products(words, x0, x1, x2, x3, True), unscale, s, z, x_sum, acc)
        if SWIGLU:
            acc_up = _group_sums(_products(words_up, x0, x1, x2, x3, True), unscale, s_up,
                                 z_up, x_sum, acc_up)
    return acc, acc_up, squares


@triton.jit
def kern(x_ptr, w_ptr, s_ptr, z_ptr, up_ptr, up_s_ptr, up_z_ptr, bias_ptr, norm_ptr,
         out_ptr, part_ptr, count_ptr, N, K, K_WORDS, eps, NORM: tl.constexpr,
         SWIGLU: tl.constexpr, BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
         REDUCE: tl.constexpr, BLOCK_N: tl.constexpr,
         GROUPS: tl.constexpr, GROUP: tl.constexpr, WORDS: tl.constexpr,
         SPLIT_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, GELU: tl.constexpr,
         INT: tl.constexpr, PEEL: tl.constexpr):
    RB: tl.constexpr = BLOCK_N // 4
    W: tl.constexpr = GROUP // 8
    CH: tl.constexpr = W // WORDS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g_i = tl.arange(0, GROUPS)[:, None, None, None, None]
    position = (tl.arange(0, CH)[None, :, None, None, None] * WORDS
                + tl.arange(0, WORDS)[None, None, None, :, None])
    blocks = pid_n * RB + tl.arange(0, RB)[None, None, :, None, None]
    half = tl.arange(0, 8)[None, None, None, None, :]
    r = tl.arange(0, 4)[None, None, None, None, :]
    block_ok = blocks < N // 4
    n_groups = K // GROUP
    span = tl.cdiv(tl.cdiv(n_groups, SPLIT_K), GROUPS) * GROUPS
    g_lo = pid_k * span
    g_hi = tl.minimum(g_lo + span, n_groups)
    meta_base = blocks.to(tl.int64) * (n_groups * 4) + r
    low_half = (half & 1) == 0
    acc = tl.zeros((GROUPS, CH, RB, 4), tl.float32)
    acc_up = tl.zeros((GROUPS, CH, RB, 4), tl.float32)
    squares = tl.zeros((GROUPS, CH, 1, WORDS, 1), tl.float32)
    if INT:
        wb = blocks.to(tl.int64) * (K_WORDS * 4) + position * 4 + r
        wp = w_ptr
        up = up_ptr
        STEP: tl.constexpr = W * 4
    else:
        wb = blocks.to(tl.int64) * (K_WORDS * 8) + position * 8 + half
        wp = w_ptr.to(tl.pointer_type(tl.int16))
        up = up_ptr.to(tl.pointer_type(tl.int16))
        STEP: tl.constexpr = W * 8
    g_start = g_lo
    if PEEL:
        groups = g_lo + g_i
        g_ok = groups < g_hi
        w_at = wb + groups * STEP
        m_at = meta_base + groups * 4
        words, s, z = _load_int4(wp, s_ptr, z_ptr, w_at, m_at, g_ok & block_ok, EVEN)
        words_up, s_up, z_up = words, s, z
        if SWIGLU:
            words_up, s_up, z_up = _load_int4(up, up_s_ptr, up_z_ptr, w_at, m_at,
                                              g_ok & block_ok, EVEN)
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc, acc_up, squares = _tile(x_ptr, norm_ptr, groups, g_ok, position, low_half, squares,
                                     words, s, z, words_up, s_up, z_up, acc, acc_up, W, GROUP,
                                     NORM, SWIGLU, EVEN, INT)
        g_start = g_lo + GROUPS
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
    for g0 in range(g_start, g_hi, GROUPS):
        groups = g0 + g_i
        g_ok = groups < g_hi
        w_at = wb + groups * STEP
        m_at = meta_base + groups * 4
        words, s, z = _load_int4(wp, s_ptr, z_ptr, w_at, m_at, g_ok & block_ok, EVEN)
        words_up, s_up, z_up = words, s, z
        if SWIGLU:
            words_up, s_up, z_up = _load_int4(up, up_s_ptr, up_z_ptr, w_at, m_at,
                                              g_ok & block_ok, EVEN)
        acc, acc_up, squares = _tile(x_ptr, norm_ptr, groups, g_ok, position, low_half, squares,
                                     words, s, z, words_up, s_up, z_up, acc, acc_up, W, GROUP,
                                     NORM, SWIGLU, EVEN, INT)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.reshape(tl.sum(tl.sum(acc, axis=1), axis=0), (BLOCK_N,))
    y_up = tl.reshape(tl.sum(tl.sum(acc_up, axis=1), axis=0), (BLOCK_N,))
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(y, y_up, tl.sum(squares), rows, rows < N, pid_n, pid_k, bias_ptr, out_ptr,
              part_ptr, count_ptr, N, K, eps, NORM, SWIGLU, BIAS, ACCUMULATE, GELU, REDUCE,
              SPLIT_K)


def launch(x, w, u, out, norm, partials, cfg, accumulate, maxnreg=None):
    bn, groups, warps, words, split, integer, peel = cfg
    n, k = w.shape
    reduce = split > 1 and not (accumulate and norm is None and u is None)
    grid = (triton.cdiv(n, bn), split)
    sums, counts = partials.get(n, grid[0], out.device) if reduce else (out, out)
    uu = w if u is None else u
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    kern[grid](x, w.qweight, w.scales, w.zeros, uu.qweight, uu.scales, uu.zeros, w.scales,
               w.scales if norm is None else norm, out, sums, counts, n, k, k // 8, 1e-6,
               NORM=norm is not None, SWIGLU=u is not None, BIAS=False, ACCUMULATE=accumulate,
               REDUCE=reduce, BLOCK_N=bn, GROUPS=groups, GROUP=128, WORDS=words, SPLIT_K=split,
               EVEN=True, PDL=True, GELU=False, INT=bool(integer), PEEL=bool(peel),
               num_warps=warps, num_stages=1, launch_pdl=True, **extra)


def shape_run(name, n, k, up, accumulate, configs):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    proto = Int4Weight(torch.zeros(n // 4, k // 8 * 4, dtype=torch.int32, device=dev),
                       torch.zeros(n // 4, k // 128 * 4, dtype=torch.float16, device=dev),
                       torch.zeros(n // 4, k // 128 * 4, dtype=torch.uint8, device=dev), 128)
    b = nbytes(proto) * (2 if up else 1)
    copies = rotation_copies(b, dev)
    mats = [(random_like(proto, gen), random_like(proto, gen) if up else None)
            for _ in range(copies)]
    if accumulate:
        x = torch.randn(k, device=dev, dtype=torch.bfloat16); norm = None
        out = torch.zeros(n, device=dev, dtype=torch.float32)
    else:
        x = torch.randn(k, device=dev, dtype=torch.float32)
        norm = torch.randn(k, device=dev, dtype=torch.bfloat16)
        out = torch.zeros(n, device=dev, dtype=torch.bfloat16)
    partials = SplitPartials()
    m0, u0 = mats[0]
    ref = torch.zeros(n, device=dev, dtype=torch.float32)
    gemv_reference(x, m0, ref, norm=norm, eps=1e-6, up=u0, accumulate=accumulate)
    rows = []
    for cfg in configs:
        mx = None
        if len(cfg) == 8:
            mx = cfg[7]; cfg = cfg[:7]
        try:
            o = torch.zeros_like(out)
            launch(x, m0, u0, o, norm, partials, cfg, accumulate, mx)
            err = ((o.float() - ref).norm() / ref.norm()).item()
            def run():
                for m, u in mats:
                    launch(x, m, u, out, norm, partials, cfg, accumulate, mx)
            us = min(time_graph(run), time_graph(run)) / copies
            e = ""
        except Exception as ex:  # noqa: BLE001
            us, err, e = float("nan"), float("nan"), str(ex).splitlines()[0][:100]
        row = dict(shape=name, cfg=list(cfg), maxnreg=mx, us=round(us, 2),
                   gbps=round(b / us / 1e3, 1), rel_err=err, err=e)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    out = []
    gu = []
    for integer in (0, 1):
        for peel in (0, 1):
            for t in ((8, 4, 1, 2, 1), (8, 4, 1, 4, 1), (16, 4, 1, 2, 1)):
                gu.append((*t, integer, peel))
    gu += [(8, 4, 1, 2, 1, 1, 0, 112), (8, 4, 1, 2, 1, 1, 1, 112), (8, 4, 1, 2, 1, 1, 1, 104)]
    dn = []
    for integer in (0, 1):
        for peel in (0, 1):
            for t in ((8, 4, 1, 2, 7), (16, 4, 1, 2, 7), (16, 4, 1, 2, 4), (8, 4, 1, 2, 4)):
                dn.append((*t, integer, peel))
    sm = []
    for integer in (0, 1):
        for peel in (0, 1):
            for t in ((16, 4, 1, 2, 7), (16, 4, 1, 2, 4), (8, 4, 1, 2, 7)):
                sm.append((*t, integer, peel))
    out += shape_run("qwen gate/up", 18944, 3584, True, False, gu)
    out += shape_run("llama gate/up", 14336, 4096, True, False, gu)
    out += shape_run("qwen down", 3584, 18944, False, True, dn)
    out += shape_run("llama down", 4096, 14336, False, True, dn)
    out += shape_run("qwen qkv", 4608, 3584, False, False, sm)
    out += shape_run("qwen o", 3584, 3584, False, True, sm)
    out += shape_run("llama qkv", 6144, 4096, False, False, sm)
    out += shape_run("llama o", 4096, 4096, False, True, sm)
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
