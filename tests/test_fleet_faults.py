"""A --cluster that cannot be used ends in one line, within a stated timeout, never a traceback:
a malformed address before any connection, a closed port, an unknown host, a listener that never
answers, and a scheduler that no worker with a GPU joins."""

import contextlib
import socket
import threading
import time

import pytest

from conftest import run_cli

distributed = pytest.importorskip("distributed")

TIMEOUT_S = 2  # the connect timeout and the wait for workers of each run here
SLACK_S = 15  # the command's own start on a slow machine, beyond the timeout
SWEEP = ("sweep", "--device", "cpu", "--gpu", "l4", "--models", "tiny-llama", "--ctx", "16",
         "--paths", "hf-eager")
AB = ("ab", "--device", "cpu", "--gpu", "l4", "--a", "hf-eager", "--b", "hf-static", "--model",
      "tiny-llama", "--ctx", "16", "--sessions", "1", "--steps", "1", "--block", "1",
      "--warmup", "0")
RETRY = "FLOORLINE_CONNECT_TIMEOUT=SECONDS sets how long to try"


def refused(tmp_path, cluster: str, command=SWEEP, connects=False) -> tuple[str, str, float]:
    """`floorline COMMAND --cluster CLUSTER` with the short timeouts: its error line (without the
    prefix), all of stderr and the seconds it took; checks that it ended in that error, exit
    code 2, without a traceback, and unless it `connects`, before making a database (a sweep
    records its run once connected)."""
    db = tmp_path / "r.db"
    start = time.monotonic()
    proc = run_cli(*command, "--cluster", cluster, "--db", db, timeout=120,
                   env={"FLOORLINE_CONNECT_TIMEOUT": str(TIMEOUT_S),
                        "FLOORLINE_WORKER_TIMEOUT": str(TIMEOUT_S)})
    elapsed = time.monotonic() - start
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert lines[-1].startswith("floorline: error: "), proc.stderr
    assert connects or not db.exists()
    return lines[-1].removeprefix("floorline: error: "), proc.stderr, elapsed


def one_line(stderr: str) -> None:
    assert len([line for line in stderr.splitlines() if line.strip()]) == 1, stderr


@pytest.mark.parametrize("cluster", ["tcp://", "tcp://127.0.0.1:abc", "tcp://[::1"])
def test_a_malformed_address_is_refused_before_connecting(tmp_path, cluster):
    line, stderr, elapsed = refused(tmp_path, cluster)
    one_line(stderr)
    assert line == ("--cluster must be 'local-cuda' or a Dask scheduler's address "
                    "(tcp://HOST:PORT), or tls://HOST:PORT with Dask's TLS settings; an IPv6 HOST "
                    f"goes in brackets (tcp://[::1]:8786); got '{cluster}'")
    assert elapsed < SLACK_S


@pytest.mark.parametrize("cluster", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:65536", "127.0.0.1:8786",
                                     "tcp://127.0.0.1", "tcp://[::g]:8786", "tcp://a b:1",
                                     "udp://127.0.0.1:8786", "tcp://127.0.0.1:8786/x"])
def test_check_cluster_refuses_every_other_form(cluster):
    from floorline.errors import FloorlineError
    from floorline.measure.fleet import check_cluster

    with pytest.raises(FloorlineError, match="must be 'local-cuda' or a Dask scheduler's"):
        check_cluster(cluster)


@pytest.mark.parametrize("cluster", ["local-cuda", "tcp://127.0.0.1:8786", "tcp://[::1]:8786",
                                     "tcp://node-7.cluster.example:8786", "tcp://gpu_node:1"])
def test_check_cluster_takes_a_scheduler_address(cluster):
    from floorline.measure.fleet import check_cluster

    assert check_cluster(cluster) == cluster


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
@pytest.mark.parametrize("variable", ["FLOORLINE_CONNECT_TIMEOUT", "FLOORLINE_WORKER_TIMEOUT"])
def test_a_timeout_from_the_environment_is_checked_at_once(monkeypatch, variable, value):
    from floorline.errors import FloorlineError
    from floorline.measure.fleet import check_cluster

    monkeypatch.setenv(variable, value)
    with pytest.raises(FloorlineError) as e:
        check_cluster("tcp://127.0.0.1:8786")
    assert str(e.value) == f"{variable} must be a number of seconds above 0, got '{value}'"


def test_tls_without_tls_settings_is_refused_before_connecting(tmp_path):
    line, stderr, elapsed = refused(tmp_path, "tls://127.0.0.1:1")
    one_line(stderr)
    assert line == ("--cluster tls://127.0.0.1:1: a tls:// address needs Dask's TLS settings for "
                    "a client (distributed.comm.tls.ca-file, .client.cert and .client.key in "
                    "Dask's configuration), and none are set")
    assert elapsed < SLACK_S


