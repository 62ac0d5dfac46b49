"""Recorded machines: save the files discovery read into a tarball, and read a tarball back as a Machine.

A dump is a tar archive (gzip, bzip2 or xz) holding one directory with ``sys/`` (and usually ``proc/``) as
Linux showed them, exactly the files discovery read, like ``hwloc-gather-topology``; hwloc's own Linux test
tarballs load too. ``inspect --save`` adds ``orchestrator/nvml.json`` (what NVML said about the GPUs, which
no file holds), ``orchestrator/bandwidth.json`` (the cached probe results, when there are some) and
``orchestrator/manifest.json``. :func:`load_machine` also takes an extracted directory or an
``inspect --json`` document, so a topology can name any of the three as "a recorded machine".
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterator

from orchestrator.errors import HardwareError
from orchestrator.hardware.rootfs import RootFS
from orchestrator.hardware.sysfs import CPU_DIR, NVML_RECORD, read_from_fs
from orchestrator.hardware.topology import Bandwidth, Machine

BANDWIDTH_RECORD = "orchestrator/bandwidth.json"
MANIFEST = "orchestrator/manifest.json"
DUMP_SCHEMA = "orchestrator.dump/1"
_MAX_MEMBERS = 200_000
_MAX_BYTES = 1 << 30


def save_dump(out_tar_gz: str | os.PathLike, root: str | os.PathLike = "/", *,
              bandwidth: Bandwidth | None = None, nvml: bool = True) -> Machine:
    """Read the machine under ``root`` and write the files read to ``out_tar_gz`` (atomically).

    Returns the machine as read. On the live machine the NVML answers and the probe results (``bandwidth``,
    else the cached ones) are recorded too."""
    out = Path(out_tar_gz)
    fs = RootFS(root)
    machine = read_from_fs(fs, nvml=nvml) if fs.live else read_dump_root(root, source=f"root {root}", fs=fs)
    extra: dict[str, bytes] = {}
    if machine.gpus and any(g.source == "nvml" for g in machine.gpus) and NVML_RECORD not in fs.files:
        from orchestrator.hardware.nvml import gpu_to_record

        extra[NVML_RECORD] = json.dumps({"driver": machine.gpu_driver,
                                         "gpus": [gpu_to_record(g) for g in machine.gpus]}, indent=1).encode()
    # the probe results: given, or cached for the live machine; a re-saved dump keeps its bandwidth.json
    # (it is among the files read)
    bw = bandwidth if bandwidth is not None else (machine.bandwidth if fs.live else None)
    if bw is not None:
        machine = machine.with_bandwidth(bw)
        extra[BANDWIDTH_RECORD] = json.dumps(bw.to_json(), indent=1).encode()
    top = re.sub(r"[^A-Za-z0-9._-]", "_", machine.hostname) or "machine"
    extra[MANIFEST] = json.dumps({"schema": DUMP_SCHEMA, "hostname": machine.hostname,
                                  "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "root": str(fs.root), "files": len(fs.files)}, indent=1).encode()
    if not out.parent.is_dir():
        raise HardwareError(f"{out}: directory {out.parent} does not exist")
    mode = "w:bz2" if out.name.endswith((".bz2", ".tbz2")) else "w:xz" if out.name.endswith(".xz") else "w:gz"
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        now = time.time()
        with tarfile.open(tmp, mode) as tf:
            dirs = set(fs.dirs)
            for rel in list(fs.files) + list(extra):
                parts = rel.split("/")[:-1]
                dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
            dirs.discard("")
            for d in sorted(dirs):
                ti = tarfile.TarInfo(f"{top}/{d}")
                ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, now
                tf.addfile(ti)
            for rel, data in sorted({**fs.files, **extra}.items()):
                ti = tarfile.TarInfo(f"{top}/{rel}")
                ti.size, ti.mode, ti.mtime = len(data), 0o644, now
                tf.addfile(ti, io.BytesIO(data))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it 0600
        os.replace(tmp, out)
    except OSError as err:
        raise HardwareError(f"{out}: cannot write the dump ({err.strerror or err})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return machine


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


def _check_member(m: tarfile.TarInfo, path: Path) -> None:
    name = m.name
    if name.startswith("/") or ".." in Path(name).parts:
        raise HardwareError(f"{path}: unsafe member {name!r} (absolute or '..'): not a machine dump")
    if m.issym() or m.islnk():
        target = m.linkname
        if target.startswith("/"):
            raise HardwareError(f"{path}: link {name!r} points to an absolute path: not a machine dump")
        resolved = os.path.normpath(os.path.join(os.path.dirname(name), target) if m.issym() else target)
        if resolved.startswith(".."):
            raise HardwareError(f"{path}: link {name!r} points outside the archive: not a machine dump")
    elif not (m.isfile() or m.isdir()):
        raise HardwareError(f"{path}: member {name!r} is a device or fifo: not a machine dump")


_PCI_FILES = {"class", "vendor", "device", "numa_node", "local_cpus", "local_cpulist", "current_link_speed",
              "current_link_width", "max_link_speed", "max_link_width"}


def _needed(name: str) -> bool:
    """Whether discovery can read this member (dumps like hwloc's hold thousands of cache/cpufreq/power files
    discovery never reads; extracting only the rest makes loading ~10x faster). Keep in step with sysfs.py."""
    parts = name.split("/")
    try:
        i = parts.index("sys")
    except ValueError:
        return True  # proc/, cgroup mount points (/dev/cpuset, /cgroup/...), etc/, orchestrator/: small, kept
    if "proc" in parts[:i]:
        return True  # proc/sys/kernel/...
    rest = parts[i + 1:]
    if not rest:
        return True
    if rest[:3] == ["devices", "system", "cpu"]:
        tail = rest[3:]
        if len(tail) <= 1:
            return True  # cpu/, cpu/online, cpu/cpuN
        return tail[1] in ("online", "topology")
    if rest[:3] == ["devices", "system", "node"] or rest[:2] == ["kernel", "mm"] or rest[:3] == ["bus", "pci", "devices"]:
        return True
    if rest[:1] == ["devices"] and len(rest) > 1 and rest[1].startswith("pci"):
        return parts[-1] in _PCI_FILES or not parts[-1] or re.fullmatch(r"[0-9a-f]+:[0-9a-f]{2}(:[0-9a-f]{2}\.[0-7])?",
                                                                          parts[-1]) is not None or parts[-1].startswith("pci")
    if rest[:2] == ["fs", "cgroup"]:
        return (parts[-1].startswith("cpuset.") or parts[-1] in ("cpus", "mems", "cgroup.controllers")
                or "." not in parts[-1])
    return False


def _find_root(top: Path) -> Path | None:
    """The directory under ``top`` that holds sys/devices/system/cpu (at most 3 levels down)."""
    frontier = [top]
    for _depth in range(4):
        nxt = []
        for d in frontier:
            if (d / CPU_DIR).is_dir():
                return d
            try:
                nxt.extend(sorted(p for p in d.iterdir() if p.is_dir() and not p.is_symlink()))
            except OSError:
                pass
        frontier = nxt
    return None


@contextlib.contextmanager
def open_dump(tarball: str | os.PathLike) -> Iterator[Path]:
    """Extract a dump into a temporary directory and yield the root that holds ``sys/``; removed afterwards."""
    path = Path(tarball)
    if not path.exists():
        raise HardwareError(f"{path}: no such file")
    if path.is_dir():
        raise HardwareError(f"{path}: is a directory (use --root for an extracted dump)")
    tmp = Path(tempfile.mkdtemp(prefix="orchestrator-dump-"))
    try:
        try:
            with tarfile.open(path) as tf:
                members = []
                total = 0
                for m in tf:
                    _check_member(m, path)
                    if not _needed(m.name):
                        continue
                    total += m.size
                    members.append(m)
                    if len(members) > _MAX_MEMBERS or total > _MAX_BYTES:
                        raise HardwareError(f"{path}: too large for a machine dump "
                                            f"(over {_MAX_MEMBERS} files or {_MAX_BYTES >> 20} MiB)")
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(tmp, members=members, filter="data")
                else:  # Python < 3.10.12/3.11.4: members were checked above
                    tf.extractall(tmp, members=members)
        except tarfile.TarError as err:
            why = "not gzip, bzip2, xz or plain tar" if "could not be opened" in str(err) else _one_line(err)
            raise HardwareError(f"{path}: not a readable tar archive ({why}); expected a .tar.gz written by "
                                "`orchestrator inspect --save` or an hwloc sysfs dump") from None
        except (OSError, EOFError) as err:
            raise HardwareError(f"{path}: cannot read the archive ({_one_line(err)}): truncated or damaged?") from None
        root = _find_root(tmp)
        if root is None:
            raise HardwareError(f"{path}: not a machine dump: no sys/devices/system/cpu directory inside "
                                "(expected a tarball written by `orchestrator inspect --save`)")
        yield root
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_dump_root(root: str | os.PathLike, source: str, fs: RootFS | None = None) -> Machine:
    """Read an extracted dump: sysfs/procfs plus the recorded NVML answers and bandwidth, never the live NVML."""
    fs = fs or RootFS(root)
    machine = read_from_fs(fs, nvml=False, source=source)
    text = fs.read(BANDWIDTH_RECORD)
    if text is not None:
        try:
            machine = machine.with_bandwidth(Bandwidth.from_json(json.loads(text), fs.display(BANDWIDTH_RECORD)))
        except ValueError as err:
            raise HardwareError(f"{fs.display(BANDWIDTH_RECORD)}: not valid JSON ({err})") from None
    return machine


def load_dump(tarball: str | os.PathLike) -> Machine:
    """The machine recorded in ``tarball`` (``inspect --save`` output or an hwloc Linux test tarball)."""
    with open_dump(tarball) as root:
        return read_dump_root(root, source=f"dump {tarball}")


def load_machine(path: str | os.PathLike) -> Machine:
    """A recorded machine from any of: a dump tarball, an extracted dump directory, an ``inspect --json`` file."""
    p = Path(path)
    if not p.exists():
        raise HardwareError(f"{p}: no such file or directory (expected a machine dump .tar.gz, a directory "
                            "holding sys/, or an `orchestrator inspect --json` file)")
    if p.is_dir():
        root = _find_root(p)
        if root is None:
            raise HardwareError(f"{p}: no sys/devices/system/cpu inside: not a recorded machine")
        return read_dump_root(root, source=f"root {root}")
    with open(p, "rb") as f:
        head = f.read(1)
    if head in (b"{", b" ", b"\n"):
        try:
            doc = json.loads(p.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise HardwareError(f"{p}: not valid JSON ({err})") from None
        return Machine.from_json(doc, where=str(p))
    return load_dump(p)
