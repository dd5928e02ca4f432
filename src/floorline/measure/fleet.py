"""A sweep (or an A/B's sessions) spread over a Dask cluster: one task per cell (or session),
each on a worker that holds one GPU.

Workers measure; only this process, the driver, writes the results database, committing each
cell as its task ends, so no file system needs to be shared. Each task is one cell: the cell
runner builds its model anew for every cell, so grouping cells into one task would build none
fewer times. The driver places each task on an idle worker itself, one at a time per worker, so
that a worker that dies takes down only the cell it was running; that cell is tried on another
worker, ATTEMPTS times in all, then stored invalid, naming the cause.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import queue
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from floorline.errors import FloorlineError, one_line
from floorline.hardware import DeviceSpec, detect
from floorline.measure import provenance
from floorline.measure.ab import (
    Bench,
    Plan,
    SessionResult,
    check_plan,
    run_session,
)
from floorline.measure.fingerprint import environment, fingerprint_key
from floorline.measure.runner import TIMEOUT_S, run_cell_in_child
from floorline.records import INVALID, UNSTEADY, CellKey, CellResult
from floorline.store import Store

GPU = "GPU"  # the Dask resource a worker holds one of per GPU; every cell's task needs one
LOCAL_CUDA = "local-cuda"
TOPIC = "floorline-fleet"  # the event each task logs as it starts, for the driver's progress
CONNECT_VAR = "FLOORLINE_CONNECT_TIMEOUT"  # sets CONNECT_S
WAIT_VAR = "FLOORLINE_WORKER_TIMEOUT"  # sets WAIT_S
CONNECT_S = 10  # to reach a scheduler
WAIT_S = 600  # for a worker with a GPU to join, at the start or after the last one left
DIAGNOSE_S = 2  # for the plain TCP connection that tells why a scheduler did not answer
# tcp://HOST:PORT or tls://HOST:PORT, HOST a name, an IPv4 address or an IPv6 one in brackets
ADDRESS = re.compile(r"(tcp|tls)://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")
POLL_S = 1.0  # between looks at the fleet's workers while no task ends
ATTEMPTS = 3  # workers a cell may be tried on, each lost while running it
# The statistical profiler of a Dask worker samples its threads every 10 ms, taking the GIL
# beside the timed steps; the fleet's own workers run without it.
WORKER_CONFIG = {"distributed.worker.profile.enabled": False}


def measure_one(key: CellKey, device: str, gpu: DeviceSpec, seed: int,
                trust_remote_code: bool, timeout_s: float) -> CellResult:
    """One cell measured on this worker, in a fresh process of its own as in a sweep here: the
    one place a fleet task calls the cell runner."""
    return run_cell_in_child(key, device, gpu, seed, trust_remote_code, timeout_s)


@dataclass(frozen=True)
class Task:
    """What a worker is sent for one cell."""

    key: CellKey
    device: str  # "cuda" (the worker's one visible GPU) or "cpu"
    gpu: DeviceSpec | None  # --gpu's spec for the floor; None: the worker detects its own
    seed: int = 0
    trust_remote_code: bool = False
    timeout_s: float = TIMEOUT_S  # the cell's process


@dataclass
class Measured:
    """A task's result: the cell with the environment it was measured in, the worker's."""

    cell: CellResult
    env: dict
    env_key: str
    worker: str


_detected: dict[str, DeviceSpec] = {}  # per worker process: its device's spec, detected once


def worker_gpu(device: str, given: DeviceSpec | None) -> DeviceSpec:
    """The spec of this worker's device for the floor: --gpu's where given, else detected."""
    if given is not None:
        return given
    if device not in _detected:
        import torch

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise FloorlineError(f"worker on {socket.gethostname()} sees no CUDA device (start "
                                 "it on a GPU, or sweep with --device cpu)")
        _detected[device] = detect(device)
    return _detected[device]


def describe_worker(device: str, gpu: DeviceSpec | None, dask_worker) -> dict:
    """Runs on a worker: its name, host, the GPU it measures on and its environment."""
    device_spec = worker_gpu(device, gpu)
    env = environment(device)
    return {"name": str(dask_worker.name), "host": socket.gethostname(), "gpu": device_spec.name,
            "env": env, "env_key": fingerprint_key(env)}


def announce(gpu: str) -> str:
    """Runs in a task: tells the driver which worker started it (for its progress); the
    worker's name."""
    from distributed import get_worker

    worker = get_worker()
    worker.log_event(TOPIC, {"task": worker.get_current_task(), "name": str(worker.name),
                             "gpu": gpu, "pid": os.getpid()})
    return str(worker.name)


