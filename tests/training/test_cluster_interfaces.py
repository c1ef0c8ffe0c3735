"""Which interfaces a parameter-server task listens on (``retrieval.training.interfaces``, ``cluster``).

TensorFlow's gRPC server binds every interface whatever TF_CONFIG's host; a task given a loopback
address refuses to serve so (one line, status 2) unless started with ``--allow-all-interfaces``,
and then warns. The /proc/net/tcp reader is checked on tables written by hand, the refusal on a
real task, and what it reports against an independent test: binding the same port on another
loopback address (127.0.0.2) fails exactly when the task holds the port on every interface.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrieval.training.interfaces import exposure, listening_addresses

ROOT = Path(__file__).resolve().parents[2]
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _row(local: str, state: str = "0A") -> str:
    return f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000  1000        0 1 1\n"


@pytest.mark.skipif(sys.byteorder != "little", reason="the hand-written tables are a little-endian kernel's")
def test_listening_addresses_reads_the_kernels_tables(tmp_path):
    # Port 8000 = 0x1F40; 127.0.0.1 is printed 0100007F, ::ffff:127.0.0.1 as four host-order words.
    (tmp_path / "tcp").write_text(HEADER + _row("0100007F:1F40") + _row("00000000:1F40", "01")
                                  + _row("0101A8C0:1F41") + _row("00000000:1F40"))
    (tmp_path / "tcp6").write_text(HEADER + _row("00000000000000000000000000000000:1F40")
                                   + _row("00000000000000000000000001000000:1F40")
                                   + _row("0000000000000000FFFF00000100007F:1F40"))
    tables = (tmp_path / "tcp", tmp_path / "tcp6")
    assert listening_addresses(8000, tables) == {ipaddress.ip_address(a) for a in
                                                 ("127.0.0.1", "0.0.0.0", "::", "::1", "::ffff:127.0.0.1")}
    assert listening_addresses(8001, tables) == {ipaddress.ip_address("192.168.1.1")}
    assert listening_addresses(8002, tables) == set()
    assert listening_addresses(8000, (tmp_path / "missing",)) is None


@pytest.mark.parametrize(
    "task, listening, wider",
    [
        ("127.0.0.1:8000", ["127.0.0.1"], None),
        ("localhost:8000", ["::1", "::ffff:127.0.0.1", "127.0.0.1"], None),
        ("127.0.0.1:8000", ["::"], "listens on :: (every interface) although TF_CONFIG gives it 127.0.0.1:8000"),
        ("localhost:8000", ["0.0.0.0", "127.0.0.1"], "listens on 0.0.0.0 (every interface)"),
        ("127.0.0.1:8000", ["192.168.1.1"], "listens on 192.168.1.1 although"),
        ("10.0.0.5:8000", ["10.0.0.5"], None),
        ("10.0.0.5:8000", ["::"], "listens on :: (every interface) although TF_CONFIG gives it 10.0.0.5:8000"),
        ("ps-0.cluster:8000", ["10.0.0.5"], None),
        ("ps-0.cluster:8000", ["0.0.0.0"], "listens on 0.0.0.0 (every interface)"),
    ],
)
def test_exposure_names_what_listens_beyond_the_task_address(task, listening, wider):
    found = exposure(task, {ipaddress.ip_address(address) for address in listening})
    assert (found is None) if wider is None else (found is not None and found.startswith(wider))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _task(port: int, *flags: str) -> subprocess.Popen:
    config = {"cluster": {"chief": [f"127.0.0.1:{_free_port()}"], "ps": [f"127.0.0.1:{port}"]},
              "task": {"type": "ps", "index": 0}}
    environment = {**os.environ, "TF_CONFIG": json.dumps(config), "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "retrieval.training.cluster", *flags], cwd=ROOT, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _held_on_every_interface(port: int) -> bool:
    """Whether another loopback address cannot bind ``port``: true when something holds it on 0.0.0.0 or ::."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.2", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
def test_a_loopback_task_listening_on_every_interface_stops_unless_allowed():
    port = _free_port()
    allowed = _task(port, "--allow-all-interfaces")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert allowed.poll() is None, allowed.communicate()[1][-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the task never listened"
                time.sleep(0.2)
        time.sleep(1.0)  # the check runs right after the server starts: its warning is written by now
        everywhere = _held_on_every_interface(port)
        reported = exposure(f"127.0.0.1:{port}", listening_addresses(port) or set())
        assert (reported is not None) == everywhere, reported
    finally:
        allowed.kill()
        _, allowed_log = allowed.communicate()
    if everywhere:
        assert f"keep port {port} closed to other machines" in allowed_log, allowed_log[-3000:]
    refused = _task(port)
    try:
        out, err = refused.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        refused.kill()
        out, err = refused.communicate()
        assert not everywhere, "a task listening on every interface kept serving without --allow-all-interfaces"
        return  # TensorFlow bound loopback only: nothing to refuse
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert everywhere and refused.returncode == 2, err[-3000:]
    assert len(ours) == 1 and f"although TF_CONFIG gives it 127.0.0.1:{port}" in ours[0], err[-3000:]
    assert "--allow-all-interfaces" in ours[0] and "(every interface)" in ours[0]


CHIEF = """
import logging, os, socket, sys, errno
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s: %(message)s")
from pipelines.local_cluster import LocalCluster
with LocalCluster(1, 1) as cluster:
    os.environ["TF_CONFIG"] = cluster.tf_config("chief", 0)
    import retrieval
    from retrieval.config import ParameterServerConfig
    from retrieval.training.parameter_server import cluster_strategy
    from retrieval.training.worker_input import data_dispatcher
    cluster_strategy([(10, 4), (10, 4)], ParameterServerConfig())
    data_dispatcher(cluster.data_dispatcher_port)
    for port in (int(cluster.cluster["chief"][0].rsplit(":", 1)[1]), cluster.data_dispatcher_port):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.2", port))
                print("loopback-only", port)
            except OSError as error:
                assert error.errno == errno.EADDRINUSE
                print("every-interface", port)
"""


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
def test_the_chief_and_its_data_dispatcher_warn_when_they_listen_on_every_interface():
    """The chief's own gRPC server (started by the strategy) and the tf.data dispatcher bind every
    interface too; the chief keeps training (a warning, not an error) and names each port."""
    done = subprocess.run([sys.executable, "-c", CHIEF], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    found = [line.split() for line in lines if line.split()[0] in ("every-interface", "loopback-only")]
    assert len(found) == 2, lines
    for (how, port), who in zip(found, ("TF_CONFIG task chief 0", "the tf.data dispatcher")):
        warned = [line for line in lines if f"keep port {port} closed to other machines" in line]
        assert len(warned) == (how == "every-interface"), lines
        assert all(f"{who} listens on" in line for line in warned), warned