def closed_port() -> int:
    """A loopback port that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_closed_port_is_refused_within_the_connect_timeout(tmp_path):
    cluster = f"tcp://127.0.0.1:{closed_port()}"
    line, stderr, elapsed = refused(tmp_path, cluster)
    one_line(stderr)
    assert line == (f"cannot reach the Dask scheduler at {cluster}: connection refused (nothing "
                    f"listens on that port), tried for {TIMEOUT_S} s; {RETRY}")
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S


def test_an_unknown_host_is_refused_within_the_connect_timeout(tmp_path):
    cluster = "tcp://no-such-host.invalid:8786"  # .invalid: never a host's name (RFC 6761)
    line, stderr, elapsed = refused(tmp_path, cluster)
    one_line(stderr)
    assert line.startswith(f"cannot reach the Dask scheduler at {cluster}: cannot look up the "
                           "host 'no-such-host.invalid' (")
    assert line.endswith(f"), tried for {TIMEOUT_S} s; {RETRY}")
    assert elapsed < TIMEOUT_S + SLACK_S


def test_a_resolver_that_never_answers_is_refused_within_the_connect_timeout(monkeypatch):
    """A resolver whose queries a firewall drops: the lookup alone outlasts the timeout."""
    from floorline.errors import FloorlineError
    from floorline.measure import fleet

    answered = threading.Event()

    def dropped(*args, **kwargs):  # as glibc's resolver, once its retries are spent
        answered.wait(60)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    monkeypatch.setattr(socket, "getaddrinfo", dropped)
    cluster = "tcp://scheduler.example:8786"
    start = time.monotonic()
    try:
        with pytest.raises(FloorlineError) as refusal:
            fleet.reach(cluster, fleet.security(cluster), TIMEOUT_S)
        elapsed = time.monotonic() - start
    finally:
        answered.set()
    assert str(refusal.value) == (f"cannot reach the Dask scheduler at {cluster}: cannot look up "
                                  f"the host 'scheduler.example' (the resolver did not answer in "
                                  f"{TIMEOUT_S} s); {RETRY}")
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1


@pytest.fixture
def silent():
    """The address of a loopback listener that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for s in [*held, server]:
        s.close()


def test_a_listener_that_never_answers_is_refused_within_the_connect_timeout(tmp_path, silent):
    # ab's connection here, the sweep's to a closed port: both are made by Fleet
    line, stderr, elapsed = refused(tmp_path, silent, AB)
    one_line(stderr)
    assert line == (f"cannot reach the Dask scheduler at {silent}: something accepts connections "
                    f"there but did not answer as a Dask scheduler in {TIMEOUT_S} s; {RETRY}")
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S


@pytest.fixture
def no_gpu(request):
    """A scheduler, in this process, with no worker or one without a GPU resource (the
    parameter: how many)."""
    with distributed.LocalCluster(n_workers=request.param, processes=False, protocol="tcp",
                                  host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster:
        yield cluster.scheduler_address, request.param


# Each census and each command once: both commands wait in the same Fleet.wait_for_gpus
@pytest.mark.parametrize("no_gpu, command", [(0, SWEEP), (1, AB)], indirect=["no_gpu"],
                         ids=["no-workers-sweep", "a-worker-without-a-gpu-ab"])
def test_a_scheduler_without_gpu_workers_is_waited_on_for_the_stated_time(tmp_path, no_gpu,
                                                                          command):
    address, workers = no_gpu
    census = f"it has {workers} worker(s), none with a GPU resource" if workers else \
        "it has no workers"
    line, stderr, elapsed = refused(tmp_path, address, command, connects=True)
    assert (f"waiting up to {TIMEOUT_S} s for a Dask worker with a GPU resource to join the "
            f"scheduler at {address} ({census}; FLOORLINE_WORKER_TIMEOUT=SECONDS sets how long "
            "to wait)\n") in stderr
    assert line == (f"no Dask worker with a GPU resource joined the scheduler at {address} in "
                    f"{TIMEOUT_S} s ({census}): start each worker with `--resources GPU=1`; "
                    "FLOORLINE_WORKER_TIMEOUT=SECONDS sets how long to wait")
    assert TIMEOUT_S <= elapsed < 2 * TIMEOUT_S + SLACK_S  # connected, then waited


def test_tls_settings_that_cannot_be_read_are_refused_before_connecting(tmp_path):
    import dask

    from floorline.errors import FloorlineError
    from floorline.measure.fleet import check_cluster

    missing = str(tmp_path / "missing.pem")
    with dask.config.set({"distributed.comm.tls.ca-file": missing,
                          "distributed.comm.tls.client.cert": missing}):
        with pytest.raises(FloorlineError, match="^Dask's TLS settings cannot be used: "):
            check_cluster("tls://127.0.0.1:8786")
