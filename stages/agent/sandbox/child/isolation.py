"""Isolation steps of one sandboxed call (namespaces, mounts, privileges, Landlock), in stdlib + ctypes only.

Part of the sandbox's interpreter side: stages/agent/sandbox/zygote_client.py runs this file's source followed by
zygote_server.py's as one `python -c` program (the sandbox sees no project files), and zygote_server.py imports
it by name when it is loaded as a module.
"""

import ctypes
import os
import socket
import stat
import struct

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self: the same number on every arch
LL_FS_FILE = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # execute, write, read, truncate, ioctl_dev: rights a file rule may hold
LL_FS_READ = 1 | 4 | 8  # execute, read file, read dir
MB = 1 << 20
LIBC = ctypes.CDLL(None, use_errno=True)


def checked(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


# ---- isolation steps of one call ------------------------------------------------------------------------------
def mount(source, target, fstype, flags, data=None):
    enc = (lambda v: v.encode() if isinstance(v, str) else v)
    checked(LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def call_namespaces(spec):
    """bwrap mode, in the child (already pid 1 of its own pid namespace): private mounts, network, IPC."""
    checked(LIBC.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # interpreter folders under a per-call mount (a venv under /tmp): held open (in this mount namespace: a bind
    # source must be in it) before the tmpfs covers them, bound again on top of it
    rebinds = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in spec["rebind"]]
    size = f"size={spec['workdir_mb'] * MB},mode=1777"
    for target in spec["call_mounts"]:
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, size)
    for path, fd in rebinds:
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    loopback_up()


def loopback_up():
    """Bring `lo` up in the call's network namespace (code may talk to itself, never to the host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", ioctl(sock.fileno(), 0x8913, ifreq))[1]  # SIOCGIFFLAGS
        ioctl(sock.fileno(), 0x8914, struct.pack("16sh22x", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP


def ioctl(fd, request, arg):
    buf = ctypes.create_string_buffer(arg, len(arg))
    checked(LIBC.ioctl(fd, ctypes.c_ulong(request), buf), "ioctl")
    return buf.raw


def try_unshare_network():
    """rlimit mode: a network and IPC namespace of the call's own where the kernel allows it (without root, in a
    user namespace of its own, which also gives the call its own process count)."""
    if os.geteuid() == 0:
        return "isolated" if LIBC.unshare(CLONE_NEWNET | CLONE_NEWIPC) == 0 else "open"
    uid, gid = os.getuid(), os.getgid()
    if LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC) != 0:
        return "open"
    map_ids(uid, gid)
    return "isolated"


def own_user_namespace():
    """Without root: a user namespace of the call's own. The kernel counts processes per user namespace and uid
    (checked up the chain against each creator's limit), so max_processes becomes this call's alone, as a fresh
    uid gives it as root. Its capabilities there are dropped right after."""
    uid, gid = os.getuid(), os.getgid()
    checked(LIBC.unshare(CLONE_NEWUSER), "unshare user namespace")
    map_ids(uid, gid)


def map_ids(uid, gid):
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)


def drop_capabilities():
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    checked(LIBC.capset(header, data), "capset")


def become(uid):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # from root to non-root: every capability is cleared


def landlock_abi():
    return max(0, LIBC.syscall(ctypes.c_long(SYS_LANDLOCK[0]), None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def landlock_ruleset(abi, reads, writes):
    """A Landlock ruleset (fd) for the rlimit mode: read+execute `reads`, everything in `writes`, no other file
    access; no TCP bind/connect (ABI >= 4); no signals or abstract unix sockets outside the call (ABI >= 6)."""
    fs_all = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = struct.pack("QQQ", fs_all, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = checked(LIBC.syscall(ctypes.c_long(SYS_LANDLOCK[0]), buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)),
                   "landlock_create_ruleset")
    for path, access in [(p, LL_FS_READ) for p in reads] + [(p, fs_all) for p in writes]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            allowed = access & fs_all & (-1 if stat.S_ISDIR(os.fstat(fd).st_mode) else LL_FS_FILE)
            rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
            checked(LIBC.syscall(ctypes.c_long(SYS_LANDLOCK[1]), ruleset, ctypes.c_int(1), rule, ctypes.c_uint32(0)),
                 f"landlock_add_rule {path}")
        finally:
            os.close(fd)
    return ruleset


def no_new_privs():
    checked(LIBC.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
         "no_new_privs")  # no setuid/file-capability binary can give privileges back


def prctl(option, value):
    LIBC.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
