"""A worker or ps task of a parameter-server cluster: ``python -m retrieval.training.cluster``.

Reads this process's task from TF_CONFIG (``{"cluster": {...}, "task": {"type": "worker"|"ps",
"index": i}}``), starts its ``tf.distribute.Server`` on the task's address and serves until
killed. A ``worker`` runs the training steps the chief schedules; a ``ps`` task holds its
shards of the variables (the ID tables' row ranges, the other variables whole). The chief runs
the job itself (``python -m pipelines.train`` with TF_CONFIG task type ``chief``);
``pipelines/local_cluster.py`` starts all of them on one machine. With ``--data-dispatcher
HOST:PORT`` a worker also runs a tf.data worker, to read the training batches itself
(``train.parameter_server.input: workers``, ``retrieval.training.worker_input``).

Which interfaces a task listens on: TensorFlow's gRPC server binds its port on every interface
(``grpc_server_lib.cc`` asks gRPC for ``0.0.0.0:<port>``, which gRPC widens to IPv6's ``[::]`` too;
TF_CONFIG's host only names the task to its peers), and TensorFlow offers no setting to bind one
address. A task's server runs any op its peers send, unauthenticated. So after starting, a task
reads which addresses its port listens on (``listening_addresses``, from /proc/net/tcp and tcp6,
Linux) and, when TF_CONFIG gives it a loopback address but it listens beyond loopback, stops with
one line saying so, unless started with ``--allow-all-interfaces`` (``pipelines.local_cluster``
passes it, and warns): then it warns and serves. A task given a non-loopback address warns when it
listens on more than that address. Where /proc cannot be read it warns that it cannot check.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path

import tensorflow as tf

from retrieval.errors import entry_point
from retrieval.training.parameter_server import ClusterError, read_tf_config
from retrieval.training.worker_input import start_data_worker

TASK_KINDS = ("worker", "ps")
ALLOW_ALL_INTERFACES = "--allow-all-interfaces"
PROC_TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp*
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

log = logging.getLogger("retrieval.training.cluster")


def listening_addresses(port: int, tables: tuple[Path, ...] = PROC_TCP_TABLES) -> set[IPAddress] | None:
    """The local addresses on which a TCP socket listens on ``port``, read from ``tables`` (Linux's
    /proc/net/tcp and tcp6: the calling process's network namespace); None when none can be read.

    ``0.0.0.0`` and ``::`` mean every interface (of that family; ``::`` is usually dual-stack).
    """
    found: set[IPAddress] = set()
    read_any = False
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != _LISTEN or ":" not in fields[1]:
                continue
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(address)  # the address as the kernel prints it: 32-bit words in host order
            words = b"".join(raw[start : start + 4][::-1] for start in range(0, len(raw), 4))
            found.add(ipaddress.ip_address(words) if sys.byteorder == "little" else ipaddress.ip_address(raw))
    return found if read_any else None


def _is_loopback_host(host: str) -> bool:
    if host.strip("[]").lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_loopback_address(address: IPAddress) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def exposure(task_address: str, listening: set[IPAddress]) -> str | None:
    """What ``listening`` (``listening_addresses`` of the task's port) opens beyond ``task_address``
    (TF_CONFIG's ``host:port`` of the task), or None when it opens nothing more."""
    host = task_address.rsplit(":", 1)[0]
    if _is_loopback_host(host):
        wider = sorted(str(address) for address in listening if not _is_loopback_address(address))
    else:
        try:
            wider = sorted(str(address) for address in listening if address != ipaddress.ip_address(host.strip("[]")))
        except ValueError:  # a host name: only the unspecified addresses are certainly wider
            wider = sorted(str(address) for address in listening if address.is_unspecified)
    if not wider:
        return None
    every = " (every interface)" if any(ipaddress.ip_address(address).is_unspecified for address in wider) else ""
    return f"listens on {', '.join(wider)}{every} although TF_CONFIG gives it {task_address}"


def check_listening(task: str, task_address: str, allow_all_interfaces: bool) -> None:
    """After the task's server started: refuse (ClusterError) a loopback task listening beyond
    loopback unless ``allow_all_interfaces``; otherwise warn about any exposure, or that none can be checked."""
    port = int(task_address.rsplit(":", 1)[1])
    listening = listening_addresses(port)
    if listening is None:
        log.warning("%s: cannot read /proc/net/tcp to check which interfaces port %d listens on; TensorFlow's "
                    "gRPC server binds every interface: keep the port closed to other machines", task, port)
        return
    problem = exposure(task_address, listening)
    if problem is None:
        return
    why = ("TensorFlow's gRPC server binds every interface and has no setting to bind one address; "
           "it runs any op a peer sends, unauthenticated")
    if _is_loopback_host(task_address.rsplit(":", 1)[0]) and not allow_all_interfaces:
        raise ClusterError(f"{task} {problem}: {why}. Close port {port} to other machines (a firewall) and "
                           f"start the task with {ALLOW_ALL_INTERFACES}, or run it where its network is private")
    log.warning("%s %s: %s; keep port %d closed to other machines (a firewall)", task, problem, why, port)


def start_task() -> tf.distribute.Server:
    """Start this process's ``tf.distribute.Server`` (gRPC) for its TF_CONFIG task; it serves in the
    background until the process ends (``Server.join`` waits for that).

    Raises:
      ClusterError: TF_CONFIG is unset, or its task is not a worker or ps task of its cluster.
    """
    cluster, task = read_tf_config()
    kind, index = task.get("type"), int(task.get("index", 0))
    if kind not in TASK_KINDS:
        raise ClusterError(
            f"TF_CONFIG task type {kind!r}: python -m retrieval.training.cluster runs a worker or ps task; "
            "the chief runs the job (python -m pipelines.train)"
        )
    if not 0 <= index < len(cluster.get(kind, [])):
        raise ClusterError(f"TF_CONFIG task {kind} {index} is not in its cluster: {cluster}")
    return tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=kind, task_index=index, protocol="grpc", start=True
    )


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="retrieval.training.cluster",
        description="Run this process's TF_CONFIG worker or ps task of a parameter-server cluster until killed.",
    )
    parser.add_argument(ALLOW_ALL_INTERFACES, action="store_true",
                        help="serve although TF_CONFIG gives this task a loopback address and TensorFlow's gRPC "
                        "server listens on every interface (it cannot bind one): only with the port closed to "
                        "other machines; without it such a task stops with an error")
    parser.add_argument("--data-dispatcher", default=None, metavar="HOST:PORT",
                        help="a worker task also runs a tf.data worker registered with the chief's dispatcher "
                        "there, so it can read the training batches itself (train.parameter_server.input: "
                        "workers, data_dispatcher_port PORT); ignored by a ps task")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    server = start_task()
    cluster, task = read_tf_config()
    kind, index = task["type"], int(task.get("index", 0))
    check_listening(f"TF_CONFIG task {kind} {index}", cluster[kind][index], args.allow_all_interfaces)
    if args.data_dispatcher and read_tf_config()[1].get("type") == "worker":
        start_data_worker(args.data_dispatcher)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