def run_task(task: Task, measure: Callable[..., CellResult] = measure_one) -> Measured:
    """Runs on a worker: announces the cell, measures it, returns it with the environment."""
    gpu = worker_gpu(task.device, task.gpu)
    env = environment(task.device)
    name = announce(gpu.name)
    cell = measure(task.key, task.device, gpu, task.seed, task.trust_remote_code, task.timeout_s)
    cell.details["worker"] = {"name": name, "host": socket.gethostname()}
    return Measured(cell, env, fingerprint_key(env), name)


def host_port(address: str) -> tuple[str, int] | None:
    """The host and port of a scheduler's address, tcp://HOST:PORT or tls://HOST:PORT; None
    where `address` has neither form."""
    match = ADDRESS.fullmatch(address)
    if match is None or not 0 < int(match[3]) < 65536:
        return None
    host = match[2]
    if host.startswith("["):
        try:
            host = str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            return None
    return host, int(match[3])


def seconds(variable: str, default: float) -> float:
    """A timeout in seconds from the environment variable `variable`, else `default`."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise FloorlineError(f"{variable} must be a number of seconds above 0, got '{text}'")
    return value


def timeouts() -> tuple[float, float]:
    """How long to try to reach a scheduler, and to wait for a worker with a GPU, in seconds."""
    return seconds(CONNECT_VAR, CONNECT_S), seconds(WAIT_VAR, WAIT_S)


def security(cluster: str):
    """Dask's security settings for a client (TLS from Dask's configuration); one line where Dask
    is not installed, or a tls:// address has no TLS settings to connect with."""
    try:
        from distributed.security import Security
    except ImportError:
        raise FloorlineError("--cluster needs Dask: pip install 'floorline[fleet]'") from None
    try:
        settings = Security()
        tls = settings.get_connection_args("client")["ssl_context"] is not None
    except (OSError, ValueError) as e:  # a certificate that cannot be read (ssl's errors too)
        raise FloorlineError(f"Dask's TLS settings cannot be used: {one_line(e)}") from None
    if cluster.startswith("tls://") and not tls:
        raise FloorlineError(
            f"--cluster {cluster}: a tls:// address needs Dask's TLS settings for a client "
            "(distributed.comm.tls.ca-file, .client.cert and .client.key in Dask's "
            "configuration), and none are set")
    return settings


def check_cluster(cluster: str) -> str:
    """`cluster` checked before anything connects: its form, the timeouts the environment sets,
    and for a tls:// address, Dask's TLS settings."""
    if cluster != LOCAL_CUDA and host_port(cluster) is None:
        raise FloorlineError(
            f"--cluster must be '{LOCAL_CUDA}' or a Dask scheduler's address (tcp://HOST:PORT), "
            "or tls://HOST:PORT with Dask's TLS settings; an IPv6 HOST goes in brackets "
            f"(tcp://[::1]:8786); got '{cluster}'")
    timeouts()
    if cluster.startswith("tls://"):
        security(cluster)
    return cluster


async def server_type(address: str, settings, timeout_s: float) -> str:
    """What the Dask server at `address` says it is: "Scheduler", "Worker", ..."""
    from distributed.comm import connect

    comm = await connect(address, timeout=timeout_s, **settings.get_connection_args("client"))
    try:
        await comm.write({"op": "identity", "reply": True})
        return (await comm.read()).get("type", "")
    finally:
        comm.abort()


def look_up(address: str, timeout_s: float) -> None:
    """One line unless the host of `address` is looked up within `timeout_s`. Asked in a thread
    of its own: a resolver whose queries are dropped answers only after its own retries, tens of
    seconds, which neither Dask's connect timeout nor a socket's covers."""
    host, port = host_port(address)
    answer: queue.Queue = queue.Queue()

    def ask():
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            answer.put(None)
        except OSError as e:
            answer.put(e)

    threading.Thread(target=ask, daemon=True).start()
    try:
        error = answer.get(timeout=timeout_s)
    except queue.Empty:
        raise cannot_reach(address, f"cannot look up the host '{host}' (the resolver did not "
                                    f"answer in {timeout_s:g} s)") from None
    if error is not None:
        raise cannot_reach(address, f"{socket_error(host, error)}, tried for {timeout_s:g} s")


