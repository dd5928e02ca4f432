"""The one contract every path implements, and the options (+compile, +graphs) any path gets.

    session = path.open(model_spec, device, capacity)  # build or load weights, allocate
                                                       # the cache
    session.prefill(ctx)                               # fill the KV cache with ctx tokens
    session.step()                                     # one new token; nothing for the
                                                       # timer to wait on
    session.rewind(n)                                  # where the path can: the next step
                                                       # takes the position n steps back
    session.close()

and, for a quality measurement (measure/quality.py), where the path can give them:

    session.window_logits(ids)                         # [n, vocab] fp32 logits of every
                                                       # position of ids, on the host
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from floorline import graphs
from floorline.errors import FloorlineError

# Steps run eagerly on a side stream before capture: they allocate workspaces (cuBLAS) and
# trigger compilation, which must not happen inside the graph.
GRAPH_WARMUP_STEPS = 3


class PathUnavailable(FloorlineError):
    """The path cannot run here (library missing, no CUDA, shapes not static): an invalid cell."""


class Session(ABC):
    # None when step() reads and writes only fixed buffers of fixed shape and keeps no state on
    # the host, so that it can be compiled without recompiling and captured once in a CUDA
    # graph; otherwise why not.
    not_static_reason: str | None = "its step is not known to be static"

    @abstractmethod
    def prefill(self, ctx: int) -> None: ...

    @abstractmethod
    def step(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def compile(self, mode: str) -> None:
        raise PathUnavailable(f"{type(self).__name__} has no compiled form")

    def rewind(self, n: int) -> None:
        """Move the next step back `n` positions: the cache keeps the tokens before it and the
        steps after it write their positions again. Only where the path's rewinds() says so."""
        raise PathUnavailable(f"{type(self).__name__} cannot rewind")

    def window_logits(self, ids):
        """The logits of every position of `ids` (1-D token ids, from position 0) as the path
        computes them in its formats: a float32 tensor [n, vocab] on the CPU. The session's
        cache may be overwritten. PathUnavailable where the path cannot give them."""
        raise PathUnavailable("floorline cannot read this path's logits at every position of "
                              "a window yet")

    def prefill_details(self) -> dict:
        """What the path measured of its last prefill (time to first token), for the cell."""
        return {}


@dataclass(frozen=True)
class Library:
    """The library a path runs on: what is imported (None: no pip package), what pip installs,
    and floorline's optional extra that installs it."""
    module: str | None
    distribution: str
    extra: str


@dataclass(frozen=True)
class PathFacts:
    """What a path is, declared in one place for each path."""
    name: str
    weight_format: str = "bf16"  # the floor's weight format (traffic.WEIGHT_FORMATS)
    kv_dtype: str = "bf16"  # the floor's KV cache format
    # The 16-bit path of the same runtime that a quantised path's realised reduction is
    # measured against (same options); None for 16-bit paths.
    reference: str | None = None
    dtype: str | None = None  # transformers paths: the torch dtype the model runs in
    library: Library | None = None
    cuda_only: bool = False  # the library's kernels for this format run on CUDA only


class DecodePath(ABC):
    """A path: one way of running a model's decode step (a runtime, its weight and KV formats)."""

    facts: PathFacts
    # Whether a step may cost more in a session opened with room for more positions (a static
    # cache that attention reads whole does): a cell then opens it with no more room than its
    # timing needs, and meters energy within what timing leaves.
    sized_by_capacity = True

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def weight_format(self) -> str:
        return self.facts.weight_format

    @property
    def kv_dtype(self) -> str:
        return self.facts.kv_dtype

    @property
    def reference(self) -> str | None:
        return self.facts.reference

    def unavailable(self, device: str) -> str | None:
        """Why this path cannot run on `device`, or None."""
        return None

    def rewinds(self, model_spec) -> bool:
        """Whether this path's sessions of `model_spec` can rewind (Session.rewind)."""
        return False

    def versions(self) -> dict:
        """Versions of the libraries this path runs on, beyond the fingerprint's."""
        return {}

    def real_weights(self, model_spec) -> bool:
        """Whether a cell of `model_spec` runs a checkpoint's weights rather than random ones."""
        return model_spec.has_real_weights

    @abstractmethod
    def open(self, model_spec, device: str, capacity: int, seed: int) -> Session: ...


class GraphedSession(Session):
    """Captures the inner session's step once, after prefill, and replays it."""

    not_static_reason = None

    def __init__(self, inner: Session):
        self.inner = inner
        self.graph = None

    def prefill(self, ctx: int) -> None:
        self.inner.prefill(ctx)
        try:
            self.graph = graphs.capture(self.inner.step, warmup=GRAPH_WARMUP_STEPS)
        except RuntimeError as e:  # a library that synchronises or allocates inside its step
            self.graph = None
            reset_capture_state()
            raise PathUnavailable("its step cannot be captured in a CUDA graph: "
                                  + (str(e).splitlines() or [type(e).__name__])[0]) from None

    def step(self) -> None:
        self.graph.replay()

    def rewind(self, n: int) -> None:
        self.inner.rewind(n)  # in place: the graph reads the same buffers

    def prefill_details(self) -> dict:
        return self.inner.prefill_details()

    def close(self) -> None:
        self.graph = None
        self.inner.close()


def rewinding(session: Session, window: int) -> Callable[[], None]:
    """session.step, rewound `window` positions after every `window` steps: however many steps
    a timing runs, each reads no more than `window` positions past the first."""
    done = 0

    def step() -> None:
        nonlocal done
        session.step()
        done += 1
        if done == window:
            session.rewind(window)
            done = 0
    return step


def reset_capture_state() -> None:
    """A capture that failed leaves torch's CUDA generator marked as capturing, and every later
    random draw in the process then fails; an empty capture that ends cleanly resets it."""
    import torch

    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    except RuntimeError:
        pass


@dataclass(frozen=True)
class PathSpec:
    base: str
    compile: bool = False
    graphs: bool = False
    verify: int = 1  # tokens each timed step checks at once (+verifyK: the engine's verify step)

    @property
    def name(self) -> str:
        return (self.base + ("+compile" if self.compile else "")
                + ("+graphs" if self.graphs else "")
                + (f"+verify{self.verify}" if self.verify > 1 else ""))


OPTIONS = ("compile", "graphs", "verifyK")


def compile_mode(device: str) -> str:
    # Inductor's GEMM autotuning pays on a GPU; CUDA graphs stay our own option (+graphs).
    return "max-autotune-no-cudagraphs" if device.startswith("cuda") else "default"
