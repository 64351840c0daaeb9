"""What a sandboxed worker is cut off from, and the launcher that cuts it off.

Every rl.sandbox worker starts as `python -m rl.isolation SPEC MODULE FD`, a fresh
single-threaded interpreter (the kernel refuses a user namespace to a threaded process, and
nothing here may run in the driver's threaded process: no `preexec_fn`). The launcher:

1. leaves the host's namespaces: network (no interface but a loopback, down unless the pool
   asks for it: an agent function reaches its endpoint through it, rl.agents.agent_worker), mounts,
   processes (a pid namespace: the worker is its pid 1, sees only its own descendants in a
   fresh /proc, and every one of them dies with it) and System V IPC. As root that takes no
   more than `unshare`; as another user it also takes a user namespace mapping only that
   user's own uid and gid.
2. forks the worker (pid 1 of the new pid namespace) and stays as its parent, outside: it
   passes on the worker's exit, and kills it when the driver dies.
3. in the worker, as long as it is still privileged: makes the host's filesystem read-only
   and puts one size-capped tmpfs (`tmp_mb`) under HOME, /tmp, /var/tmp and /dev/shm, so that
   the driver's home (tokens, ~/.netrc) is out of sight and whatever the worker writes is
   bounded. Where HOME or a directory the worker cannot cross hides what it needs (the
   interpreter, the virtual environment, `sys.path`, the user's files), those are bound back
   read-only.
4. drops privilege: as root, to uid and gid `SANDBOX_UID` (nobody) with no supplementary
   groups, so that it holds no capability and owns no host file even when Tandem runs as
   root; as another user, every capability of its user namespace. Then no_new_privs, a
   parent-death signal, the address-space, file-size and core limits, and (as root) a
   process-count limit for the sandbox uid.
5. reports what it got (`Isolation`, JSON) as the first message on the connection at FD,
   refuses to go on if `require` is set and anything is missing, and runs MODULE as
   `__main__` with FD as its argument.

Where the kernel refuses namespaces (Docker's default seccomp profile refuses `unshare`, some
distributions refuse user namespaces to unprivileged users) the worker still runs, in its own
session with the limits, a clean environment and HOME and TMPDIR in a private directory, and
its report says what is missing and why.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import runpy
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

SANDBOX_UID = 65534  # nobody / nogroup on Debian, Ubuntu, Fedora and Alpine
MAX_PROCESSES = 1024  # RLIMIT_NPROC of the sandbox uid: every sandbox of the host shares it
WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")  # host directories anyone may write into

_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 0x4000, 1 << 18
_MOUNT_ATTR_RDONLY = 1
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_SYS_MOUNT_SETATTR = 442  # the same number on x86-64 and arm64 (a syscall added in 5.12)
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP = 1, 4, 38, 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 1
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Limits:
    """What a pool asks of its workers' sandbox: the address-space limit (MiB, 0: none), the
    size of the private writable tmpfs (MiB), and whether to refuse to run without full
    isolation (`sandbox.require`)."""

    memory_mb: int
    tmp_mb: int
    require: bool = False


@dataclass(frozen=True)
class Isolation:
    """What a sandboxed worker got. `user`: "uid 65534" (started as root, dropped to the
    sandbox uid), "user namespace" (the driver's own uid, no capabilities) or "" (the driver's
    user, as is). `missing`: why each part that is not there is not."""

    network: bool = False  # own network namespace, no interface up but (`loopback`) its own lo
    loopback: bool = False  # that namespace's loopback is up
    user: str = ""
    processes: bool = False  # own pid namespace and /proc; its processes die with it
    filesystem: bool = False  # read-only host, private size-capped HOME, /tmp, /dev/shm
    tmp_mb: int = 0  # the private tmpfs's size (0: no tmpfs, a private directory instead)
    missing: tuple[str, ...] = field(default=())

    @property
    def full(self) -> bool:
        return self.network and bool(self.user) and self.processes and self.filesystem

    def summary(self) -> str:
        """One line for the console and `--dry-run` (memory limits are the pools' to say)."""
        parts = [
            "network "
            + (
                ("isolated, own loopback only" if self.loopback else "isolated")
                if self.network
                else "NOT isolated"
            ),
            f"user {self.user or 'NOT dropped (the driver user)'}",
            f"processes {'own pid namespace' if self.processes else 'own session only'}",
            "filesystem "
            + (
                f"read-only host, private HOME and /tmp ({self.tmp_mb} MiB)"
                if self.filesystem
                else "NOT isolated (private HOME and TMPDIR variables only)"
            ),
        ]
        head = "fully isolated" if self.full else "PARTLY isolated"
        tail = f" (missing: {'; '.join(self.missing)})" if self.missing else ""
        return f"{head}: {', '.join(parts)}{tail}"

    def to_json(self) -> dict:
        return {**asdict(self), "missing": list(self.missing)}

    @classmethod
    def from_json(cls, data: object) -> Isolation:
        """The report a worker sent; ValueError when it is not one."""
        if not isinstance(data, dict) or set(data) != {f for f in cls.__dataclass_fields__}:
            raise ValueError(f"not an isolation report: {str(data)[:200]!r}")
        missing = data["missing"]
        if not (isinstance(missing, list) and all(isinstance(m, str) for m in missing)):
            raise ValueError(f"not an isolation report: {str(data)[:200]!r}")
        return cls(**{**data, "missing": tuple(missing)})


@dataclass(frozen=True)
class Spec:
    """What the driver hands the launcher (as JSON): the limits, the files and directories the
    worker must read (users' code, an endpoint's socket), and whether its network namespace's
    loopback is brought up."""

    limits: Limits
    read_paths: tuple[str, ...]
    loopback: bool = False

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "read_paths": list(self.read_paths)})

    @classmethod
    def from_json(cls, text: str) -> Spec:
        data = json.loads(text)
        return cls(Limits(**data["limits"]), tuple(data["read_paths"]), data["loopback"])