def reach(address: str, settings, timeout_s: float) -> None:
    """One line unless a Dask scheduler answers at `address` within `timeout_s`. Asked here,
    apart from the client: the client waits without end on a listener that never answers, and
    one that failed to connect prints a traceback as it is collected."""
    look_up(address, timeout_s)
    try:
        kind = asyncio.run(asyncio.wait_for(server_type(address, settings, timeout_s),
                                            timeout_s))
    except Exception:  # refused, unknown host, no answer, or one not in Dask's protocol
        raise unreachable(address, timeout_s) from None
    if kind != "Scheduler":
        raise FloorlineError(f"{address} is a Dask {kind or 'server'}, not a scheduler: give "
                             "the scheduler's address")


def unreachable(address: str, timeout_s: float) -> FloorlineError:
    """Why no scheduler answered at `address`, as one plain TCP connection to it tells."""
    host, port = host_port(address)
    try:
        socket.create_connection((host, port), timeout=min(timeout_s, DIAGNOSE_S)).close()
    except OSError as e:
        why = f"{socket_error(host, e)}, tried for {timeout_s:g} s"
    else:
        why = (f"something accepts connections there but did not answer as a Dask scheduler in "
               f"{timeout_s:g} s" + (" (with the TLS settings in Dask's configuration)"
                                    if address.startswith("tls://") else ""))
    return cannot_reach(address, why)


def cannot_reach(address: str, why: str) -> FloorlineError:
    return FloorlineError(f"cannot reach the Dask scheduler at {address}: {why}; "
                          f"{CONNECT_VAR}=SECONDS sets how long to try")


def socket_error(host: str, e: OSError) -> str:
    if isinstance(e, socket.gaierror):
        return f"cannot look up the host '{host}' ({e.strerror})"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (nothing listens on that port)"
    if isinstance(e, TimeoutError):
        return "no answer (the host may be down, or a firewall in the way)"
    return e.strerror or one_line(e)


