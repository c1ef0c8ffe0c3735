"""A parameter-server cluster on this machine:
``python -m pipelines.local_cluster [--workers 2] [--ps 2] -- <pipelines.train flags>``.

Picks free localhost ports, starts each worker and ps task as a subprocess
(``python -m retrieval.training.cluster`` with its TF_CONFIG), waits until they listen, runs the
chief (``python -m pipelines.train <flags> --set train.distribute=parameter_server`` with TF_CONFIG
task type ``chief``) and stops the tasks when the chief ends, fails or is interrupted (Ctrl-C,
SIGTERM). The exit status is the chief's. ``--rss-report FILE`` writes each task's peak resident
memory (the chief's from its rusage, each worker's and ps task's VmHWM just before they are
stopped) as JSON; ``--worker-memory-limit BYTES`` caps each worker's data segment
(``RLIMIT_DATA``), to show a worker needs none of the tables' memory.

On several machines the same processes run one a host: every task gets the one cluster in its
TF_CONFIG and its own ``task``; the chief reads the data and feeds the batches.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

TASK_KINDS = ("worker", "ps")


def free_port(host: str = "localhost") -> int:
    """A port nothing listens on now (bound and released: another process may take it meanwhile)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In a task, before it runs: SIGKILL when the process that started it ends (Linux), so a
    launcher killed with SIGKILL leaves no task behind."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# A memory-capped task's thread stack size: RLIMIT_DATA counts each thread's stack, and a TensorFlow
# task runs about 100 threads, 8 MiB each by default (RLIMIT_STACK), 800 MiB of its data segment.
CAPPED_STACK_BYTES = 2 << 20


def _task_setup(data_limit: int | None):
    """The ``preexec_fn`` of a task: ``_die_with_parent`` and, given ``data_limit`` (bytes), that cap
    on its data segment (``RLIMIT_DATA``: heap and private writable mappings, thread stacks among
    them, which shrink to ``CAPPED_STACK_BYTES``; ``RLIMIT_AS`` would count TensorFlow's large
    virtual reservations of shared libraries too)."""

    def setup() -> None:
        _die_with_parent()
        if data_limit is not None:
            stack_hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
            resource.setrlimit(resource.RLIMIT_STACK, (CAPPED_STACK_BYTES, stack_hard))
            resource.setrlimit(resource.RLIMIT_DATA, (data_limit, data_limit))

    return setup


def peak_rss_bytes(pid: int) -> int | None:
    """Peak resident memory of the running process ``pid`` (``VmHWM`` of /proc/<pid>/status, Linux), in
    bytes; None where it cannot be read (no /proc, the process has ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return None if line is None else int(line.split()[1]) * 1024  # "VmHWM:   1234 kB"


class LocalCluster:
    """``workers`` worker tasks and ``ps`` ps tasks as subprocesses on free localhost ports, plus the
    chief's address, one ``cluster`` (``{"chief": [...], "worker": [...], "ps": [...]}``).

    A context manager: ``start`` on entry, ``stop`` (every task killed) on exit. ``kill`` and
    ``restart`` one task (at the same address) to try the cluster's fault tolerance. On Linux a
    task also dies with the process that started it.
    ``log_dir``: each task's output goes to ``<log_dir>/<kind>-<index>.log``; None = this process's.
    ``worker_memory_limit``: each worker's ``RLIMIT_DATA`` in bytes (None: none).
    """

    def __init__(self, workers: int = 2, ps: int = 2, host: str = "localhost", log_dir: str | Path | None = None,
                 worker_memory_limit: int | None = None):
        if workers < 1 or ps < 1:
            raise ValueError(f"a parameter-server cluster needs a worker and a ps task, got {workers} and {ps}")
        self.cluster = {
            "chief": [f"{host}:{free_port(host)}"],
            "worker": [f"{host}:{free_port(host)}" for _ in range(workers)],
            "ps": [f"{host}:{free_port(host)}" for _ in range(ps)],
        }
        # The chief's tf.data dispatcher (train.parameter_server.input: workers): each worker registers a
        # tf.data worker with it, which idles unless a run's workers read the batches.
        self.data_dispatcher_port = free_port(host)
        self.data_dispatcher = f"{host}:{self.data_dispatcher_port}"
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.worker_memory_limit = worker_memory_limit
        self.tasks: dict[tuple[str, int], subprocess.Popen] = {}
        self._logs: dict[tuple[str, int], IO[bytes]] = {}

    def tf_config(self, kind: str, index: int = 0) -> str:
        """The TF_CONFIG of task ``kind`` ``index``: the cluster and that task."""
        return json.dumps({"cluster": self.cluster, "task": {"type": kind, "index": index}})

    def environment(self, kind: str, index: int = 0) -> dict[str, str]:
        """This process's environment with that task's TF_CONFIG."""
        return {**os.environ, "TF_CONFIG": self.tf_config(kind, index)}

    def start(self, timeout: float = 120.0) -> LocalCluster:
        """Start every worker and ps task and wait until each listens (RuntimeError if one exits)."""
        for kind in TASK_KINDS:
            for index in range(len(self.cluster[kind])):
                self.start_task(kind, index, wait=False)
        for key in self.tasks:
            self._wait_listening(*key, timeout=timeout)
        return self

    def start_task(self, kind: str, index: int, *, wait: bool = True, timeout: float = 120.0) -> None:
        """Start task ``kind`` ``index`` (again, at its address, after ``kill``)."""
        output: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = self._logs.get((kind, index)) or open(self.log_dir / f"{kind}-{index}.log", "ab")  # noqa: SIM115
            self._logs[(kind, index)] = output
        self.tasks[(kind, index)] = subprocess.Popen(
            # Every task listens on every interface, whatever its localhost address (TensorFlow's gRPC
            # server cannot bind one): allowed here, and each task logs a warning naming its port.
            [sys.executable, "-m", "retrieval.training.cluster", "--allow-all-interfaces",
             *(["--data-dispatcher", self.data_dispatcher] if kind == "worker" else [])],
            env=self.environment(kind, index), stdout=output, stderr=output,
            preexec_fn=_task_setup(self.worker_memory_limit if kind == "worker" else None),
        )
        if wait:
            self._wait_listening(kind, index, timeout)

    def _wait_listening(self, kind: str, index: int, timeout: float) -> None:
        host, port = self.cluster[kind][index].rsplit(":", 1)
        deadline = time.monotonic() + timeout
        process = self.tasks[(kind, index)]
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"cluster task {kind} {index} exited with status {process.returncode}")
            try:
                with socket.create_connection((host, int(port)), timeout=1.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster task {kind} {index} does not listen on {host}:{port} "
                                       f"after {timeout:.0f} s") from None
                time.sleep(0.2)

    def kill(self, kind: str, index: int) -> None:
        """SIGKILL task ``kind`` ``index`` and wait for it."""
        process = self.tasks[(kind, index)]
        process.kill()
        process.wait()

    def restart(self, kind: str, index: int) -> None:
        """Kill task ``kind`` ``index`` and start it again at the same address."""
        self.kill(kind, index)
        self.start_task(kind, index)

    def peak_rss(self) -> dict[str, int | None]:
        """Each running task's peak resident memory so far (``peak_rss_bytes``), keyed ``<kind>-<index>``."""
        return {f"{kind}-{index}": peak_rss_bytes(process.pid) for (kind, index), process in self.tasks.items()}

    def stop(self) -> None:
        """Terminate every task (SIGKILL after 5 s) and close their logs."""
        for process in self.tasks.values():
            if process.poll() is None:
                process.terminate()
        for process in self.tasks.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for output in self._logs.values():
            output.close()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


