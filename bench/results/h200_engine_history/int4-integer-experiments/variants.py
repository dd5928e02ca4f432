"""Scratch: the int4 GEMV's loop in variants, timed as the tuner times (graph, rotation copies).
MODE 0 full, 1 memory only (words xor-reduced), 2 compute only (every program reads row block
pid % 4: L1/L2 resident). PREFETCH: next iteration's words into registers before compute."""
import sys
import json
import torch
import triton
import triton.language as tl

from floorline.engine.kernels.gemv import (_load_x, _load_int4, _load_groups, _x_factors, _products, _group_sums,
                                           _epilogue, SplitPartials)
from floorline.engine.tuning import random_like, rotation_copies, time_graph
from floorline.engine.quant import Int4Weight, nbytes


@triton.jit
def _xraw(x_ptr, norm_ptr, x_at, W: tl.constexpr, NORM: tl.constexpr):
    x0 = tl.load(x_ptr + x_at)
    x1 = tl.load(x_ptr + x_at + W)
    x2 = tl.load(x_ptr + x_at + 2 * W)
    x3 = tl.load(x_ptr + x_at + 3 * W)
    x4 = tl.load(x_ptr + x_at + 4 * W)
    x5 = tl.load(x_ptr + x_at + 5 * W)
    x6 = tl.load(x_ptr + x_at + 6 * W)
    x7 = tl.load(x_ptr + x_at + 7 * W)
    if NORM:
        x0 = x0 * tl.load(norm_ptr + x_at).to(tl.float32)
        x1 = x1 * tl.load(norm_ptr + x_at + W).to(tl.float32)
        x2 = x2 * tl.load(norm_ptr + x_at + 2 * W).to(tl.float32)
        x3 = x3 * tl.load(norm_ptr + x_at + 3 * W).to(tl.float32)
        x4 = x4 * tl.load(norm_ptr + x_at + 4 * W).to(tl.float32)
        x5 = x5 * tl.load(norm_ptr + x_at + 5 * W).to(tl.float32)
        x6 = x6 * tl.load(norm_ptr + x_at + 6 * W).to(tl.float32)
        x7 = x7 * tl.load(norm_ptr + x_at + 7 * W).to(tl.float32)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _xfin(x0, x1, x2, x3, x4, x5, x6, x7, low_half):
    x0 = x0.to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    x3 = x3.to(tl.float32)
    x4 = x4.to(tl.float32)
    x5 = x5.to(tl.float32)
    x6 = x6.to(tl.float32)
    x7 = x7.to(tl.float32)
    big = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                                tl.maximum(tl.abs(x2), tl.abs(x3))),
                     tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                                tl.maximum(tl.abs(x6), tl.abs(x7))))
    e = tl.maximum(tl.expand_dims(tl.max(big, axis=3), 3).to(tl.int32, bitcast=True) & 0x7F800000,
                   27 << 23)
    scale = (((130 << 23) - e) + (130 << 23)).to(tl.float32, bitcast=True)
    unscale = (e - (6 << 23)).to(tl.float32, bitcast=True)
    f0 = tl.where(low_half, x0 * scale, x4 * scale).to(tl.float16)
    f1 = tl.where(low_half, x1 * scale, x5 * scale).to(tl.float16)
    f2 = tl.where(low_half, x2 * scale, x6 * scale).to(tl.float16)
    f3 = tl.where(low_half, x3 * scale, x7 * scale).to(tl.float16)
    x_sum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    return f0, f1, f2, f3, unscale, x_sum


