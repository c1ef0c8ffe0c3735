"""Which interfaces a TensorFlow server of a parameter-server cluster listens on.

TensorFlow's gRPC server binds its port on every interface whatever TF_CONFIG's host
(``grpc_server_lib.cc`` asks gRPC for ``0.0.0.0:<port>``, which gRPC widens to IPv6's ``[::]``),
and has no setting to bind one address; the tf.data service's servers take a port only. So a
task reads, once its server is up, the addresses its port listens on (``listening_addresses``:
Linux's /proc/net/tcp and tcp6), and ``check_listening`` says what that opens beyond the task's
TF_CONFIG address: an error for a loopback task (``retrieval.training.cluster`` stops with it
unless ``--allow-all-interfaces``), else a warning naming the port.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from pathlib import Path

ALLOW_ALL_INTERFACES = "--allow-all-interfaces"
PROC_TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp*
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

log = logging.getLogger("retrieval.training.interfaces")


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


def check_listening(task: str, task_address: str, allow_all_interfaces: bool) -> str | None:
    """After ``task``'s server started on ``task_address``'s port: the error to stop with (the caller
    raises it) when TF_CONFIG gives it a loopback address and it listens beyond loopback, unless
    ``allow_all_interfaces``; otherwise None, after a warning naming the port for any exposure (or
    saying that none can be checked)."""
    port = int(task_address.rsplit(":", 1)[1])
    listening = listening_addresses(port)
    if listening is None:
        log.warning("%s: cannot read /proc/net/tcp to check which interfaces port %d listens on; TensorFlow's "
                    "gRPC server binds every interface: keep the port closed to other machines", task, port)
        return None
    problem = exposure(task_address, listening)
    if problem is None:
        return None
    why = ("TensorFlow's gRPC server binds every interface and has no setting to bind one address; "
           "it runs any op a peer sends, unauthenticated")
    if _is_loopback_host(task_address.rsplit(":", 1)[0]) and not allow_all_interfaces:
        return (f"{task} {problem}: {why}. Close port {port} to other machines (a firewall) and "
                f"start the task with {ALLOW_ALL_INTERFACES}, or run it where its network is private")
    log.warning("%s %s: %s; keep port %d closed to other machines (a firewall)", task, problem, why, port)
    return None