class _Report:
    """The isolation being built up, part by part."""

    def __init__(self) -> None:
        self.parts: dict = {}
        self.missing: list[str] = []

    def lacks(self, what: str, error: BaseException | int) -> None:
        cause = os.strerror(error) if isinstance(error, int) else str(error)
        self.missing.append(f"{what}: {cause}")

    def isolation(self) -> Isolation:
        return Isolation(**self.parts, missing=tuple(self.missing))


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _LIBC.mount(encode(source), target.encode(), encode(fstype), flags, encode(data or None)),
        f"mount {target}",
    )


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clr", "propagation", "userns_fd")]


def _read_only_host() -> None:
    """Make every mount of this (private) mount namespace read-only. Mounts made later (the
    tmpfs, the binds) are not affected."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(
        _LIBC.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, b"/", _AT_RECURSIVE, ctypes.byref(attr), 32),
        "mount_setattr / read-only",
    )


def _unshare(report: _Report) -> bool:
    """Leave the host's namespaces; True when this process got new mount, network, pid and
    IPC namespaces (the pid namespace applies to the next child)."""
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC
    if os.geteuid() == 0:
        if _LIBC.unshare(flags) == 0:
            return True
        report.lacks("namespaces (unshare as root)", ctypes.get_errno())
        return False
    uid, gid = os.geteuid(), os.getegid()
    if _LIBC.unshare(_CLONE_NEWUSER | flags) != 0:
        report.lacks("namespaces (unshare of a user namespace)", ctypes.get_errno())
        return False
    # Without these maps the process would be "nobody" inside its namespace, unable to mount.
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        Path(f"/proc/self/{name}").write_text(text)
    return True


def _blocking_dir(path: Path, uid: int) -> Path | None:
    """The first directory on the way to `path` that `uid` (without capabilities or groups)
    cannot cross, if any: one not searchable by others, nor owned by `uid` and searchable."""
    for directory in [*reversed(path.parents)][1:]:
        st = directory.stat()
        if not st.st_mode & (stat.S_IXUSR if st.st_uid == uid else stat.S_IXOTH):
            return directory
    return None


def _needed_paths(spec: Spec) -> list[Path]:
    """What the worker must read: the interpreter, the virtual environment, `sys.path` (the
    repository, PYTHONPATH roots, site-packages) and the users' files, resolved."""
    paths = [sys.base_prefix, sys.prefix, *filter(None, sys.path), *spec.read_paths]
    return [Path(p).resolve() for p in dict.fromkeys(paths) if os.path.exists(p)]


