"""The GEMV kernel's launch configuration, and the rows product's (the verify step's,
floorline.engine.kernels.rows), tuned once per GPU and shape and kept on disk.

A configuration is timed the way the step runs it: launches replayed from a CUDA graph, each on
another copy of the weights so that the copies together overflow L2 four times (a step reads
every weight once; a timing loop over one matrix would measure L2). The table is
FLOORLINE_CACHE/engine-gemv.json, over the shipped tables in engine/tuned/ (a run on a GPU
measured by this project).

Inside the step a kernel overlaps its neighbours (programmatic dependent launch), so the
configuration fastest alone need not be fastest there: tune_in_step searches again with the
whole step as the timer (bench/engine_step_tune.py drives it on a GPU).

The rows product's entries share the table and its fields (a GemvConfig; words unused), their
keys marked "|rows". Its rows are padded to 16 whatever their number, so one entry serves every
verify step of a shape; it is timed on 8 rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from floorline import graphs
from floorline.engine.kernels.gemv import GemvConfig, SplitPartials, gemv
from floorline.engine.kernels.rows import default_config, rows_product
from floorline.engine.quant import (
    Fp8Weight,
    Int4Weight,
    Int4Words,
    Q4_1Weight,
    Q8_0Weight,
    nbytes,
    quantise_fp8,
)
from floorline.errors import FloorlineError
from floorline.localcache import cache_dir
from floorline.timing import rotation_copies, time_steps

SHIPPED = Path(__file__).parent / "tuned"

# (block_n, block_k, warps), then (..., splits along K); the middle shapes are also tried with
# shallower and deeper software pipelines.
SHAPES = [(1, 2048, 4), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (4, 1024, 4), (4, 1024, 8),
          (8, 256, 4), (8, 512, 4), (8, 512, 8), (16, 256, 4), (16, 512, 8)]
SPLITS = [(4, 512, 4, 2), (8, 256, 4, 2), (4, 512, 4, 4), (8, 256, 4, 4), (2, 1024, 4, 4)]
# int4: (block_n, groups of 128 per iteration, warps, words per thread); threads spread over a
# tile's groups x (16 / words) positions (group 128), so these fill a program's threads without
# spreading over rows. Tiles that Triton 3.6 lays out without shared-memory shuffles in the loop
# (read from the compiled code with its registers and spills: bench/engine_int4_sass.py); then
# splits as above. A group of 64 or 32 takes two or four times the groups, the same K: as many
# (group, position) pairs to spread threads over, for words per thread up to its positions.
INT4_SHAPES = [(8, 4, 1, 2), (16, 4, 1, 2), (8, 8, 1, 4), (8, 8, 2, 2), (16, 8, 2, 2),
               (16, 8, 1, 4)]
INT4_SPLITS = [(8, 4, 1, 2, 2), (16, 4, 1, 2, 2), (8, 4, 1, 2, 4), (16, 4, 1, 2, 4),
               (8, 4, 1, 2, 7), (16, 4, 1, 2, 7), (16, 8, 2, 2, 2)]
# fp8 also on the tensor cores (GemvConfig.dots): (block_n, block_k, warps, splits, stages);
# rows in blocks of 64 or more (a warp group's 8-bit tile: fewer rows go through 16-bit
# products, converted), whole tiles streamed through shared memory, so fewer, larger programs
# than the CUDA cores' kernel, split along K where the row blocks are too few to fill the GPU;
# splits of 3, 5 and 6 and shallower pipelines (more programs resident per SM) give the waves
# of programs other shapes.
DOTS = [(64, 128, 4, 1, 3), (64, 256, 4, 1, 3), (64, 256, 4, 1, 4), (64, 512, 4, 1, 2),
        (128, 128, 4, 1, 3), (128, 128, 8, 1, 3), (128, 256, 8, 1, 3),
        (64, 256, 4, 2, 3), (64, 256, 4, 4, 3), (64, 128, 4, 4, 4), (64, 128, 4, 8, 4),
        (128, 128, 4, 2, 3), (128, 128, 4, 4, 3), (64, 256, 4, 3, 3), (64, 256, 4, 5, 3),
        (64, 256, 4, 6, 2), (64, 256, 4, 2, 2), (64, 256, 4, 4, 2)]


def candidates(k: int, group: int | None = None, fp8: bool = False) -> list[GemvConfig]:
    """The tables above, blocks no wider than K (rounded up to a power of two); `group` is an
    int4 weight's group size (None for 16-bit and fp8); `fp8` adds the tensor cores' launches."""
    if group is not None:
        most = triton.next_power_of_2(max(1, k // group))
        positions, per_128 = group // 8, max(1, 128 // group)
        configs = [GemvConfig(bn, min(g * per_128, most) * group, w, s, words=min(v, positions))
                   for bn, g, w, v, s in [(*shape, 1) for shape in INT4_SHAPES] + INT4_SPLITS]
        return list(dict.fromkeys(c for c in configs if c.fits(k)))
    widest = max(16, triton.next_power_of_2(k))
    configs = [GemvConfig(bn, min(bk, widest), w) for bn, bk, w in SHAPES]
    configs += [GemvConfig(bn, bk, w, s) for bn, bk, w, s in SPLITS]
    configs += [GemvConfig(bn, min(bk, widest), w, 1, stages)
                for bn, bk, w in SHAPES[3:6] for stages in (2, 4)]
    if fp8:
        configs += [GemvConfig(bn, max(32, min(bk, widest)), w, s, stages, dots=True)
                    for bn, bk, w, s, stages in DOTS]
    return list(dict.fromkeys(c for c in configs if c.fits(k)))


# The rows product: (block_n, block_k, warps), then (..., splits along K); the tiles' dots go
# through the tensor cores with all rows at once, so fewer, wider column blocks than the GEMV's,
# and splits where N / block_n programs are too few to keep enough of W in flight (Qwen2.5-7B's
# o and down: 56 blocks of 64 on 132 SMs). A few also with shallower and deeper pipelines.
ROWS_SHAPES = [(64, 64, 4), (64, 128, 4), (64, 128, 8), (64, 256, 8), (32, 128, 4),
               (32, 256, 4), (16, 256, 4)]
ROWS_SPLITS = [(64, 128, 4, 2), (64, 128, 4, 4), (32, 128, 4, 2), (32, 128, 4, 4),
               (32, 256, 4, 4), (16, 256, 4, 4), (64, 64, 4, 8), (32, 128, 4, 8)]
# int4 reads one group a tile: (block_n, warps, splits)
ROWS_INT4 = [(64, 4, 1), (64, 8, 1), (32, 4, 1), (16, 4, 1), (64, 4, 2), (32, 4, 2), (64, 4, 4),
             (32, 4, 4), (16, 4, 4), (32, 4, 8)]
ROWS = 8  # rows of x the rows product is timed on


def rows_candidates(k: int, group: int | None = None) -> list[GemvConfig]:
    """The rows product's tables above, splits no smaller than a tile; `group` as candidates'."""
    if group is not None:
        configs = [GemvConfig(bn, group, w, s) for bn, w, s in ROWS_INT4]
    else:
        configs = [GemvConfig(bn, bk, w) for bn, bk, w in ROWS_SHAPES]
        configs += [GemvConfig(bn, bk, w, s) for bn, bk, w, s in ROWS_SPLITS]
        configs += [GemvConfig(bn, bk, w, 1, stages)
                    for bn, bk, w in (ROWS_SHAPES[1], ROWS_SHAPES[4]) for stages in (2, 4)]
    return list(dict.fromkeys(c for c in configs if c.fits(k)))


def interpreter_config(k: int, group: int | None = None) -> GemvConfig:
    """Few, large programs: the interpreter's cost is per program, not per byte (128 columns
    a program: 16 made the tests' decodes 3-5x slower); a tiny model's wider products still span
    several programs, its narrower ones one with a ragged edge."""
    if group is not None:
        return GemvConfig(128, group * min(triton.next_power_of_2(max(1, k // group)),
                                          max(1, 256 // group)), words=min(2, group // 8))
    return GemvConfig(128, min(256, max(16, triton.next_power_of_2(k))))


def group_of(w) -> int | None:
    """The group of a weight read as int4 words (int4, Q4_1), else None."""
    return w.group_size if isinstance(w, Int4Words) else None


def kind(w) -> str:
    """The weight's format in a tuning key."""
    if isinstance(w, Int4Weight):
        return f"int4g{w.group_size}"
    if isinstance(w, Q4_1Weight):
        return "q4_1"
    if isinstance(w, Q8_0Weight):
        return "q8_0"
    if isinstance(w, Fp8Weight):
        return "fp8row"
    return str(w.dtype)


