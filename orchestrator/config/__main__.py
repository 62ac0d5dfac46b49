"""``python -m orchestrator.config FILE…``: validate topology files without planning.

Prints ``FILE: ok`` per valid file, or the one-line error and exit status 2. ``--check-files`` also requires
the model, recorded machines and an explicit binary to exist; ``--dump`` prints each file with every default
filled in (as YAML); ``--reference`` prints the key reference (docs/topology.md).
"""

from __future__ import annotations

import argparse
import sys

from orchestrator.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.config",
                                     description="Validate topology.yaml files.")
    parser.add_argument("files", nargs="*", metavar="FILE", help="topology files to check")
    parser.add_argument("--check-files", action="store_true",
                        help="also require the model, recorded machines and an explicit binary to exist")
    parser.add_argument("--dump", action="store_true", help="print each topology with every default filled in")
    parser.add_argument("--reference", action="store_true", help="print the key reference (Markdown)")
    args = parser.parse_args(argv)
    if args.reference:
        from orchestrator.config.reference import reference_markdown

        sys.stdout.write(reference_markdown())
        return 0
    if not args.files:
        parser.error("give at least one FILE (or --reference)")

    from orchestrator.config.loader import load_topology

    status = 0
    for name in args.files:
        try:
            topo = load_topology(name)
            if args.check_files:
                topo.check_files()
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            status = err.exit_code
            continue
        if args.dump:
            import yaml

            print(f"# {name}")
            sys.stdout.write(yaml.safe_dump(topo.to_dict(), sort_keys=False, default_flow_style=None))
        else:
            print(f"{name}: ok")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