def _private_filesystem(spec: Spec, uid: int, gid: int, home: Path) -> None:
    """Step 3 of the module's docstring, privileged, in the new mount namespace. An OSError
    before anything is hidden leaves the host's view as it was (mount_setattr is atomic); one
    after it is a broken sandbox, which `main` reports as a failed start."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the host
    needed = _needed_paths(spec)
    writable = [Path(d).resolve() for d in WRITABLE if os.path.isdir(d)]
    # Directories hidden: the writable ones (under the tmpfs), HOME, and any directory the
    # worker could not cross to reach what it needs (/root is 0700). What it needs under them
    # is bound back.
    cover = {home} if home.is_dir() and home != Path("/") else set()
    cover |= {d for p in needed if (d := _blocking_dir(p, uid)) is not None}
    hidden = [*writable, *cover]
    # Never bind back a hidden directory or one above it (the whole home would be back).
    under = [p for p in needed if any(h in p.parents for h in hidden)]
    binds = {p: p.is_dir() for p in under if not any(o in p.parents for o in under)}
    _read_only_host()
    try:
        _cover(spec, uid, gid, home, cover, binds)
    except OSError as e:
        raise _Broken(f"the private filesystem failed half-way: {e}") from e


class _Broken(Exception):
    """The sandbox is half set up: the worker must not run."""


def _cover(
    spec: Spec, uid: int, gid: int, home: Path, cover: set[Path], binds: dict[Path, bool]
) -> None:
    # Opened before they are hidden: bound back from these descriptors.
    sources = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in binds}
    opts = f"size={spec.limits.tmp_mb}m,mode=1777"
    _mount("tandem-sandbox", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, opts)
    os.mkdir("/tmp/.shm")
    os.chmod("/tmp/.shm", 0o1777)  # past the umask
    for target, source in (("/var/tmp", "/tmp"), ("/dev/shm", "/tmp/.shm")):
        if os.path.isdir(target):
            _mount(source, target, None, _MS_BIND)
    for i, directory in enumerate(sorted(cover, key=lambda d: len(d.parts))):
        # An empty directory of the tmpfs in its place: HOME the worker's own, any other
        # crossable, holding only what is bound back.
        if directory.exists():
            stand_in = Path(f"/tmp/.cover{i}")
            stand_in.mkdir()
            _mount(str(stand_in), str(directory), None, _MS_BIND)
        else:  # under the tmpfs already
            directory.mkdir(parents=True)
        if directory == home:
            os.chown(directory, uid, gid)
        os.chmod(directory, 0o700 if directory == home else 0o755)
    for path, is_dir in binds.items():
        # The bind keeps the source's read-only flag, set above.
        if is_dir:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        _mount(f"/proc/self/fd/{sources[path]}", str(path), None, _MS_BIND | _MS_REC)
        os.close(sources[path])


def _loopback_up() -> None:
    """Bring up the new network namespace's `lo` (privileged: CAP_NET_ADMIN over it). It
    reaches nothing but itself."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def _drop_capabilities() -> None:
    """Empty this process's capability sets, bounding set included (in a user namespace,
    where there is no uid to drop to)."""
    for cap in range(64):
        if _LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable for two 32-bit words
    _check(_LIBC.syscall(126 if os.uname().machine == "x86_64" else 91, header, data), "capset")


