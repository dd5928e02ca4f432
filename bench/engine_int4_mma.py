"""A prototype int4 GEMV written in CUDA on the tensor cores' 8-bit integer products
(engine_int4_mma.cu, beside this script), against the engine's int4 kernel (integer dot products
on the CUDA cores, floorline.engine.kernels.gemv). Not part of the engine: it computes the plain
product out += W x (x bf16, out fp32, groups of 128), which is what the engine's o and down
products do before their fusions; it enters the engine only if it wins here.

    python bench/engine_int4_mma.py --sass [--json out.json]     # nvcc, no GPU needed
    python bench/engine_int4_mma.py --model qwen2.5-7b [--json out.json]   # a CUDA GPU

--sass compiles the kernel for Hopper (sm_90) with nvcc and counts the instructions of its two
loops: the inner one (a group: 16 words a row; a lane's 4 slices x 4 rows x 8 weights per set of
rows) and the tile's (x turned into the tensor cores' operand and the sums scaled, once per 8
groups), and so the instructions a weight over a whole tile; the engine's kernel spends 1.5-2.3
(bench/engine_int4_sass.py).

On a GPU it builds the kernel with nvcc for the GPU's architecture, checks every
launch against the dequantised product on the model's int4 shapes (q/k/v, o, gate, down), and
times both kernels' launches the way the engine's tuner does (CUDA graphs, copies of the weights
past L2), each at its fastest launch. A launch that cannot build or errs by more than
MAX_ERROR is an invalid cell with its reason.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCE = HERE / "engine_int4_mma.cu"
# (sets of 32 rows a warp, warps a block, the next group's weights loaded ahead): the kernel's
# instances (its launch function)
LAUNCHES = [(1, 2, 0), (1, 4, 0), (2, 2, 0), (2, 4, 0), (2, 8, 0), (1, 4, 1), (2, 4, 1)]
SPLITS = [1, 2, 4, 8, 16]
MAX_ERROR = 1e-3  # relative, against the dequantised product; the engine's kernel errs ~1e-5


def build(arch: str, into: Path) -> Path:
    """The kernel and its launch compiled by nvcc into a shared library for `arch` (sm_90)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH")
    library = into / f"int4_mma_{arch}.so"
    proc = subprocess.run([nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", f"-arch={arch}",
                           "-o", str(library), str(SOURCE)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed: {proc.stderr.strip()[-300:]}")
    return library


class Int4Mma:
    """The built kernel: call(x, w, out, sets, warps, ahead, splits) adds W x into out."""

    def __init__(self, library: Path):
        self.lib = ctypes.CDLL(str(library))
        self.launch = self.lib.floorline_int4_mma_launch
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_void_p]

    def __call__(self, x, w, out, sets: int, warps: int, ahead: int, splits: int) -> None:
        n, k = w.shape
        tensors = (x, w.qweight, w.scales, w.zeros, out)
        if (n % (32 * sets * warps) or (sets, warps, ahead) not in LAUNCHES or splits < 1
                or w.group_size != 128 or k < 128 or w.scales.shape[1] != k // 128 * 4
                or (x.dtype, w.qweight.dtype, w.scales.dtype, w.zeros.dtype, out.dtype)
                != (torch.bfloat16, torch.int32, torch.float16, torch.uint8, torch.float32)
                or x.numel() != k or out.numel() != n
                or not all(t.is_cuda and t.is_contiguous() for t in tensors)
                or x.data_ptr() % 16 or w.qweight.data_ptr() % 16):
            raise ValueError(f"int4_mma: {n}x{k} in groups of {w.group_size}, x {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}, out {out.dtype} "
                             f"{tuple(out.shape)}, {sets} sets of {warps} warps (ahead "
                             f"{ahead}), {splits} splits: not a launch the kernel has")
        status = self.launch(x.data_ptr(), w.qweight.data_ptr(), w.scales.data_ptr(),
                             w.zeros.data_ptr(), out.data_ptr(), n, k, sets, warps, ahead, splits,
                             torch.cuda.current_stream().cuda_stream)
        if status:
            raise RuntimeError(f"int4_mma: launch failed ({status}) for {sets} sets, {warps} "
                               f"warps, ahead {ahead}")


def emulate(x: torch.Tensor, w, sets: int = 2, warps: int = 4, splits: int = 1) -> torch.Tensor:
    """The kernel's arithmetic, lane by lane, in Python on any machine: the same registers,
    bytes and shared-memory offsets as engine_int4_mma.cu, and the tensor cores' m16n8k32
    product by the PTX ISA's fragment layouts (lane = 4 gid + tid; A's register r: row
    gid + 8 (r % 2), k = 16 (r // 2) + 4 tid + byte; B's register r: column gid,
    k = 16 r + 4 tid + byte; C's register r: row gid + 8 (r // 2), column 2 tid + r % 2). What
    no CPU can check is the compiler and the hardware; this checks that the kernel's indexing
    computes W x."""
    n, k = w.shape
    n_groups, rows = k // 128, 32 * sets * warps
    if n % rows or k % 128 or w.group_size != 128 or (sets, warps, 0) not in LAUNCHES:
        raise ValueError(f"{n}x{k} in groups of {w.group_size}, {sets} sets, {warps} warps: "
                         f"rows a multiple of {rows}, groups of 128, a launch of {LAUNCHES}")
    words = w.qweight.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [N / 4, K / 8 * 4]
    scales, zeros = w.scales.float(), w.zeros.to(torch.int64)
    xf = x.float()
    out = torch.zeros(n, dtype=torch.float64)
    values, lanes_per_group = 1024 // (warps * 32), 128 // (1024 // (warps * 32))
    per_split = -(-n_groups // splits)

    def byte(v, b):
        return (v >> (8 * b)) & 0xFF

    def signed(b):
        return b - 256 if b >= 128 else b

    for block in range(n // rows):
        for split in range(-(-n_groups // per_split)):
            g_lo = split * per_split
            g_hi = min(g_lo + per_split, n_groups)
            acc = {}  # (warp, lane, set, r, e) -> float
            for t0 in range(g_lo, g_hi, 8):
                tile = min(8, g_hi - t0)
                # prepare_x: the block's threads fill A's bytes, group sums and unscales
                sa = [[0] * (80 * 4) for _ in range(8)]
                i_sum, unscale = [0] * 8, [0.0] * 8
                for gg in range(tile):
                    v = xf[(t0 + gg) * 128:(t0 + gg + 1) * 128]
                    big = float(v.abs().max())
                    e = max(int(torch.tensor(big).view(torch.int32)) & 0x7F800000, 27 << 23)
                    scale = float(torch.tensor((267 << 23) - e, dtype=torch.int32).view(
                        torch.float32))
                    unscale[gg] = float(torch.tensor(e - (13 << 23), dtype=torch.int32).view(
                        torch.float32))
                    for t in range(gg * lanes_per_group, (gg + 1) * lanes_per_group):
                        first = (t % lanes_per_group) * values
                        j = first // 16
                        for i in range(values):
                            q = min(int(torch.round(v[first + i] * scale)), 16383)
                            i_sum[gg] += q
                            pos = (first + i) % 16
                            at = ((pos // 4) * 4 + pos % 4) * 16 + (j & 1) * 2 * 4 + j // 2
                            sa[gg][at] = (q >> 7) & 0xFF
                            sa[gg][at + 4] = q & 127
                for warp in range(warps):
                    b_warp = (block * warps + warp) * 8 * sets
                    c = {}  # (lane, set, r) -> [4 ints]
                    for gg in range(tile):
                        for s in range(4):
                            p = (t0 + gg) * 16 + 4 * s
                            for st in range(sets):
                                for r in range(4):
                                    a_reg = {}  # (lane, register) -> four int8
                                    b_reg = {}
                                    for lane in range(32):
                                        gid, tid = lane >> 2, lane & 3
                                        base = (s * 4 + tid) * 16
                                        a_reg[lane] = [[signed(sa[gid][base + 4 * q + bb])
                                                        if gid == gg else 0
                                                        for bb in range(4)] for q in range(4)]
                                        word = int(words[b_warp + 8 * st + gid,
                                                         (p + tid) * 4 + r])
                                        lo, hi = word & 0x0F0F0F0F, (word >> 4) & 0x0F0F0F0F
                                        b_reg[lane] = [[byte(lo, bb) for bb in range(4)],
                                                       [byte(hi, bb) for bb in range(4)]]
                                    for lane in range(32):  # D = A B, C's fragment of lane
                                        gid, tid = lane >> 2, lane & 3
                                        regs = c.setdefault((lane, st, r), [0, 0, 0, 0])
                                        for ci in range(4):
                                            row, col = gid + 8 * (ci // 2), 2 * tid + ci % 2
                                            total = 0
                                            for kk in range(32):
                                                half, kt, bb = kk // 16, kk % 16 // 4, kk % 4
                                                a = a_reg[4 * (row % 8) + kt]
                                                b = b_reg[4 * col + kt]
                                                total += a[2 * half + row // 8][bb] * b[half][bb]
                                            regs[ci] += total
                    for lane in range(32):
                        gid, tid = lane >> 2, lane & 3
                        if gid >= tile:
                            continue
                        g = t0 + gid
                        for st in range(sets):
                            for e in range(2):
                                bb_ = b_warp + 8 * st + 2 * tid + e
                                for r in range(4):
                                    regs = c[(lane, st, r)]
                                    exact = (regs[e] * 128 + regs[2 + e]
                                             - int(zeros[bb_, 4 * g + r]) * i_sum[gid])
                                    key = (warp, lane, st, r, e)
                                    acc[key] = acc.get(key, 0.0) + (
                                        float(scales[bb_, 4 * g + r]) * unscale[gid] * exact)
            for (warp, lane, st, r, e), v in acc.items():  # the shuffles' sum over gid
                b_warp = (block * warps + warp) * 8 * sets
                out[4 * (b_warp + 8 * st + 2 * (lane & 3) + e) + r] += v
    return out.float()


def compiled(library: Path) -> list[dict]:
    """Per launch of a library built for sm_90: registers, spills, shared memory and its two
    loops' instructions (cuobjdump reads the device code inside it)."""
    from engine_int4_sass import cuobjdump, loops, opcode  # beside this script

    binary = library.read_bytes()
    usage = cuobjdump(binary, "-res-usage")
    code = cuobjdump(binary, "-sass")
    rows = []
    for s, w, ahead in LAUNCHES:
        name = f"int4_mma_gemvILi{s}ELi{w}ELi{ahead}E"
        function = next(f for f in re.split(r"\n\s*Function : ", code) if f.startswith("_Z")
                        and name in f.split("\n")[0])
        facts = next(line for line in usage.split("Function ")[1:] if name in line)
        registers, stack, shared = (int(re.search(rf"{k}:(\d+)", facts).group(1))
                                    for k in ("REG", "STACK", "SHARED"))
        inner, tile = sorted(loops(function), key=len)[:2]  # the group's loop inside the tile's
        weights = s * 4 * 4 * 8  # a lane's weights a group: sets x slices x rows x nibbles
        weights *= 2 if ahead else 1  # ahead: two groups a turn of the loop
        per_tile = len(tile) - len(inner) + 8 * len(inner) * s * 4 * 4 * 8 // weights
        rows.append(dict(sets=s, warps=w, ahead=ahead, registers=registers, spilled_bytes=stack,
                         shared_bytes=shared, group_loop=len(inner),
                         tile_overhead=len(tile) - len(inner),
                         per_weight_group=len(inner) / weights,
                         per_weight_tile=per_tile / (8 * s * 4 * 4 * 8),
                         group_top=collections.Counter(opcode(t) for t in inner).most_common(8)))
    return rows


def sass(json_path: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows = compiled(build("sm_90", Path(tmp)))
        except RuntimeError as e:
            raise SystemExit(f"--sass: {e}") from None
    print(f"{'sets':>4} {'warps':>5} {'ahead':>5} {'regs':>4} {'spill':>5} {'shared':>6} "
          f"{'group loop':>10} {'tile':>5} {'per weight':>10}  the group loop's most frequent")
    for r in rows:
        print(f"{r['sets']:4} {r['warps']:5} {r['ahead']:5} {r['registers']:4} "
              f"{r['spilled_bytes']:5} {r['shared_bytes']:6} {r['group_loop']:10} "
              f"{r['tile_overhead']:5} "
              f"{r['per_weight_tile']:10.2f}  "
              + ", ".join(f"{k} {v}" for k, v in r["group_top"]))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))


def shapes(model: str) -> list[tuple[str, int, int]]:
    from floorline.engine.model import DecoderConfig
    from floorline.models import resolve_model

    c = DecoderConfig.from_hf(resolve_model(model).config)
    return [("qkv", c.qkv_rows, c.hidden), ("o", c.hidden, c.heads * c.head_dim),
            ("gate", c.intermediate, c.hidden), ("down", c.hidden, c.intermediate)]


def timed(launch, mats, n, want) -> tuple[float, float]:
    """A launch (weight, out) checked on the first weight against `want`, then its
    microseconds a product over all of `mats` replayed from a CUDA graph."""
    from floorline.engine.check import relative_error
    from floorline.engine.tuning import time_graph

    got = torch.zeros(n, device="cuda")
    launch(mats[0], got)
    error = relative_error(got, want)
    out = torch.zeros(n, device="cuda")
    return time_graph(lambda: [launch(m, out) for m in mats]) / len(mats), error


def compare(model: str) -> list[dict]:
    """Both kernels on each shape: the fastest launch of each, its error and its time."""
    from triton.runtime.errors import OutOfResources

    from floorline.engine.kernels.gemv import gemv
    from floorline.engine.quant import nbytes, quantise
    from floorline.engine.tuning import candidates, random_like
    from floorline.timing import rotation_copies

    major, minor = torch.cuda.get_device_capability()
    try:
        ext, built = Int4Mma(build(f"sm_{major}{minor}", Path(tempfile.mkdtemp()))), None
    except (RuntimeError, OSError) as e:  # no nvcc, a compiler error: invalid cells
        ext, built = None, f"the CUDA kernel did not build: {e}"
    rows = []
    for name, n, k in shapes(model):
        w = quantise(torch.empty(n, k, device="cuda").normal_(0, 0.02).to(torch.bfloat16),
                     "int4")
        mats = [w] + [random_like(w, None) for _ in range(rotation_copies(nbytes(w), "cuda") - 1)]
        x = torch.empty(k, device="cuda").normal_(0, 1).to(torch.bfloat16)
        want = w.dequantise() @ x.float()
        engine = []
        for config in candidates(k, 128):
            def launch(m, o, config=config, x=x):
                gemv(x, m, o, config=config, accumulate=True)
            try:
                engine.append((*timed(launch, mats, n, want), dataclasses.asdict(config)))
            except OutOfResources:  # as the tuner does: a launch this GPU cannot hold
                continue
        mma, invalid = [], []
        groups = k // 128
        # each number of splits asked, and the splits the launch makes of the groups (8 asked
        # of 28: 7 of 4 groups each), once each
        made = {-(-groups // -(-groups // p)): p for p in reversed(SPLITS)}
        for sets, warps, ahead in LAUNCHES:
            for splits, asked in sorted(made.items()):
                what = dict(sets=sets, warps=warps, ahead=ahead, splits=splits)
                if ext is None:
                    invalid.append((what, built))
                    continue
                if n % (32 * sets * warps):
                    continue

                def launch(m, o, sets=sets, warps=warps, ahead=ahead, asked=asked, x=x):
                    ext(x, m, o, sets, warps, ahead, asked)
                us, error = timed(launch, mats, n, want)
                if error > MAX_ERROR:
                    invalid.append((what, f"errs by {error:.2e} against the reference"))
                else:
                    mma.append((us, error, what))
        if not engine:
            raise SystemExit(f"{name} {n}x{k}: no launch of the engine's kernel fits this GPU")
        best = min(engine, key=lambda r: r[0])
        row = dict(product=name, shape=f"{n}x{k}", MB=nbytes(w) / 1e6, engine_us=best[0],
                   engine_gbps=nbytes(w) / best[0] / 1e3, engine_error=best[1],
                   engine_config=best[2], mma_invalid=invalid)
        if mma:
            fastest = min(mma, key=lambda r: r[0])
            row.update(mma_us=fastest[0], mma_gbps=nbytes(w) / fastest[0] / 1e3,
                       mma_error=fastest[1], mma_launch=fastest[2],
                       ratio=fastest[0] / best[0])
        rows.append(row)
        mine = (f"mma {row['mma_us']:7.2f} us ({row['mma_gbps']:6.0f} GB/s, err "
                f"{row['mma_error']:.1e}, {row['mma_launch']}) ratio {row['ratio']:.3f}"
                if mma else f"mma invalid: {invalid[0][1] if invalid else 'no launch fits'}")
        print(f"{name:5} {n}x{k}: engine {best[0]:7.2f} us ({row['engine_gbps']:6.0f} GB/s, err "
              f"{best[1]:.1e}) | {mine}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sass", action="store_true", help="compile for sm_90 and count")
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.sass:
        sass(args.json)
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --sass for the compiled code alone")
    rows = compare(args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(),
                                                   model=args.model, rows=rows), indent=1))


if __name__ == "__main__":
    main()