@triton.jit
def _xint(x_ptr, norm_ptr, x_at, W: tl.constexpr, ok, squares, NORM: tl.constexpr,
          EVEN: tl.constexpr):
    x0, sq0 = _load_x(x_ptr, norm_ptr, x_at, ok, NORM, EVEN)
    x1, sq1 = _load_x(x_ptr, norm_ptr, x_at + W, ok, NORM, EVEN)
    x2, sq2 = _load_x(x_ptr, norm_ptr, x_at + 2 * W, ok, NORM, EVEN)
    x3, sq3 = _load_x(x_ptr, norm_ptr, x_at + 3 * W, ok, NORM, EVEN)
    x4, sq4 = _load_x(x_ptr, norm_ptr, x_at + 4 * W, ok, NORM, EVEN)
    x5, sq5 = _load_x(x_ptr, norm_ptr, x_at + 5 * W, ok, NORM, EVEN)
    x6, sq6 = _load_x(x_ptr, norm_ptr, x_at + 6 * W, ok, NORM, EVEN)
    x7, sq7 = _load_x(x_ptr, norm_ptr, x_at + 7 * W, ok, NORM, EVEN)
    if NORM:
        squares += ((sq0 + sq1) + (sq2 + sq3)) + ((sq4 + sq5) + (sq6 + sq7))
    big = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                                tl.maximum(tl.abs(x2), tl.abs(x3))),
                     tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                                tl.maximum(tl.abs(x6), tl.abs(x7))))
    e = tl.maximum(tl.expand_dims(tl.max(big, axis=3), 3).to(tl.int32, bitcast=True) & 0x7F800000,
                   27 << 23)
    # scale = 2^(13 - E), unscale = 2^(E - 13)
    scale = ((140 << 23) - e + (127 << 23)).to(tl.float32, bitcast=True)
    unscale = (e - (13 << 23)).to(tl.float32, bitcast=True)
    i0 = (x0 * scale + 12582912.0).to(tl.int32, bitcast=True)
    i1 = (x1 * scale + 12582912.0).to(tl.int32, bitcast=True)
    i2 = (x2 * scale + 12582912.0).to(tl.int32, bitcast=True)
    i3 = (x3 * scale + 12582912.0).to(tl.int32, bitcast=True)
    i4 = (x4 * scale + 12582912.0).to(tl.int32, bitcast=True)
    i5 = (x5 * scale + 12582912.0).to(tl.int32, bitcast=True)
    i6 = (x6 * scale + 12582912.0).to(tl.int32, bitcast=True)
    i7 = (x7 * scale + 12582912.0).to(tl.int32, bitcast=True)
    p02 = (i0 & 0xFFFF) | (i2 << 16)
    p46 = (i4 & 0xFFFF) | (i6 << 16)
    p13 = (i1 & 0xFFFF) | (i3 << 16)
    p57 = (i5 & 0xFFFF) | (i7 << 16)
    x_sum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    return p02, p46, p13, p57, unscale, x_sum, squares