def random_like(w, generator):
    """A weight of `w`'s format and shape with random contents (for timing)."""
    n, k = w.shape
    device = w.device
    def words():
        return torch.randint(-2**31, 2**31 - 1, tuple(w.qweight.shape), dtype=torch.int32,
                             device=device, generator=generator)

    def fp16(shape, lo=1e-3, hi=2e-3):
        return torch.empty(tuple(shape), dtype=torch.float16, device=device).uniform_(
            lo, hi, generator=generator)
    if isinstance(w, Int4Weight):
        return Int4Weight(words(), fp16(w.scales.shape),
                          torch.randint(0, 16, tuple(w.zeros.shape), dtype=torch.uint8,
                                        device=device, generator=generator), w.group_size)
    if isinstance(w, Q4_1Weight):
        return Q4_1Weight(words(), fp16(w.scales.shape), fp16(w.mins.shape, -2e-2, -1e-2))
    if isinstance(w, Q8_0Weight):
        return Q8_0Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device,
                                        generator=generator), fp16(w.scales.shape))
    m = torch.empty(n, k, dtype=torch.float32 if isinstance(w, Fp8Weight) else w.dtype,
                    device=device).normal_(0, 0.02, generator=generator)
    return quantise_fp8(m) if isinstance(w, Fp8Weight) else m