def _confine(
    spec: Spec, report: _Report, scratch: str | None, launcher_alive: int
) -> tuple[dict[str, str], str | None]:
    """Steps 3 and 4 in the worker process: the environment variables it changes, and the
    private directory for HOME and TMPDIR where there is no tmpfs (`scratch`, made by the
    launcher where there are no namespaces; made here if the mount namespace could not be
    made private)."""
    namespaces = scratch is None
    root = os.geteuid() == 0
    uid, gid = (SANDBOX_UID, SANDBOX_UID) if root else (os.geteuid(), os.getegid())
    home = Path(os.environ.get("HOME", "/"))
    env: dict[str, str] = {}
    report.parts["network"] = namespaces  # the namespace came up without an interface
    if namespaces and spec.loopback:
        try:
            _loopback_up()
            report.parts["loopback"] = True
        except OSError as e:
            report.lacks("the loopback interface", e)
    filesystem = False
    if namespaces:
        try:
            _private_filesystem(spec, uid, gid, home)  # _Broken goes up: no worker then
            filesystem = True
            env = {"HOME": str(home), "TMPDIR": "/tmp"}
        except OSError as e:
            report.lacks("a private filesystem", e)
        try:  # after the host's mounts were made read-only: this one is the worker's own
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            report.parts["processes"] = True
        except OSError as e:
            report.lacks("a /proc of its own", e)
    if not filesystem:
        scratch = scratch or tempfile.mkdtemp(prefix="tandem-sandbox-")
        for sub in ("", "home", "tmp"):
            os.makedirs(os.path.join(scratch, sub), mode=0o700, exist_ok=True)
            if root:
                os.chown(os.path.join(scratch, sub), uid, gid)
        env = {"HOME": f"{scratch}/home", "TMPDIR": f"{scratch}/tmp"}
    report.parts["filesystem"] = filesystem
    report.parts["tmp_mb"] = spec.limits.tmp_mb if filesystem else 0
    limits = spec.limits
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.tmp_mb > 0:
        size = limits.tmp_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    blocked = [] if filesystem else [p for p in _needed_paths(spec) if _blocking_dir(p, uid)]
    if root and blocked:
        # Without a mount namespace nothing can be bound back: as the sandbox uid the worker
        # could not even import Python.
        report.lacks(f"uid {uid}", f"it cannot reach {blocked[0]} without a mount namespace")
    elif root:
        resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # clears every capability: no uid 0 is left
        # The uid change made it undumpable, its /proc/self root's; only its own sandbox
        # sees it, and its own code may read and write its /proc/self as any process can.
        _check(_LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")
        report.parts["user"] = f"uid {uid}"
    elif namespaces:
        try:
            _drop_capabilities()
            report.parts["user"] = "user namespace"
        except OSError as e:
            report.lacks("dropping capabilities", e)
    else:
        report.lacks("an unprivileged user", "no user namespace")
    _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # After the uid change, which clears it; the launcher's death then kills this worker.
    _check(_LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if select.select([launcher_alive], [], [], 0)[0]:
        os._exit(1)  # the launcher died before the death signal was armed
    if limits.memory_mb > 0:
        size = limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    os.chdir(env["TMPDIR"])
    return env, scratch


def _supervise(child: int, scratch: str | None) -> None:
    """The launcher after the fork: wait for the worker (killing it if the driver dies), end
    what it left behind, and exit as it exited."""
    parent = os.getppid()
    pidfd = os.pidfd_open(child)
    while not select.select([pidfd], [], [], 1.0)[0]:
        if os.getppid() != parent:  # the driver died: the worker goes too
            os.kill(child, signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    if scratch is not None:  # (in a pid namespace, every process of it died with the worker)
        _kill_session()
        shutil.rmtree(scratch, ignore_errors=True)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _kill_session() -> None:
    """Kill every other process of this session: what the worker started and left running.
    (One that left the session, by `setsid`, is out of reach without a pid namespace.)"""
    me, session = os.getpid(), os.getsid(0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass  # it exited meanwhile


def _send(fd: int, message: dict) -> None:
    """One JSON message on the connection at `fd`, which stays open for the worker."""
    conn = Connection(os.dup(fd))
    conn.send_bytes(json.dumps(message).encode())
    conn.close()


def main(spec_json: str, module: str, fd: int) -> None:
    spec = Spec.from_json(spec_json)
    report = _Report()
    namespaces = _unshare(report) if sys.platform.startswith("linux") else False
    # Without a tmpfs, HOME and TMPDIR go here: removed by this process when the worker ends,
    # or by the driver when it kills both.
    scratch = None if namespaces else tempfile.mkdtemp(prefix="tandem-sandbox-")
    # The worker is a child (pid 1 of the new pid namespace, where there is one); this process
    # stays outside as its supervisor.
    alive_r, alive_w = os.pipe()
    child = os.fork()
    if child:
        os.close(fd)  # only the worker talks to the driver
        os.close(alive_r)
        _supervise(child, scratch)
    os.close(alive_w)
    try:
        env, scratch = _confine(spec, report, scratch, alive_r)
    except (_Broken, OSError) as e:
        _send(fd, {"failed": f"{type(e).__name__}: {e}"})
        os._exit(1)
    os.close(alive_r)
    os.environ.update(env)
    isolation = report.isolation()
    message: dict = {"isolation": isolation.to_json(), "scratch": scratch}
    if spec.limits.require and not isolation.full:
        message["refused"] = (
            "sandbox.require is set and this sandbox is not fully isolated: " + isolation.summary()
        )
    _send(fd, message)
    if "refused" in message:
        os._exit(1)
    sys.argv = [module, str(fd)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