@triton.jit
def _dots(words, p02, p46, p13, p57):
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 e, o, t;
        and.b32 e, $1, 0x0f0f0f0f;
        shr.u32 t, $1, 4;
        and.b32 o, t, 0x0f0f0f0f;
        dp2a.lo.s32.u32 $0, $2, e, 0;
        dp2a.hi.s32.u32 $0, $3, e, $0;
        dp2a.lo.s32.u32 $0, $4, o, $0;
        dp2a.hi.s32.u32 $0, $5, o, $0;
        }""",
        constraints="=r,r,r,r,r,r", args=[words, p02, p46, p13, p57], dtype=tl.int32,
        is_pure=True, pack=1)


@triton.jit
def _isums(d, unscale, s, z, x_sum, acc):
    dot = tl.sum(d, axis=3).to(tl.float32)  # [G, CH, RB, 4]
    s = tl.sum(s, axis=3)
    z = tl.sum(z, axis=3)
    return acc + s * (dot * tl.sum(unscale, axis=3) - z * tl.sum(x_sum, axis=3))


@triton.jit
def kern(x_ptr, w_ptr, s_ptr, z_ptr, up_ptr, up_s_ptr, up_z_ptr, bias_ptr, norm_ptr,
         out_ptr, part_ptr, count_ptr, N, K, K_WORDS, eps, ONE, NORM: tl.constexpr,
         SWIGLU: tl.constexpr, BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
         REDUCE: tl.constexpr, BLOCK_N: tl.constexpr,
         GROUPS: tl.constexpr, GROUP: tl.constexpr, WORDS: tl.constexpr,
         SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
         PDL: tl.constexpr, GELU: tl.constexpr, ASM: tl.constexpr, MODE: tl.constexpr,
         PREFETCH: tl.constexpr, STAGES: tl.constexpr, STRIDE: tl.constexpr):
    RB: tl.constexpr = BLOCK_N // 4
    W: tl.constexpr = GROUP // 8
    CH: tl.constexpr = W // WORDS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g_i = tl.arange(0, GROUPS)[:, None, None, None, None]
    if STRIDE:
        position = (tl.arange(0, CH)[None, :, None, None, None]
                    + tl.arange(0, WORDS)[None, None, None, :, None] * CH)
    else:
        position = (tl.arange(0, CH)[None, :, None, None, None] * WORDS
                    + tl.arange(0, WORDS)[None, None, None, :, None])
    if MODE == 2:
        blocks = (pid_n % 4) * RB + tl.arange(0, RB)[None, None, :, None, None]
    else:
        blocks = pid_n * RB + tl.arange(0, RB)[None, None, :, None, None]
    half = tl.arange(0, 8)[None, None, None, None, :]
    r = tl.arange(0, 4)[None, None, None, None, :]
    r4 = r
    block_ok = blocks < N // 4
    n_groups = K // GROUP
    span = tl.cdiv(tl.cdiv(n_groups, SPLIT_K), GROUPS) * GROUPS
    g_lo = pid_k * span
    g_hi = tl.minimum(g_lo + span, n_groups)
    words_base = blocks.to(tl.int64) * (K_WORDS * 8) + position * 8 + half
    if MODE == 4:
        meta_base = (blocks.to(tl.int64) * (n_groups * 4) + r
                     + tl.arange(0, CH)[None, :, None, None, None] * 0)
    else:
        meta_base = blocks.to(tl.int64) * (n_groups * 4) + r
    w16 = w_ptr.to(tl.pointer_type(tl.int16))
    up16 = up_ptr.to(tl.pointer_type(tl.int16))
    low_half = (half & 1) == 0
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((GROUPS, CH, RB, 4), tl.float32)
    acc_up = tl.zeros((GROUPS, CH, RB, 4), tl.float32)
    xacc = tl.zeros((GROUPS, CH, RB), tl.int32)
    squares = tl.zeros((GROUPS, CH, 1, WORDS, 1), tl.float32)
    words, s, z, words_up, s_up, z_up = _load_groups(
        w16, s_ptr, z_ptr, up16, up_s_ptr, up_z_ptr, words_base, meta_base, g_lo + g_i, g_hi,
        block_ok, W, SWIGLU, EVEN)
    r0, r1, r2, r3, r4, r5, r6, r7 = _xraw(x_ptr, norm_ptr, (g_lo + g_i) * GROUP + position, W,
                                           NORM)
    if MODE == 5:
        w32base = blocks.to(tl.int64) * (K_WORDS * 4) + position * 4 + r
        for g0 in tl.range(g_lo, g_hi, GROUPS, num_stages=STAGES):
            groups = g0 + g_i
            g_ok = groups < g_hi
            w_at = w32base + groups * (W * 4)
            m_at = meta_base + groups * 4
            iw, s, z = _load_int4(w_ptr, s_ptr, z_ptr, w_at, m_at, g_ok, EVEN)
            x_at = groups * GROUP + position
            p02, p46, p13, p57, unscale, x_sum, squares = _xint(x_ptr, norm_ptr, x_at, W, g_ok,
                                                                squares, NORM, EVEN)
            acc = _isums(_dots(iw, p02, p46, p13, p57), unscale, s, z, x_sum, acc)
            if SWIGLU:
                iu, su, zu = _load_int4(up_ptr, up_s_ptr, up_z_ptr, w_at, m_at, g_ok, EVEN)
                acc_up = _isums(_dots(iu, p02, p46, p13, p57), unscale, su, zu, x_sum, acc_up)
    g_end = g_hi
    if MODE == 5:
        g_end = g_lo
    for g0 in tl.range(g_lo, g_end, GROUPS, num_stages=STAGES):
        groups = g0 + g_i
        g_ok = groups < g_hi
        if PREFETCH:
            ahead = tl.minimum(g0 + GROUPS, g_hi - GROUPS)
        else:
            ahead = g0
        nxt = _load_groups(w16, s_ptr, z_ptr, up16, up_s_ptr, up_z_ptr, words_base, meta_base,
                           ahead + g_i, g_hi, block_ok, W, SWIGLU, EVEN)
        if not PREFETCH:
            words, s, z, words_up, s_up, z_up = nxt
        if PREFETCH == 2:
            n0, n1, n2, n3, n4, n5, n6, n7 = _xraw(x_ptr, norm_ptr, (ahead + g_i) * GROUP
                                                   + position, W, NORM)
            x0, x1, x2, x3, unscale, x_sum = _xfin(r0, r1, r2, r3, r4, r5, r6, r7, low_half)
            d = _products(words, x0, x1, x2, x3, ASM)
            acc = _group_sums(d, unscale, s, z, x_sum, acc)
            if SWIGLU:
                d = _products(words_up, x0, x1, x2, x3, ASM)
                acc_up = _group_sums(d, unscale, s_up, z_up, x_sum, acc_up)
            r0, r1, r2, r3, r4, r5, r6, r7 = n0, n1, n2, n3, n4, n5, n6, n7
        elif MODE == 1:
            v = (words ^ words_up).to(tl.int32)
            xacc ^= tl.xor_sum(tl.xor_sum(v, axis=4), axis=3)
            acc += tl.sum(s * z + s_up * z_up, axis=3)
        else:
            if MODE == 3:
                x_at = groups * GROUP + position * ONE
            else:
                x_at = groups * GROUP + position
            x0, x1, x2, x3, unscale, x_sum, squares = _x_factors(
                x_ptr, norm_ptr, x_at, W, g_ok, low_half, squares, NORM, EVEN)
            d = _products(words, x0, x1, x2, x3, ASM)
            acc = _group_sums(d, unscale, s, z, x_sum, acc)
            if SWIGLU:
                d = _products(words_up, x0, x1, x2, x3, ASM)
                acc_up = _group_sums(d, unscale, s_up, z_up, x_sum, acc_up)
        words, s, z, words_up, s_up, z_up = nxt
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 1:
        acc += tl.sum(xacc.to(tl.float32), axis=1)[:, None, :, None]
    y = tl.reshape(tl.sum(tl.sum(acc, axis=1), axis=0), (BLOCK_N,))
    y_up = tl.reshape(tl.sum(tl.sum(acc_up, axis=1), axis=0), (BLOCK_N,))
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(y, y_up, tl.sum(squares), rows, rows < N, pid_n, pid_k, bias_ptr, out_ptr,
              part_ptr, count_ptr, N, K, eps, NORM, SWIGLU, BIAS, ACCUMULATE, GELU, REDUCE,
              SPLIT_K)


def launch(x, w, u, out, norm, partials, bn, groups, warps, words, split, mode, prefetch,
           stages, maxnreg, accumulate, stride=0):
    n, k = w.shape
    reduce = split > 1 and not (accumulate and norm is None and u is None)
    grid = (triton.cdiv(n, bn), split)
    sums, counts = partials.get(n, grid[0], out.device) if reduce else (out, out)
    uu = w if u is None else u
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    kern[grid](x, w.qweight, w.scales, w.zeros, uu.qweight, uu.scales, uu.zeros, w.scales,
               w.scales if norm is None else norm, out, sums, counts, n, k, k // 8, 1e-6, 1,
               NORM=norm is not None, SWIGLU=u is not None, BIAS=False, ACCUMULATE=accumulate,
               REDUCE=reduce, BLOCK_N=bn, GROUPS=groups, GROUP=128, WORDS=words, SPLIT_K=split,
               EVEN=True, PDL=True, GELU=False, ASM=True, MODE=mode, PREFETCH=prefetch,
               STAGES=stages, STRIDE=stride, num_warps=warps, num_stages=stages, launch_pdl=True, **extra)
    return kern


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
        x = torch.randn(k, device=dev, dtype=torch.bfloat16)
        norm = None
        out = torch.zeros(n, device=dev, dtype=torch.float32)
    else:
        x = torch.randn(k, device=dev, dtype=torch.float32)
        norm = torch.randn(k, device=dev, dtype=torch.bfloat16)
        out = torch.zeros(n, device=dev, dtype=torch.bfloat16)
    partials = SplitPartials()
    rows = []
    from floorline.engine.kernels.gemv import gemv_reference
    m0, u0 = mats[0]
    xs = x * 50 if not accumulate else x
    ref = torch.zeros(n, device=dev, dtype=torch.float32)
    gemv_reference(xs, m0, ref, norm=norm, eps=1e-6, up=u0, accumulate=accumulate)
    for mode in (0, 5):
      for st in (0, 1):
        o = torch.zeros_like(out)
        launch(xs, m0, u0, o, norm, partials, 8, 4, 1, 2, 1 if not accumulate else 7, mode, 0,
               1, None, accumulate, st)
        err = ((o.float() - ref).norm() / ref.norm()).item()
        print(json.dumps(dict(shape=name, check_mode=mode, stride=st, rel_err=err)), flush=True)
    for cfg in configs:
        bn, groups, warps, words, split, mode, prefetch, stages, maxnreg, stride = (*cfg, 0)[:10] if len(cfg) == 9 else cfg
        try:
            def run():
                for m, u in mats:
                    launch(x, m, u, out, norm, partials, bn, groups, warps, words, split,
                           mode, prefetch, stages, maxnreg, accumulate, stride)
            us = time_graph(run) / copies
            us2 = time_graph(run) / copies
            us = min(us, us2)
            err = ""
        except Exception as e:  # noqa: BLE001
            us, err = float("nan"), str(e).splitlines()[0][:80]
        regs = ""
        try:
            ks = kern.device_caches[0][0] if hasattr(kern, "device_caches") else {}
        except Exception:
            ks = {}
        row = dict(shape=name, cfg=cfg, us=round(us, 2), gbps=round(b / us / 1e3, 1), err=err)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    out = []
    gu = [(8, 4, 1, 2, 1, 0, 0, 1, None, 0)]
    for t in ((8, 4, 1, 2), (8, 4, 1, 4), (16, 4, 1, 2), (8, 8, 1, 4), (8, 8, 2, 2), (16, 8, 2, 2)):
        for st in (1, 2, 3):
            gu.append((*t, 1, 5, 0, st, None, 0))
    dn = [(16, 4, 1, 2, 7, 0, 0, 1, None, 0)]
    for t in ((8, 4, 1, 2), (16, 4, 1, 2), (8, 4, 1, 4)):
        for st in (1, 2, 3):
            for sp in (4, 7):
                dn.append((*t, sp, 5, 0, st, None, 0))
    out += shape_run("qwen gate/up", 18944, 3584, True, False, gu)
    out += shape_run("llama gate/up", 14336, 4096, True, False, gu)
    out += shape_run("qwen down", 3584, 18944, False, True, dn)
    out += shape_run("llama down", 4096, 14336, False, True, dn)
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