# Each GemvConfig field of a table entry: whether the kernels need a power of two (Triton's
# tiles, warps per program, an int4 group's word positions), and a bound far above any tuned
# entry (32 warps: a program's 1024 threads; 16 words: a group of 128's word positions).
LAUNCH_FIELDS = {"block_n": (True, 1024), "block_k": (True, 65536), "num_warps": (True, 32),
                 "split_k": (False, 1024), "num_stages": (False, 16), "words": (True, 16)}
ROWS_KEY = "|rows"  # the end of a rows product's key
ROWS_LEAST = {"block_n": 16, "block_k": 16}  # its tiles' dots: the tensor cores' smallest


def _launch_problem(key: str, entry: dict) -> str | None:
    """What is wrong with a table entry's launch fields, or None."""
    dots = entry.get("dots", False)
    if type(dots) is not bool:
        return f"dots is {dots!r}, not true or false"
    parts = key.split("|")  # gpu|NxK|kind->dtype|flags, then |rows for a rows product
    flags = parts[3].split(",") if len(parts) > 3 else []
    if dots and ("|fp8row->" not in key or key.endswith(ROWS_KEY) or "precise" in flags):
        return ("dots (the tensor cores' GEMV) is for the one-token product of fp8 weights in "
                "a 16-bit model")
    if dots and (entry.get("block_n", 1) < 16 or entry.get("block_k", 1) < 32):
        return "dots (the tensor cores' GEMV) takes tiles of at least 16 rows x 32 columns"
    for name, (power_of_two, most) in LAUNCH_FIELDS.items():
        value = entry.get(name, 1)  # a field with a default may be absent
        least = ROWS_LEAST.get(name, 1) if key.endswith(ROWS_KEY) else 1
        if (type(value) is not int or not least <= value <= most
                or (power_of_two and value & (value - 1))):
            what = "a power of two" if power_of_two else "an integer"
            return f"{name} is {value!r}, not {what} from {least} to {most}"
    return None


