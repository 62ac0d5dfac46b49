"""A two-socket, two-NUMA-node Linux guest to test on: boot it, run one command inside, return its status.

    python tests/vm/numa_guest.py [--timeout S] [--memory MIB] [--out DIR] [--env K=V] [--cwd DIR] [--dev-fd]
                                  -- CMD [ARG...]

The guest is QEMU (Debian's ``qemu-system-x86``) under TCG emulation with ``-smp 2,sockets=2`` and two
``-numa node`` memory backends: CPU 0 and the first half of its memory are node 0 on socket 0, CPU 1 and the
rest node 1 on socket 1, so the kernel inside has a real NUMA topology, real ``numa_balancing``, real
``numa_maps`` and real mempolicies. The kernel is Debian's cloud kernel (``linux-image-cloud-amd64``), downloaded
with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into a cache; nothing is installed into the host's
``/boot``. The guest's root is the host's ``/`` shared over virtiofs (QEMU's ``virtiofsd``) under a tmpfs
overlay: it runs the host's own programs (the checkout, its .venv, llama-server, numactl), and what it writes
stays in the guest, except under ``--out DIR``, a host folder the guest writes through to.

Why TCG: a host whose ``/dev/kvm`` is a paravirtualised KVM (a VM itself) cannot run a normal guest kernel
with it; TCG needs nothing from the host. It is slow for heavy work (a Ray cluster takes minutes to start), fast
enough for reading the topology, the NUMA wrappers and a llama-server started directly.

The command's stdout and stderr come out on this process's stdout (the guest's serial console); the exit status
is the command's, 124 when ``--timeout`` ran out (the guest is killed), 2 when the guest cannot be built or
booted (one line on stderr says why). ``--prepare`` only builds the cache (kernel, initramfs) and exits.

Needs: ``qemu-system-x86_64``, virtiofsd (``/usr/lib/qemu/virtiofsd``, in ``qemu-system-common``, or the
``virtiofsd`` package), a static busybox (``busybox-static``) for the initramfs, and ``apt-get`` + ``dpkg-deb``
for the kernel (once). :func:`missing` says what is missing; :func:`install` installs the Debian packages
(``apt-get``, as root; idempotent). virtiofsd must run as root.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GUEST_INIT = HERE / "guest-init.sh"
CACHE = Path(os.environ.get("ORCHESTRATOR_VM_CACHE", Path.home() / ".cache" / "orchestrator" / "numa-vm"))
APT_PACKAGES = ("qemu-system-x86", "busybox-static")
KERNEL_PACKAGE = "linux-image-cloud-amd64"
VIRTIOFSD = ("/usr/libexec/virtiofsd", "/usr/lib/qemu/virtiofsd", "/usr/lib/virtiofsd")
BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")
# loaded in this order: the cloud kernel has the virtio bus, virtiofs and overlayfs as modules
MODULES = ("virtio", "virtio_ring", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci", "fuse",
           "virtiofs", "overlay")
FS_TAG = "hostroot"
NODES = 2


class GuestError(Exception):
    """The guest cannot be built or booted (a missing program, a failed download): one line."""


# -- prerequisites -----------------------------------------------------------------------------------------------

def _virtiofsd() -> str | None:
    found = shutil.which("virtiofsd")
    return found or next((p for p in VIRTIOFSD if os.access(p, os.X_OK)), None)


def _busybox() -> str | None:
    """A statically linked busybox (the initramfs has no libc)."""
    for p in (shutil.which("busybox"), *BUSYBOX):
        if p and os.access(p, os.X_OK):
            with open(p, "rb") as f:
                head = f.read(1 << 16)
            if b"/lib64/ld-linux" not in head and b"/lib/ld-linux" not in head:   # no ELF interpreter: static
                return p
    return None


def missing() -> list[str]:
    """What this host lacks to boot the guest, one phrase each (empty: nothing)."""
    out = []
    if not sys.platform.startswith("linux"):
        return ["a Linux host"]
    if not shutil.which("qemu-system-x86_64"):
        out.append("qemu-system-x86_64 (apt: qemu-system-x86)")
    if not _virtiofsd():
        out.append("virtiofsd (apt: qemu-system-common or virtiofsd)")
    if not _busybox():
        out.append("a static busybox (apt: busybox-static)")
    if not _kernel_cached():
        for tool in ("apt-get", "apt-cache", "dpkg-deb"):
            if not shutil.which(tool):
                out.append(f"{tool} (to fetch Debian's {KERNEL_PACKAGE})")
    if os.geteuid() != 0:
        out.append("root (virtiofsd shares / as root)")
    return out


def install() -> None:
    """Install the Debian packages the guest needs, when some are missing (apt-get, as root)."""
    if not (missing_now := [m for m in missing() if "apt:" in m]):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise GuestError(f"cannot install {', '.join(missing_now)}: needs root and apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise GuestError(f"apt-get install {' '.join(APT_PACKAGES)} failed: "
                             f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")


# -- the kernel and the initramfs ----------------------------------------------------------------------------------

def _kernel_cached() -> Path | None:
    for d in sorted(CACHE.glob("*/"), reverse=True):
        if (d / "vmlinuz").is_file() and (d / "initrd.img").is_file():
            return d
    return None


def _apt_kernel_package() -> str:
    """The versioned image package the metapackage depends on (linux-image-6.1.0-57-cloud-amd64)."""
    r = subprocess.run(["apt-cache", "depends", KERNEL_PACKAGE], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        name = line.strip().removeprefix("Depends:").strip()
        if line.strip().startswith("Depends:") and name.startswith("linux-image-"):
            return name
    raise GuestError(f"apt-cache depends {KERNEL_PACKAGE}: no linux-image package (run apt-get update?)")


def _modinfo_depends(ko: Path) -> list[str]:
    """The ``depends=`` field of a module's .modinfo section (the modules the kernel must have first)."""
    data = ko.read_bytes()
    at = data.find(b"\0depends=")
    if at < 0:
        return []
    end = data.index(b"\0", at + 1)
    return [d for d in data[at + len(b"\0depends="):end].decode().split(",") if d]


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, data) entries: what the kernel unpacks as its initramfs."""
    out = io.BytesIO()

    def put(name: str, mode: int, data: bytes, ino: int) -> None:
        nb = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0]
        out.write(b"070701" + b"".join(f"{v:08x}".encode() for v in fields) + nb)
        out.write(b"\0" * (-(110 + len(nb)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))

    for ino, (name, mode, data) in enumerate(entries, start=1):
        put(name, mode, data, ino)
    put("TRAILER!!!", 0, b"", 0)
    return out.getvalue()


INITRAMFS_INIT = """#!/bin/busybox sh
# First stage: load the virtio and filesystem modules, mount the host's root (virtiofs) under a tmpfs overlay,
# make the --out folder write through to the host, and hand over to guest-init.sh from the host's tree.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do insmod "/modules/$m.ko" || echo "initramfs: insmod $m failed"; done
arg() { for w in $(cat /proc/cmdline); do case $w in "$1"=*) echo "${w#*=}";; esac; done; }
mkdir -p /host /rw /newroot
mount -t virtiofs TAG /host || { echo "initramfs: cannot mount the host's root"; echo b >/proc/sysrq-trigger; }
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work /newroot
out=$(arg orch.out)
init=$(arg orch.init)
if [ -n "$out" ]; then mkdir -p "/newroot$out" && mount --bind "/host$out" "/newroot$out"; fi
for d in proc sys dev; do mount --move "/$d" "/newroot/$d"; done
exec switch_root /newroot /bin/bash "$init"
""".replace("TAG", FS_TAG)


def prepare() -> Path:
    """The cache folder with ``vmlinuz`` and ``initrd.img`` (built once: the kernel package downloaded and
    unpacked, its modules and a static busybox put into an initramfs)."""
    if (done := _kernel_cached()) is not None:
        return done
    if (bb := _busybox()) is None:
        raise GuestError("no static busybox for the initramfs (apt-get install busybox-static)")
    pkg = _apt_kernel_package()
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        r = subprocess.run(["apt-get", "download", pkg], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("*.deb"))
        if r.returncode != 0 or not debs:
            raise GuestError(f"apt-get download {pkg} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        tree = Path(tmp) / "x"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(tree)], check=True)
        vmlinuz = next((tree / "boot").glob("vmlinuz-*"))
        version = vmlinuz.name.removeprefix("vmlinuz-")
        kos = {p.name.removesuffix(".ko"): p for p in (tree / "lib" / "modules" / version).rglob("*.ko")}
        order: list[str] = []

        def need(name: str) -> None:
            name = name.replace("-", "_")
            if name in order:
                return
            if name not in kos:
                return                      # built into this kernel
            for dep in _modinfo_depends(kos[name]):
                need(dep)
            order.append(name)

        for m in MODULES:
            need(m)
        entries = [("bin", 0o40755, b""), ("modules", 0o40755, b""), ("proc", 0o40755, b""),
                   ("sys", 0o40755, b""), ("dev", 0o40755, b""),
                   ("bin/busybox", 0o100755, Path(bb).read_bytes()),
                   ("init", 0o100755, INITRAMFS_INIT.encode()),
                   ("modules.order", 0o100644, "\n".join(order).encode() + b"\n")]
        entries += [(f"modules/{m}.ko", 0o100644, kos[m].read_bytes()) for m in order]
        dest = CACHE / version
        dest.mkdir(exist_ok=True)
        shutil.copyfile(vmlinuz, dest / "vmlinuz.part")
        (dest / "initrd.img.part").write_bytes(gzip.compress(_cpio(entries), compresslevel=6))
        (dest / "vmlinuz.part").rename(dest / "vmlinuz")
        (dest / "initrd.img.part").rename(dest / "initrd.img")
        return dest


# -- running ---------------------------------------------------------------------------------------------------

def _virtiofsd_argv(binary: str, sock: Path) -> list[str]:
    helptext = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    if "--shared-dir" in helptext:         # the Rust virtiofsd
        return [binary, f"--socket-path={sock}", "--shared-dir=/", "--sandbox=chroot", "--cache=auto"]
    return [binary, f"--socket-path={sock}", "-o", "source=/", "-o", "sandbox=chroot", "-o", "cache=auto"]


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# The guest's root is the host's, so the host's home and caches are at the same paths inside: the command gets the
# variables that say where they are (guest-init.sh's HOME=/root is only the default), and finds what the host
# would find (orchestrator's llama.cpp builds under ~/.cache/orchestrator, its state, an explicit binary).
HOST_LOCATION_VARS = ("HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "LLAMA_SERVER")


def host_locations() -> dict[str, str]:
    """This process's variables that locate the user's files: HOME, XDG_*_HOME, LLAMA_SERVER, ORCHESTRATOR_*."""
    return {k: v for k, v in os.environ.items()
            if (k in HOST_LOCATION_VARS or k.startswith("ORCHESTRATOR_"))}


# A boot that has not reached the command by then is booted again, once: under TCG on a loaded host a boot has
# been seen to stall before the command started (nothing on the console), while a normal one takes 15-40 s.
BOOT_TIMEOUT_S = 240
BOOT_ATTEMPTS = 2


class BootStalled(Exception):
    """The guest did not reach its command before the boot deadline (the command never ran)."""


def run(argv: list[str], *, timeout: float = 300, memory_mib: int = 4096, out: str | None = None,
        env: dict[str, str] | None = None, cwd: str | None = None, stdout=None, dev_fd: bool = False,
        boot_timeout: float = BOOT_TIMEOUT_S) -> int:
    """Boot the guest, run ``argv`` in it, return its exit status (124: timed out). Output goes to ``stdout``
    (a text stream; default this process's stdout). ``dev_fd``: give the guest ``/dev/fd`` and
    ``/dev/std{in,out,err}`` (left out by default, as on a minimal root).

    The command's environment has this process's HOME, XDG_*_HOME, LLAMA_SERVER and ORCHESTRATOR_* (the
    guest's root is this host's, so they name the same files there), then ``env``.

    ``timeout`` bounds one boot and its command. A boot that has not started the command within
    ``boot_timeout`` (at most ``timeout``) is killed and booted again, once; the command runs at most once."""
    if not argv:
        raise GuestError("no command to run in the guest")
    if (lack := missing()):
        raise GuestError("cannot boot the guest: missing " + "; ".join(lack))
    stdout = stdout or sys.stdout
    for attempt in range(1, BOOT_ATTEMPTS + 1):
        try:
            return _boot_and_run(argv, timeout=timeout, boot_timeout=min(boot_timeout, timeout),
                                 memory_mib=memory_mib, out=out, env=env, cwd=cwd, stdout=stdout, dev_fd=dev_fd)
        except BootStalled as e:
            again = attempt < BOOT_ATTEMPTS
            stdout.write(f"\nnuma_guest: {e}; " + ("booting again\n" if again else "guest killed\n"))
            stdout.flush()
    return 124


def _boot_and_run(argv: list[str], *, timeout: float, boot_timeout: float, memory_mib: int, out: str | None,
                  env: dict[str, str] | None, cwd: str | None, stdout, dev_fd: bool) -> int:
    kernel = prepare()
    token = secrets.token_hex(8)
    started = time.monotonic()
    deadline = started + timeout
    with tempfile.TemporaryDirectory(prefix="numa-guest-") as tmp:
        t = Path(tmp)
        # the command and its environment as NUL-separated lists: read by guest-init.sh, never parsed by a shell
        (t / "argv").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        job_env = {"CI": os.environ.get("CI", ""), **host_locations(), **(env or {})}
        (t / "env").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in job_env.items()))
        (t / "cwd").write_text(str(Path(cwd or os.getcwd()).resolve()))
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
        sock = t / "virtiofs.sock"
        vfs = qemu = None
        try:
            vfs = subprocess.Popen(_virtiofsd_argv(_virtiofsd(), sock), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=open(t / "virtiofsd.log", "wb"),
                                   start_new_session=True)
            while not sock.exists():
                if vfs.poll() is not None or time.monotonic() > deadline:
                    raise GuestError("virtiofsd did not start: "
                                     + ((t / "virtiofsd.log").read_text().strip().splitlines() or ["?"])[-1])
                time.sleep(0.05)
            half = memory_mib // NODES
            cmdline = (f"console=ttyS0 quiet loglevel=4 panic=-1 orch.init={GUEST_INIT} orch.job={t} "
                       f"orch.token={token}" + (f" orch.out={Path(out).resolve()}" if out else "")
                       + (" orch.devfd=1" if dev_fd else ""))
            qargv = ["qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max",
                     "-smp", f"{NODES},sockets={NODES},cores=1,threads=1", "-m", f"{half * NODES}M",
                     "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio",
                     "-chardev", f"socket,id=vfs,path={sock}",
                     "-device", f"vhost-user-fs-pci,chardev=vfs,tag={FS_TAG}",
                     "-kernel", str(kernel / "vmlinuz"), "-initrd", str(kernel / "initrd.img"), "-append", cmdline]
            for n in range(NODES):
                qargv += ["-object", f"memory-backend-memfd,id=mem{n},size={half}M,share=on",
                          "-numa", f"node,nodeid={n},cpus={n},memdev=mem{n}"]
            qemu = subprocess.Popen(qargv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            return _relay(qemu, token, started, started + boot_timeout, deadline, stdout)
        finally:
            _stop(qemu)
            _stop(vfs)


def _relay(qemu: subprocess.Popen, token: str, started: float, boot_deadline: float, deadline: float,
           stdout) -> int:
    """Copy the guest's console to ``stdout`` until the status line (``<token> exit=N``) or the deadline.
    guest-init.sh prints ``<token> started`` just before the command: until then the guest is booting, and
    :class:`BootStalled` is raised at ``boot_deadline``."""
    import selectors

    status = None
    ran_at = None                       # when the command started (monotonic)
    buf = b""
    sel = selectors.DefaultSelector()
    sel.register(qemu.stdout, selectors.EVENT_READ)
    fd = qemu.stdout.fileno()
    while True:
        now = time.monotonic()
        if ran_at is None and now >= boot_deadline:
            raise BootStalled(f"the guest did not start its command within {now - started:.0f} s of booting")
        if now >= deadline:
            boot = f"{ran_at - started:.0f}" if ran_at is not None else "?"
            stdout.write(f"\nnuma_guest: timed out {now - (ran_at or started):.0f} s after the command started "
                         f"(the boot took {boot} s); guest killed\n")
            stdout.flush()
            return 124
        left = (deadline if ran_at is not None else min(deadline, boot_deadline)) - now
        if not sel.select(min(left, 1.0)):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").rstrip("\r")
            if line.endswith(token + " started"):     # after what the kernel left unfinished, if anything
                ran_at = time.monotonic()
                if line := line[:-len(token + " started")]:
                    stdout.write(line + "\n")
                continue
            if line.startswith(token + " exit="):
                status = int(line.split("=", 1)[1])
                break                   # what follows is the guest going down
            stdout.write(line + "\n")
        stdout.flush()
        if status is not None:
            return status
    if buf:
        stdout.write(buf.decode(errors="replace"))
    qemu.wait()
    if status is None:
        raise GuestError(f"the guest stopped without the command's status (QEMU exit {qemu.returncode})")
    return status


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run a command inside a two-node QEMU guest (TCG).")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before the guest is killed (exit 124)")
    ap.add_argument("--memory", type=int, default=4096, help="guest memory in MiB, split over the two nodes")
    ap.add_argument("--out", help="a host folder the guest writes through to (created)")
    ap.add_argument("--cwd", help="the command's working directory (default: this one)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="set in the command's environment")
    ap.add_argument("--dev-fd", action="store_true", help="give the guest /dev/fd (absent by default)")
    ap.add_argument("--install", action="store_true", help="apt-get install what is missing first (root)")
    ap.add_argument("--prepare", action="store_true", help="only build the kernel/initramfs cache")
    ap.add_argument("command", nargs="*")
    ns = ap.parse_args(args)
    try:
        bad = [e for e in ns.env if "=" not in e]
        if bad:
            raise GuestError(f"--env {bad[0]}: expected KEY=VALUE")
        if ns.install:
            install()
        if ns.prepare:
            print(prepare())
            return 0
        return run(ns.command, timeout=ns.timeout, memory_mib=ns.memory, out=ns.out, cwd=ns.cwd,
                   env=dict(e.split("=", 1) for e in ns.env), dev_fd=ns.dev_fd)
    except GuestError as e:
        print(f"numa_guest: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
