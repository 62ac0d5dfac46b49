"""orchestrator inspect: what the machine is (live, from a sysfs root, or from a recorded dump)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Show the machine: sockets, NUMA nodes, cores, GPUs and links (live, --root DIR or --dump FILE)"
DESCRIPTION = (
    "Discover the machine: packages (sockets), NUMA nodes with CPUs, memory and distances, cores and PUs, "
    "GPUs with their NUMA node, PCIe link and peer links, what this process may use (cpuset), NUMA balancing "
    "and huge pages. Reads the live machine by default, or a sysfs root (--root DIR) or a recorded dump "
    "(--dump FILE.tar.gz); --save FILE.tar.gz records the files read so the machine can be planned for "
    "elsewhere. The --json document is described in docs/hardware.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--root", metavar="DIR", help="read sysfs/procfs under DIR instead of / (an extracted dump)")
    src.add_argument("--dump", metavar="FILE", help="read a recorded machine (.tar.gz from --save, or an hwloc "
                                                    "Linux dump .tar.bz2)")
    p.add_argument("--json", action="store_true", help="print the machine as JSON (schema orchestrator.machine/1)")
    p.add_argument("--save", metavar="FILE.tar.gz", help="also record the files read into FILE.tar.gz")
    p.add_argument("--allowed", action="store_true",
                   help="show only what this process may use (cpuset/affinity-restricted view)")
    p.add_argument("--no-nvml", action="store_true", help="do not ask NVML; GPUs from sysfs only")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from orchestrator.errors import HardwareError
    from orchestrator.hardware.dump import open_dump, read_dump_root, save_dump
    from orchestrator.hardware.render import render_tree
    from orchestrator.hardware.rootfs import RootFS
    from orchestrator.hardware.sysfs import read_from_fs

    saved = None
    if args.dump:
        with open_dump(args.dump) as root:
            machine = read_dump_root(root, source=f"dump {args.dump}")
            if args.save:
                save_dump(args.save, root)
                saved = args.save
    else:
        root = Path(args.root) if args.root else Path("/")
        if not root.is_dir():
            raise HardwareError(f"{root}: no such directory (--root takes a directory holding sys/ and proc/)")
        fs = RootFS(root)
        if fs.live:
            machine = read_from_fs(fs, nvml=not args.no_nvml)  # with the cached probe results, if any
        else:
            machine = read_dump_root(root, source=f"root {root}", fs=fs)
        if args.save:
            save_dump(args.save, root, nvml=not args.no_nvml)
            saved = args.save
    if args.allowed:
        machine = machine.allowed_view()
    if args.json:
        json.dump(machine.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        for note in machine.notes:
            print(f"orchestrator inspect: note: {note}", file=sys.stderr)
    else:
        sys.stdout.write(render_tree(machine))
    if saved:
        print(f"orchestrator inspect: recorded the machine into {saved}", file=sys.stderr)
    return 0