def visible_gpus() -> list[str]:
    """This node's GPUs as CUDA_VISIBLE_DEVICES names them (indices or UUIDs), else by index."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise FloorlineError(f"--cluster {LOCAL_CUDA}: torch sees no CUDA device here")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(count)]
    return [g.strip() for g in visible.split(",")][:count]


def local_cuda_cluster(gpus: list[str]):
    """One worker process per GPU on this node, each seeing only its own GPU.

    Built from `distributed` alone: dask-cuda's LocalCUDACluster does the same but its wheels
    pin numba and RAPIDS libraries, heavy to carry to a machine without a package registry; all
    that is needed of it is one worker per GPU with CUDA_VISIBLE_DEVICES pinned. The workers
    have no memory limit (the nanny would otherwise stop a worker loading a large model) and,
    like the scheduler, listen on the loopback only; the scheduler has no dashboard, and its
    HTTP endpoints (which it starts regardless) take a free loopback port, not 8787 on every
    interface.
    """
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    workers = {(f"gpu{g}" if g.isdigit() else g): {
        "cls": Nanny,
        "options": {"nthreads": 1, "resources": {GPU: 1}, "memory_limit": 0,
                    "env": {"CUDA_VISIBLE_DEVICES": g}, "host": "127.0.0.1"},
    } for g in gpus}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False,
                                               "dashboard_address": "127.0.0.1:0"}}
    with dask.config.set(WORKER_CONFIG):  # the nannies pass the config to their workers
        return SpecCluster(workers=workers, scheduler=scheduler, name=f"floorline {LOCAL_CUDA}")


class Fleet:
    """A Dask client, with the local cluster it started, if any (both closed with it). Made only
    once a scheduler answers at `cluster`, within the connect timeout."""

    def __init__(self, cluster: str):
        check_cluster(cluster)
        self.connect_s, self.wait_s = timeouts()
        settings = security(cluster)
        from distributed import Client

        if cluster == LOCAL_CUDA:
            self.cluster = local_cuda_cluster(visible_gpus())
        else:
            self.cluster = None
            reach(cluster, settings, self.connect_s)
        try:
            self.client = Client(self.cluster or cluster, timeout=self.connect_s,
                                 set_as_default=False, security=settings)
        except (OSError, TimeoutError) as e:
            self.close()
            raise FloorlineError(f"cannot reach the Dask scheduler at {cluster}: {one_line(e)}"
                                 ) from None
        self.address = self.client.scheduler.address
        self.known: dict[str, dict] = {}  # workers identified, by address

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def workers(self) -> dict[str, dict]:
        """The scheduler's workers, by address."""
        return self.client.scheduler_info(n_workers=-1)["workers"]

    def gpu_workers(self) -> list[str]:
        """The addresses of the workers that hold a GPU (a GPU resource)."""
        return [a for a, w in self.workers().items() if w.get("resources", {}).get(GPU, 0) >= 1]

    def census(self) -> str:
        """The workers the scheduler has, while none holds a GPU."""
        count = len(self.workers())
        if not count:
            return "it has no workers"
        return f"it has {count} worker(s), none with a {GPU} resource"

    def wait_for_gpus(self) -> list[str]:
        """The GPU workers, once there is one: the wait said on stderr, and one line after
        `wait_s` without any."""
        deadline = time.monotonic() + self.wait_s
        if not (workers := self.gpu_workers()):
            print(f"waiting up to {self.wait_s:g} s for a Dask worker with a {GPU} resource to "
                  f"join the scheduler at {self.address} ({self.census()}; {WAIT_VAR}=SECONDS "
                  "sets how long to wait)", file=sys.stderr, flush=True)
        while not workers:
            if time.monotonic() > deadline:
                raise FloorlineError(
                    f"no Dask worker with a {GPU} resource joined the scheduler at "
                    f"{self.address} in {self.wait_s:g} s ({self.census()}): start each worker "
                    f"with `--resources {GPU}=1`; {WAIT_VAR}=SECONDS sets how long to wait")
            time.sleep(POLL_S)
            workers = self.gpu_workers()
        return workers

    def identify(self, address: str, device: str, gpu: DeviceSpec | None) -> dict:
        """The worker at `address` as describe_worker says, asked once; one line for a worker
        that cannot measure (no CUDA device, a GPU it cannot name)."""
        if address not in self.known:
            found = self.client.run(describe_worker, device, gpu, workers=[address],
                                    on_error="return")
            info = found.get(address, FloorlineError("it left the fleet"))
            if isinstance(info, BaseException):
                raise FloorlineError(f"worker {address}: {one_line(info)}")
            self.known[address] = info
        return self.known[address]

    def survey(self, device: str, gpu: DeviceSpec | None) -> dict[str, dict]:
        """Each GPU worker, identified, by address (once one has joined)."""
        return {a: self.identify(a, device, gpu) for a in self.wait_for_gpus()}


@dataclass
class Started:
    """A cell's task, as its worker announced it."""

    worker: str
    gpu: str
    pid: int


def lost_reason(what: str, tries: list[str]) -> str:
    return (f"worker lost: the worker running this {what} died, {len(tries)} time(s) "
            f"({', '.join(tries)}); a worker's log says why (out of memory, a crash)")


def lost_cell(key: CellKey, tries: list[str], worker: dict) -> CellResult:
    """The invalid cell of a task whose every worker died running it; `worker` is the last
    one's survey (describe_worker)."""
    cell = CellResult(key, worker["gpu"], INVALID, lost_reason("cell", tries))
    cell.details = {"worker": {"name": worker["name"], "host": worker["host"]}}
    return cell


def driver_environment() -> dict:
    """What a fleet's run is stored with: this machine's code, flags and host (the driver's);
    each row's environment is its worker's."""
    return {"code": provenance.code(), "flags": provenance.flags(), "host": provenance.host(),
            "workers": "each row's environment is its worker's"}


def to_measure(fleet: Fleet, store: Store, keys: list[CellKey], device: str,
               gpu: DeviceSpec | None, force: bool = False) -> tuple[list[CellKey], set[str]]:
    """The cells to measure, and the environments of the fleet's workers: a cell already valid
    under one of them is skipped, unless `force`."""
    env_keys = {info["env_key"] for info in fleet.survey(device, gpu).values()}
    todo = [k for k in keys if force or not any(store.has_valid(k, e) for e in env_keys)]
    return todo, env_keys