def run_chief(cluster: LocalCluster, train_args: Sequence[str], usage: dict[str, int] | None = None) -> int:
    """``python -m pipelines.train <train_args> --set train.distribute=parameter_server`` (and the
    cluster's ``train.parameter_server.data_dispatcher_port``) as the chief; its exit status. Given
    ``usage``, its ``"chief"`` is set to the chief's peak RSS in bytes."""
    command = [sys.executable, "-m", "pipelines.train", *train_args, "--set", "train.distribute=parameter_server",
               "--set", f"train.parameter_server.data_dispatcher_port={cluster.data_dispatcher_port}"]
    chief = subprocess.Popen(command, env=cluster.environment("chief"))
    try:
        _, status, rusage = os.wait4(chief.pid, 0)
        chief.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        if usage is not None:
            usage["chief"] = rusage.ru_maxrss * 1024  # kB on Linux
        return chief.returncode
    except BaseException:  # Ctrl-C reaches the chief too (same process group); SIGTERM only us
        chief.terminate()
        try:
            chief.wait(timeout=30)
        except subprocess.TimeoutExpired:
            chief.kill()
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipelines.local_cluster",
        description="Train with train.distribute: parameter_server on a cluster of local processes. "
        "Flags after -- go to pipelines.train.",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker tasks (run the steps; default 2)")
    parser.add_argument("--ps", type=int, default=2, help="ps tasks (hold the ID tables' shards; default 2)")
    parser.add_argument("--task-logs", default=None, metavar="DIR",
                        help="write each task's output to DIR/<kind>-<index>.log (default: this terminal)")
    parser.add_argument("--rss-report", default=None, metavar="FILE",
                        help="write each task's peak RSS in bytes as JSON ({\"chief\": .., \"worker-0\": .., "
                        "\"ps-0\": ..}), read when the chief has ended, before the tasks are stopped")
    parser.add_argument("--worker-memory-limit", type=int, default=None, metavar="BYTES",
                        help="cap each worker's data segment (RLIMIT_DATA) at BYTES (default: none)")
    return parser


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    if args.workers < 1 or args.ps < 1:
        _parser().error("--workers and --ps must be at least 1")
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        with LocalCluster(args.workers, args.ps, log_dir=args.task_logs,
                          worker_memory_limit=args.worker_memory_limit) as cluster:
            print(f"local cluster: {json.dumps(cluster.cluster)}", file=sys.stderr, flush=True)
            usage: dict[str, int] = {}
            status = run_chief(cluster, train_args, usage)
            if args.rss_report is not None:
                report = {**usage, **cluster.peak_rss()}
                Path(args.rss_report).parent.mkdir(parents=True, exist_ok=True)
                Path(args.rss_report).write_text(json.dumps(report, indent=2) + "\n")
            return status
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
