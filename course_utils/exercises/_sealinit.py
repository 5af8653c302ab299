"""The first process inside a grading seal: it builds the student's world, starts the student's code, and ends it.

Run by the grader (``course_utils.exercises.seal``) as root, as the first process of fresh mount, network and PID
namespaces (``unshare --mount --net --pid --fork``), so it is PID 1 there. Standard library only, and run by path
with ``python -I -S``: it starts in milliseconds and imports nothing a student could have touched.

What it does, in order:

1. joins the cgroups the grader made (memory, processes, CPU time), before anything else runs;
2. brings loopback up (the namespace's only interface: ranks reach each other on 127.0.0.1, nothing else);
3. builds a new root on a tmpfs whose size is the disk limit: the system's and Python's folders bound read-only
   at their own paths, a handful of device nodes, a fresh /proc (this namespace's processes only), and ``/tmp``
   (the only writable place, holding ``/tmp/work`` with the notebook's copy and ``/tmp/home``). Nothing else of
   the machine is there: not the teacher's home, not the class's folder, not the course's reference solutions;
4. forks the student's process: chroot into the new root, an unprivileged user, no new privileges, then exec;
5. reaps every process (as PID 1 must), and ends them all with SIGKILL when the student's process ends, when
   the grader's lifeline pipe closes, or at the wall-time limit; then it reports what happened on its report fd.

When PID 1 of a PID namespace exits, the kernel kills every process left in it: nothing outlives the seal.
"""

import ctypes
import errno
import fcntl
import json
import os
import platform
import select
import signal
import socket
import struct
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
PR_SET_NO_NEW_PRIVS = 38
LIBC = ctypes.CDLL(None, use_errno=True)
DEVICES = ("null", "zero", "full", "random", "urandom")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    _check(
        LIBC.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def bind_readonly(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def loopback_up() -> None:
    """``ip link set lo up`` with the SIOCGIFFLAGS/SIOCSIFFLAGS ioctls (no iproute2 needed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, 0x8913, req))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 0x1))


def build_root(root: str, cfg: dict) -> None:
    """The student's filesystem, on a tmpfs at ``root`` (see the module's docstring)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(cfg['disk_bytes'])},mode=0755")
    for link, target in cfg["links"]:  # /bin -> usr/bin on a merged-/usr system
        os.symlink(target, root + link)
    for path in cfg["binds"]:
        dest = root + path
        on_the_way = root
        for part in os.path.dirname(path).strip("/").split("/") if os.path.dirname(path) != "/" else ():
            on_the_way += "/" + part
            if not os.path.isdir(on_the_way):  # /root on the way to Python: passable, not listable
                os.mkdir(on_the_way)
                os.chmod(on_the_way, 0o711)
        if os.path.isdir(path):
            os.makedirs(dest, exist_ok=True)
        else:
            open(dest, "w").close()
        bind_readonly(path, dest)
    for path in cfg["hide"]:  # the reference solutions: an empty, read-only folder in their place
        if os.path.isdir(root + path):
            mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    os.makedirs(root + "/dev", exist_ok=True)
    for name in DEVICES:
        open(root + "/dev/" + name, "w").close()
        mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "fd/0"), ("stdout", "fd/1"), ("stderr", "fd/2")):
        os.symlink(target, root + "/dev/" + name)
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    uid, gid = cfg["uid"], cfg["gid"]
    for path, mode, owner in (
        ("/tmp", 0o1777, (0, 0)),
        ("/dev/shm", 0o1777, (0, 0)),
        ("/tmp/work", 0o755, (uid, gid)),
        ("/tmp/home", 0o700, (uid, gid)),
    ):
        os.makedirs(root + path, exist_ok=True)
        os.chmod(root + path, mode)
        os.chown(root + path, *owner)
    os.makedirs(root + "/var", exist_ok=True)
    if not os.path.lexists(root + "/var/tmp"):
        os.symlink("/tmp", root + "/var/tmp")


def write_files(root: str, files: dict, uid: int, gid: int) -> None:
    import base64

    for name, data in files.items():
        path = os.path.join(root + "/tmp/work", name)
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(data))
        os.chown(path, uid, gid)


def student(root: str, cfg: dict, fds: list[int]) -> None:
    """The child: into the new root, down to the student's user, then exec the student's process."""
    import resource

    for fd in fds:
        os.close(fd)
    os.chroot(root)
    os.chdir("/tmp/work")
    os.setgroups([])
    os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg.get("nproc"):  # a second bound on processes (the user is this seal's alone), for a seal without cgroups
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])


def main() -> int:
    cfg = json.loads(sys.stdin.buffer.read())
    os.close(0)
    os.open("/dev/null", os.O_RDONLY)
    report_fd, lifeline_fd = cfg["report_fd"], cfg["lifeline_fd"]
    os.set_inheritable(report_fd, False)
    os.set_inheritable(lifeline_fd, False)
    report = {"stage": "setup", "arch": platform.machine()}
    try:
        for procs in cfg["cgroups"]:
            with open(procs, "w") as fh:
                fh.write("0")
        loopback_up()
        root = cfg["root"]
        build_root(root, cfg)
        write_files(root, cfg["files"], cfg["uid"], cfg["gid"])
    except Exception as exc:  # the seal could not be built: say why, start nothing
        report.update(error=f"{type(exc).__name__}: {exc}")
        os.write(report_fd, json.dumps(report).encode())
        return 1
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        try:
            student(root, cfg, [report_fd, lifeline_fd])
        finally:
            os._exit(127)
    report["stage"] = "running"
    deadline = time.monotonic() + float(cfg["wall_s"])
    status, why = None, None
    while status is None:
        while True:  # reap every child that has ended (orphans come to PID 1)
            try:
                got, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                got = 0
            if got == 0:
                break
            if got == pid:
                status = st
        if status is not None:
            break
        if time.monotonic() > deadline:
            why = "time"
            break
        ready, _, _ = select.select([lifeline_fd], [], [], 0.1)
        if ready and not os.read(lifeline_fd, 64):
            why = "grader"
            break
    try:
        os.kill(-1, signal.SIGKILL)  # every other process of this namespace
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    report["stage"] = "ended"
    if why:
        report["stopped"] = why
    if status is not None:
        if os.WIFSIGNALED(status):
            report["signal"] = os.WTERMSIG(status)
        else:
            report["exit"] = os.WEXITSTATUS(status)
    try:
        st = os.statvfs(root + "/tmp")
        report["disk_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
        report["disk_total"] = st.f_blocks * st.f_frsize
    except OSError as exc:
        report["disk_error"] = errno.errorcode.get(exc.errno, str(exc))
    os.write(report_fd, json.dumps(report).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