def dispatch(fleet: Fleet, items: list, call: Callable[[object], tuple], device: str,
             gpu: DeviceSpec | None, *, attempts: int, on_result: Callable[[object, object], None],
             on_lost: Callable[[object, list[str], dict], None],
             on_start: Callable[[object, Started], None] | None = None) -> None:
    """Runs a task for each of `items` (hashable) on the fleet's GPU workers, in order, and
    hands each result to `on_result(item, result)` as its task ends. `call(item)` is the
    function to run on a worker and its arguments.

    Each task is placed here on an idle GPU worker, one at a time per worker: Dask would queue
    several on one worker, and a worker's death counts against every task queued on it. An
    item whose worker leaves the fleet (dies) is tried on another, `attempts` times in all,
    then given to `on_lost(item, names of the workers lost, the last one's survey)`."""
    pending = list(reversed(items))  # popped from the end, in order
    events: queue.Queue = queue.Queue()  # starts and ends, handled in this thread only
    fleet.client.subscribe_topic(TOPIC, lambda event: events.put(("start", event[1])))
    running: dict[str, tuple[object, object, str]] = {}  # task key -> item, future, worker
    tries: dict[object, list[str]] = {}  # the workers lost while running each item
    idle_since = None

    def lose(name: str) -> None:
        """The task's worker died: the item goes to another worker, or to on_lost."""
        item, future, address = running.pop(name)
        future.cancel()
        lost = fleet.known[address]
        tries.setdefault(item, []).append(lost["name"])
        if len(tries[item]) < attempts:
            pending.append(item)
        else:
            on_lost(item, tries[item], lost)

    try:
        while pending or running:
            workers = fleet.gpu_workers()
            for name in [n for n, (_, _, address) in running.items() if address not in workers]:
                lose(name)
            busy = {address for _, _, address in running.values()}
            for address in workers:
                if pending and address not in busy:
                    # Known before its task runs, so that an item lost with it can name it
                    worker = fleet.identify(address, device, gpu)["name"]
                    # The next item, but not one lost on this worker (or on its GPU before a
                    # restart) while another is waiting
                    fresh = [i for i, k in enumerate(pending) if worker not in tries.get(k, ())]
                    item = pending.pop(fresh[-1] if fresh else -1)
                    name = f"floorline-{uuid.uuid4().hex}"
                    future = fleet.client.submit(
                        *call(item), key=name, workers=[address], allow_other_workers=False,
                        resources={GPU: 1}, pure=False)
                    future.add_done_callback(lambda f: events.put(("done", f)))
                    running[name] = (item, future, address)
            idle_since = None if workers else (idle_since or time.monotonic())
            if idle_since is not None and time.monotonic() - idle_since > fleet.wait_s:
                raise FloorlineError(f"no worker with a {GPU} has been in the fleet for "
                                     f"{fleet.wait_s:g} s ({WAIT_VAR}=SECONDS sets how long to "
                                     "wait); every finished result is in the database")
            try:
                kind, event = events.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if kind == "start":
                if event["task"] in running and on_start:
                    on_start(running[event["task"]][0],
                             Started(event["name"], event["gpu"], event["pid"]))
                continue
            if event.key not in running:  # a task given up above, its worker gone
                continue
            if event.cancelled():
                raise FloorlineError(f"the Dask scheduler at {fleet.address} dropped the tasks; "
                                     "every finished result is in the database")
            if event.status != "finished":
                error = event.exception()
                if type(error).__name__ == "KilledWorker":  # the scheduler gave up on its worker
                    lose(event.key)
                    continue
                raise FloorlineError(f"a worker failed: {type(error).__name__}: "
                                     f"{one_line(error)}")
            on_result(running.pop(event.key)[0], event.result())
    finally:
        for _, future, _ in running.values():
            future.cancel()
        fleet.client.unsubscribe_topic(TOPIC)


