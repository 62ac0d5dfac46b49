"""The topology.yaml key reference (docs/topology.md), generated from the schema's field docstrings.

``python -m orchestrator.config --reference > docs/topology.md``; a test keeps the file equal to this output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from pydantic.fields import FieldInfo

from orchestrator.config.schema import SECTIONS
from orchestrator.config.types import Accepts, fmt_seconds
from orchestrator.units import fmt_bytes


@dataclass(frozen=True)
class KeyDoc:
    section: str        # "workers"
    key: str            # "workers.threads" / "nodes[].gpus"
    path: tuple         # ("workers", "threads") / ("nodes", 0, "gpus"): where it sits in a file
    accepts: str
    default: str        # as YAML would spell it; "(required)" when there is none
    doc: str
    required: bool


def accepts_of(field: FieldInfo) -> Accepts | None:
    for m in field.metadata:
        if isinstance(m, Accepts):
            return m
    return None


def default_text(field: FieldInfo, accepts: Accepts | None) -> str:
    if field.is_required():
        return "(required)"
    v = field.get_default(call_default_factory=True)
    return yaml_value(v, accepts.kind if accepts else "")


def yaml_value(v: Any, kind: str = "") -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(yaml_value(x, kind) for x in v) + "]"
    if kind == "duration" and isinstance(v, (int, float)):
        return fmt_seconds(v)
    if kind == "size" and isinstance(v, int):
        return fmt_bytes(v).replace(" ", "")
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _clean(doc: str | None) -> str:
    return " ".join((doc or "").split())


def keys() -> Iterator[KeyDoc]:
    """Every key of every section, in schema order."""
    for section, model in SECTIONS.items():
        for name, field in model.model_fields.items():
            acc = accepts_of(field)
            if section == "nodes":
                key, path = f"nodes[].{name}", ("nodes", 0, name)
            else:
                key, path = f"{section}.{name}", (section, name)
            yield KeyDoc(section, key, path, acc.text if acc else "", default_text(field, acc),
                         _clean(field.description), field.is_required())


INTRO = """\
# topology.yaml reference

A topology says what to serve, on which machines, and how; `orchestrator plan`, `up` and `bench` read it.
Only `model` is required:

```yaml
model: models/demo-moe.gguf
```

Everything left out is **decided by the plan**: it reads as `auto` (or `null` where noted), and
`orchestrator plan` prints what it chose and why. Unknown keys are errors (with a did-you-mean), as are
duplicate keys, wrong types and absurd values; every error is one line naming the file, the line and the key:

```
topologies/mine.yaml:7: workers.numa: got 'interleaved' (expected one of auto, bind, interleave, none; did you mean 'interleave'?)
```

Check a file without planning: `python -m orchestrator.config FILE.yaml` (add `--check-files` to also require
the model and recorded machines to exist, `--dump` to print it with every default filled in).

Conventions:

- **Sizes**: `24GiB`, `512MiB`, `1.5GiB` (binary units), `24GB` (decimal); a bare number is bytes.
- **Durations**: `30s`, `500ms`, `5m`, `1h`; a bare number is seconds.
- **Paths** are relative to the folder of the topology file; `~` is expanded.
- **GPU selections**: `all`, `none`, `0`, `[0, 1]`, `"0-3"` (NVML indices).
- YAML reads `on`/`off`/`yes`/`no` as booleans; keys whose values are on/off (`smt`, `flash_attn`) accept
  both spellings.
- A section may be written empty (`gateway:`): all its keys take their defaults.
- Top-level keys starting with `x-` are ignored: a place for YAML anchors
  (`x-gpu-node: &gpu {gpus: all, vram_reserve: 1GiB}`, then `- {<<: *gpu, name: a}`).

`topologies/example.yaml` writes out every key with its default and a comment; the other files in
`topologies/` are realistic starting points (this machine, 1 socket + 1 GPU, 2 sockets + 2 or 8 GPUs, an H200).
"""


def reference_markdown() -> str:
    out = [INTRO]
    for section, model in SECTIONS.items():
        title = f"`{section}:`" + (" (a list; each item:)" if section == "nodes" else "")
        out.append(f"\n## {title}\n\n{_clean(model.__doc__)}\n")
        out.append("\n| key | values | default | meaning |\n|---|---|---|---|\n")
        for k in keys():
            if k.section != section:
                continue
            out.append(f"| `{k.key}` | {_cell(k.accepts)} | `{k.default}` | {_cell(k.doc)} |\n")
    return "".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")