def _read_table(path: Path) -> dict:
    """{key: GemvConfig fields (+ how each was chosen: us and gbps alone, or step_ratio and
    tuned_in_step in a step)}; anything else is refused in one line."""
    fields = {f.name for f in dataclasses.fields(GemvConfig)
              if f.default is dataclasses.MISSING}  # fields with defaults may be absent
    try:
        table = json.loads(path.read_text())
        if not isinstance(table, dict) or not all(
                isinstance(v, dict) and fields <= v.keys() for v in table.values()):
            raise ValueError("not a table of GEMV launch configurations")
        for key, entry in table.items():
            problem = _launch_problem(key, entry)
            if problem:
                raise ValueError(f"entry '{key}': {problem}")
    except (ValueError, OSError) as e:  # JSONDecodeError is a ValueError
        raise FloorlineError(f"cannot read the GEMV tuning table {path} ({e}); delete it to "
                             "tune again") from None
    return table


class GemvTuner:
    """Launch configurations of the GEMV and of the rows product (rows=True) by key, timed by
    `timer` (fn -> microseconds of one call; on CUDA time_graph) at a shape's first use. With
    no timer (the CPU's interpreter) nothing is tuned: each kernel's fixed default. `precise`
    (an fp32 model's products): fp8 weights are tuned without the tensor cores' kernel, under
    keys of their own (flag "precise")."""

    def __init__(self, device, timer=None, precise: bool = False):
        self.precise = precise
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # the tensor cores' 8-bit dots as the fp8 GEMV has been compiled and measured: Hopper's
        # (on the CPU only a test's timer tunes)
        self.fp8_dots = (torch.cuda.get_device_capability(self.device)[0] == 9 if self.cuda
                         else True)
        self.gpu = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"
        self.timer = timer or (time_graph if self.cuda else None)
        self.file = cache_dir() / "engine-gemv.json"
        # key -> candidates' arguments (K, int4 group or None, fp8) of each GEMV shape looked
        # up, in order
        self.seen = {}
        self.trials = {}  # key -> [(us, config)] of every launch tune timed, fastest first
        self.table = {}
        for source in sorted(SHIPPED.glob("*.json")) + [self.file]:
            if source.is_file():
                self.table.update(_read_table(source))

    def key(self, w, out, rows: bool = False, **flags) -> str:
        on = ",".join(name for name, value in sorted(flags.items()) if value)
        key = f"{self.gpu}|{w.shape[0]}x{w.shape[1]}|{kind(w)}->{out.dtype}|{on}"
        return key + ROWS_KEY if rows else key

    def config(self, w, out, *, norm: bool, up: bool, bias: bool, accumulate: bool,
               rows: bool = False) -> GemvConfig:
        """The launch for W into `out`: the GEMV's, or with `rows` the rows product's."""
        if self.timer is None:
            return default_config(w) if rows else interpreter_config(w.shape[1], group_of(w))
        fp8 = isinstance(w, Fp8Weight) and not rows
        precise = self.precise and fp8
        dots = fp8 and self.fp8_dots and not precise  # the tensor cores' launches offered
        key = self.key(w, out, rows, norm=norm, up=up, bias=bias, accumulate=accumulate,
                       precise=precise)
        if not rows:  # in-step tuning (tune_in_step) takes the GEMV's shapes
            self.seen.setdefault(key, (w.shape[1], group_of(w), dots))
        if key not in self.table:
            self.trials[key] = self.tune(w, out, norm=norm, up=up, bias=bias,
                                         accumulate=accumulate, rows=rows, dots=dots)
            us, best = self.trials[key][0]
            weight_bytes = nbytes(w) * (2 if up else 1)
            self.use(key, best, us=round(us, 2), gbps=round(weight_bytes / us / 1e3, 1))
            self.save(key)
        return self.current(key)

    def current(self, key: str) -> GemvConfig:
        fields = {f.name for f in dataclasses.fields(GemvConfig)}
        return GemvConfig(**{f: v for f, v in self.table[key].items() if f in fields})

    def use(self, key: str, config: GemvConfig, **facts) -> None:
        """Put `config` in force for `key` (launches from now on take it), with `facts` on how
        it was chosen beside it."""
        self.table[key] = {**dataclasses.asdict(config), **facts}

    def save(self, key: str) -> None:
        """Write `key`'s entry into the local table (the shipped ones are never written)."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        mine = _read_table(self.file) if self.file.is_file() else {}
        mine[key] = self.table[key]
        tmp = self.file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(mine, indent=1, sort_keys=True))
        tmp.replace(self.file)

    def tune(self, w, out, *, norm, up, bias, accumulate, rows: bool = False,
             dots: bool = False) -> list[tuple[float, GemvConfig]]:
        """Every candidate for this shape with its microseconds per product, fastest first
        (with `rows`: the rows product's on ROWS rows; `dots`: fp8 also on the tensor cores);
        one the GPU cannot launch (OutOfResources: shared memory or registers) is passed
        over."""
        n, k = w.shape
        copies = rotation_copies(nbytes(w) * (2 if up else 1), self.device)

        generator = torch.Generator(device=self.device).manual_seed(n * k)

        # 16-bit activations of the weight's dtype (bf16 beside a quantised weight)
        act = w.dtype if isinstance(w, torch.Tensor) else torch.bfloat16

        def draw(*shape, dtype=act):  # its own generator: tuning leaves torch's alone
            return torch.empty(shape, dtype=dtype, device=self.device).normal_(
                0, 0.02, generator=generator)

        mats = [(random_like(w, generator), random_like(w, generator) if up else None)
                for _ in range(copies)]
        lead = (ROWS,) if rows else ()
        # the residual stream is fp32
        x = draw(*lead, k, dtype=torch.float32) if norm else draw(*lead, k)
        extras = dict(norm=draw(k) if norm else None, eps=1e-6, bias=draw(n) if bias else None,
                      accumulate=accumulate)
        y = torch.zeros(*lead, n, dtype=out.dtype, device=self.device)
        partials = SplitPartials()
        product = rows_product if rows else gemv
        results = []
        tried = (rows_candidates(k, group_of(w)) if rows
                 else candidates(k, group_of(w), dots))
        for config in tried:
            def run(config=config):
                for m, u in mats:
                    product(x, m, y, config=config, up=u, partials=partials, **extras)
            try:
                results.append((self.timer(run) / copies, config))
            except OutOfResources:
                continue
        if not results:
            what = "rows product" if rows else "GEMV"
            raise FloorlineError(f"no launch of the {what} of a {n}x{k} {kind(w)} matrix fits "
                                 f"the {self.gpu}'s shared memory and registers")
        results.sort(key=lambda r: r[0])
        return results


def tune_in_step(keys, candidates_of, current, apply, time_step, *, min_gain: float = 0.003,
                 rounds: int = 3) -> list[dict]:
    """One pass of coordinate descent over the step's GEMV shapes, the whole step the timer.

    For each table key in `keys`: `current(key)` is the configuration in force, each of
    `candidates_of(key)` is put in force by `apply(key, config)` and the step timed once by
    `time_step()` (ms); the fastest is then timed against the incumbent `rounds` times more,
    alternately, and replaces it only if the median ratio of their steps is at least `min_gain`
    below 1 (one screening time per candidate is within the step's noise of its neighbours').
    What is chosen stays in force for the keys after it. Returns, per key, the incumbent, the
    chosen configuration, the screened step times and the confirming ratio (None where the
    incumbent was fastest)."""
    chosen = []
    for key in keys:
        incumbent = current(key)
        apply(key, incumbent)
        screened = {incumbent: time_step()}
        for config in candidates_of(key):
            if config not in screened:
                apply(key, config)
                screened[config] = time_step()
        best = min(screened, key=screened.get)
        ratio = None
        if best != incumbent:
            ratios = []
            for _ in range(rounds):
                apply(key, incumbent)
                before = time_step()
                apply(key, best)
                ratios.append(time_step() / before)
            ratio = statistics.median(ratios)
        keep = best if ratio is not None and ratio <= 1 - min_gain else incumbent
        apply(key, keep)
        chosen.append(dict(key=key, incumbent=incumbent, chosen=keep, ratio=ratio,
                           screened_ms={c: round(ms, 4) for c, ms in screened.items()}))
    return chosen


def time_graph(fn, replays: int = 10) -> float:
    """Median microseconds of one replay of `fn` captured in a CUDA graph, timed by the
    project's step timer (events around each replay, after one untimed replay)."""
    graph = graphs.capture(fn)
    return statistics.median(time_steps(graph.replay, "cuda", replays, warmup=1)) * 1e3