def sweep(fleet: Fleet, store: Store, keys: list[CellKey], device: str,
          gpu: DeviceSpec | None = None, *, seed: int = 0, trust_remote_code: bool = False,
          timeout_s: float = TIMEOUT_S, attempts: int = ATTEMPTS,
          on_start: Callable[[CellKey, Started], None] | None = None,
          on_done: Callable[[CellKey, CellResult, str, str], None] | None = None,
          on_again: Callable[[int], None] | None = None,
          task_fn: Callable[[Task], Measured] = run_task) -> set[str]:
    """Measures every cell of `keys` on the fleet, committing each as its task ends (a cell
    lost with its workers, invalid); `on_done(key, cell, worker, env_key)` follows each. Then
    each cell found unsteady is measured once more, as an in-process sweep does
    (floorline.measure.sweep.Sweep.run_cells; `on_again(how many)` first). The environments
    the cells were stored with (their workers')."""
    env_keys: set[str] = set()
    unsteady: dict[CellKey, CellResult] = {}
    again: dict[CellKey, CellResult] = {}

    def done(key: CellKey, m: Measured) -> None:
        if key in again:
            m.cell.measured_again_after(again[key])
        elif m.cell.status == UNSTEADY:
            unsteady[key] = m.cell
        store.add(m.cell, m.env, m.env_key)
        env_keys.add(m.env_key)
        if on_done:
            on_done(key, m.cell, m.worker, m.env_key)

    def lost(key: CellKey, tries: list[str], worker: dict) -> None:
        done(key, Measured(lost_cell(key, tries, worker), worker["env"], worker["env_key"],
                           worker["name"]))

    def measure(cells: list[CellKey]) -> None:
        dispatch(fleet, cells,
                 lambda key: (task_fn, Task(key, device, gpu, seed, trust_remote_code,
                                            timeout_s)),
                 device, gpu, attempts=attempts, on_result=done, on_lost=lost, on_start=on_start)

    measure(keys)
    again.update(unsteady)
    if again:
        if on_again:
            on_again(len(again))
        measure([k for k in keys if k in again])
    return env_keys


def run_session_task(plan: Plan, index: int) -> SessionResult:
    """Runs on a worker: one A/B session (its fresh processes see the worker's one GPU)."""
    announce(plan.gpu)
    return run_session(plan, index)


def ab(fleet: Fleet, plan: Plan, indices: list[int], on_session: Callable[[SessionResult], None],
       attempts: int = ATTEMPTS) -> list[SessionResult]:
    """The plan's sessions of `indices` spread over the fleet, each handed to `on_session` as it
    ends (a session lost with its workers, failed); all of them, in session order."""
    sessions = []

    def done(index: int, s: SessionResult) -> None:
        on_session(s)
        sessions.append(s)

    dispatch(fleet, indices, lambda i: (run_session_task, plan, i),
             plan.device, None, attempts=attempts, on_result=done,
             on_lost=lambda i, tries, _: done(i, SessionResult(i, "failed",
                                                               lost_reason("session", tries))))
    return sorted(sessions, key=lambda s: s.index)


def one_kind(fleet: Fleet, device: str, gpu: DeviceSpec | None) -> dict:
    """The survey of a fleet whose workers share one GPU and environment (an A/B sets their
    sessions against each other); one line naming the kinds where they do not."""
    workers = fleet.survey(device, gpu)
    kinds = {(w["gpu"], w["env_key"]) for w in workers.values()}
    if len(kinds) > 1:
        raise FloorlineError(
            f"an A/B compares sessions on one kind of GPU and environment, and the workers at "
            f"{fleet.address} have {len(kinds)} ({', '.join(sorted(g for g, _ in kinds))}): "
            "give it workers of one kind")
    return next(iter(workers.values()))


def ab_bench(fleet: Fleet, plan: Plan, gpu: DeviceSpec | None) -> Bench:
    """An A/B's sessions on the fleet's workers, which must share one GPU and environment
    (one_kind): the plan, its GPU theirs, checked on one of them where the paths and the device
    are the workers'."""
    worker = one_kind(fleet, plan.device, gpu)
    plan = replace(plan, gpu=worker["gpu"])
    check_on_worker(fleet, check_plan, plan)
    return Bench(plan, worker["env"],
                 lambda plan, indices, on_session: ab(fleet, plan, indices, on_session))


def check_on_worker(fleet: Fleet, check: Callable, *args) -> None:
    """`check(*args)` on one GPU worker, where the paths and the device are the worker's; its
    error as one line."""
    address = fleet.wait_for_gpus()[0]
    error = fleet.client.run(check, *args, workers=[address], on_error="return")[address]
    if isinstance(error, BaseException):
        raise FloorlineError(one_line(error))
