"""Small value types for topology.yaml, each parsing its shorthand once.

Every type is an ``Annotated`` pydantic type with a plain validator (so pydantic never guesses through a union)
and an :class:`Accepts` note saying how the value is written; the note is used in error messages
(``… (expected auto or an integer 1..4096)``) and in the key reference (docs/topology.md).

Values the user leaves to the plan are the string ``"auto"`` (:data:`AUTO`), never a guess made here.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import PlainSerializer, PlainValidator, ValidationInfo
from pydantic_core import PydanticCustomError

from orchestrator.units import GiB, KiB, MiB, fmt_bytes, parse_cpulist, parse_size

AUTO = "auto"
TiB = 1024**4

Auto = Literal["auto"]


def is_auto(value: Any) -> bool:
    """True when the plan decides this value."""
    return isinstance(value, str) and value == AUTO


@dataclass(frozen=True)
class Accepts:
    """How a value is written in YAML, e.g. ``"auto or an integer 1..4096"``; ``kind`` says how its stored
    value reads back (``"duration"``: seconds, ``"size"``: bytes)."""

    text: str
    kind: str = ""


def _plain(v: Any) -> Any:
    """Serialize tuples as lists (JSON and YAML have no tuples)."""
    return list(v) if isinstance(v, tuple) else v


_AS_PLAIN = PlainSerializer(_plain)


def fail(message: str) -> None:
    """Raise a validation error whose text is exactly ``message`` (no pydantic prefix)."""
    raise PydanticCustomError("config_value", "{message}", {"message": message})


def describe(value: Any) -> str:
    """A YAML value as the user wrote it, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return repr(value)


def did_you_mean(word: str, choices, *, cutoff: float = 0.6) -> str | None:
    """The closest of ``choices`` to ``word`` (difflib), or None."""
    if not isinstance(word, str):
        return None
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered:
        return lowered[word.lower()]
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[close[0]] if close else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fmt_size_bound(n: int) -> str:
    if n == 0:
        return "0"
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return fmt_bytes(n)


# --------------------------------------------------------------------------------------------------- integers


def _int_check(value: Any, lo: int, hi: int, accepts: str) -> int:
    if not _is_int(value):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            fail(f"got {describe(value)} (expected {accepts})")
    if value < lo or value > hi:
        fail(f"{value} is out of range (expected {accepts})")
    return value


def Int(lo: int, hi: int) -> Any:
    """An integer lo..hi."""
    accepts = f"an integer {lo}..{hi}"
    return Annotated[int, PlainValidator(lambda v: _int_check(v, lo, hi, accepts)), Accepts(accepts)]


def AutoInt(lo: int, hi: int, *, words: tuple[str, ...] = ()) -> Any:
    """``auto`` (the plan decides), one of ``words`` (e.g. ``off``), or an integer lo..hi."""
    all_words = (AUTO, *words)
    accepts = ", ".join(all_words) + f" or an integer {lo}..{hi}"

    def check(v: Any) -> Any:
        if isinstance(v, bool) and "off" in words and v is False:
            return "off"  # YAML 1.1 reads `off` as false
        if isinstance(v, str):
            if v in all_words:
                return v
            if v.strip().lstrip("-").isdigit():
                fail(f"got {describe(v)}, a string (expected {accepts}; write the number without quotes)")
            hint = did_you_mean(v, all_words)
            fail(f"got {describe(v)} (expected {accepts}" + (f"; did you mean '{hint}'?)" if hint else ")"))
        return _int_check(v, lo, hi, accepts)

    base = Union[Literal[all_words], int]  # type: ignore[valid-type]
    return Annotated[base, PlainValidator(check), Accepts(accepts)]


def Port(*, auto: bool = False) -> Any:
    """A TCP port 1..65535 (or ``auto``)."""
    return AutoInt(1, 65535) if auto else Int(1, 65535)


# ------------------------------------------------------------------------------------------------------- words


def Choice(*words: str, bools: tuple[str, str] | None = None) -> Any:
    """One of ``words``. ``bools=(yes_word, no_word)`` also accepts true/false (YAML 1.1 reads on/off/yes/no
    as booleans, so ``smt: on`` arrives as True)."""
    accepts = "one of " + ", ".join(words)

    def check(v: Any) -> str:
        if isinstance(v, bool) and bools is not None:
            return bools[0] if v else bools[1]
        if isinstance(v, str) and v in words:
            return v
        hint = did_you_mean(v, words) if isinstance(v, str) else None
        fail(f"got {describe(v)} (expected {accepts}" + (f"; did you mean '{hint}'?)" if hint else ")"))
        raise AssertionError  # unreachable

    return Annotated[Literal[words], PlainValidator(check), Accepts(accepts)]  # type: ignore[valid-type]


def _bool_check(v: Any, accepts: str) -> bool:
    if isinstance(v, bool):
        return v
    fail(f"got {describe(v)} (expected {accepts})")
    raise AssertionError  # unreachable


Bool = Annotated[bool, PlainValidator(lambda v: _bool_check(v, "true or false")), Accepts("true or false")]


def _auto_bool(v: Any) -> Any:
    if isinstance(v, str) and v == AUTO:
        return AUTO
    return _bool_check(v, "auto, true or false")


AutoBool = Annotated[Union[Auto, bool], PlainValidator(_auto_bool), Accepts("auto, true or false")]


# ------------------------------------------------------------------------------------------------------- sizes


def _size_check(v: Any, lo: int, hi: int, accepts: str) -> int:
    if v is None or isinstance(v, (bool, list, tuple, dict)):
        fail(f"got {describe(v)} (expected {accepts})")
    if isinstance(v, (int, float)) and v < 0 or isinstance(v, str) and v.strip().startswith("-"):
        fail(f"{v} is negative (expected {accepts})")
    try:
        n = parse_size(v)
    except ValueError:
        fail(f"got {describe(v)} (expected {accepts})")
        raise AssertionError  # unreachable
    if n < lo or n > hi:
        unitless = isinstance(v, (int, float)) or (isinstance(v, str) and v.strip().replace(".", "", 1).isdigit())
        if unitless:
            hint = f"; a number without a unit is bytes: did you mean '{v}GiB'?" if n < lo else ""
            fail(f"{v} bytes is out of range (expected {accepts}{hint})")
        fail(f"{v} is out of range (expected {accepts})")
    return n


def _size_accepts(lo: int, hi: int) -> str:
    return f"a size like 24GiB or 512MiB, {_fmt_size_bound(lo)}..{_fmt_size_bound(hi)}"


def Size(lo: int, hi: int) -> Any:
    """A byte size (``24GiB``, ``512 MiB``, ``1.5G``; a bare number is bytes), stored as int bytes."""
    accepts = _size_accepts(lo, hi)
    return Annotated[int, PlainValidator(lambda v: _size_check(v, lo, hi, accepts)), Accepts(accepts, "size")]


def AutoSize(lo: int, hi: int, *, words: tuple[str, ...] = ()) -> Any:
    """``auto``, one of ``words`` (e.g. ``off``) or a byte size."""
    accepts = ", ".join((AUTO, *words)) + (" or " if not words else ", or ") + _size_accepts(lo, hi)

    def check(v: Any) -> Any:
        if isinstance(v, bool) and "off" in words and v is False:
            return "off"  # YAML 1.1 reads `off` as false
        if isinstance(v, str) and (v == AUTO or v in words):
            return v
        return _size_check(v, lo, hi, accepts)

    if not words:
        return Annotated[Union[Auto, int], PlainValidator(check), Accepts(accepts, "size")]
    return Annotated[Union[Literal[(AUTO, *words)], int], PlainValidator(check),  # type: ignore[valid-type]
                     Accepts(accepts, "size")]


def AutoSizeList(lo: int, hi: int) -> Any:
    """``auto``, one size for every GPU, or a list of sizes (one per GPU, in the order of ``gpus``)."""
    one = _size_accepts(lo, hi)
    accepts = f"auto, {one} for every GPU, or a list of such sizes, one per GPU"

    def check(v: Any) -> Any:
        if isinstance(v, str) and v == AUTO:
            return AUTO
        if isinstance(v, (list, tuple)):
            if not v:
                fail(f"got an empty list (expected {accepts})")
            return tuple(_size_check(x, lo, hi, accepts) for x in v)
        return _size_check(v, lo, hi, accepts)

    base = Union[Auto, int, tuple[int, ...]]
    return Annotated[base, PlainValidator(check), _AS_PLAIN, Accepts(accepts, "size")]


# --------------------------------------------------------------------------------------------------- durations

_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|min|h)?\s*$")
_DURATION_UNITS = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """``30`` / ``"30s"`` / ``"500ms"`` / ``"5m"`` / ``"1h"`` → seconds. Raises ValueError."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"expected a duration like '30s', got {describe(value)}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a duration must not be negative, got {value}")
        return float(value)
    m = _DURATION_RE.match(str(value))
    if not m:
        raise ValueError(f"expected a duration like '30s', got {describe(value)}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def fmt_seconds(s: float) -> str:
    """Seconds as a duration a user would write: 300 → 5m, 0.5 → 500ms."""
    if s == 0:
        return "0s"
    if s >= 3600 and s % 3600 == 0:
        return f"{int(s // 3600)}h"
    if s >= 60 and s % 60 == 0:
        return f"{int(s // 60)}m"
    if s < 1:
        return f"{int(round(s * 1000))}ms"
    return f"{s:g}s"


def _duration_check(v: Any, lo: float, hi: float, accepts: str) -> float:
    if isinstance(v, str) and v.strip().startswith("-") or _is_int(v) and v < 0:
        fail(f"{v} is negative (expected {accepts})")
    try:
        s = parse_duration(v)
    except ValueError:
        fail(f"got {describe(v)} (expected {accepts})")
        raise AssertionError  # unreachable
    if s < lo or s > hi:
        fail(f"{v} is out of range (expected {accepts})")
    return s


def Duration(lo: float, hi: float) -> Any:
    """A duration in seconds (``30``, ``"30s"``, ``"500ms"``, ``"5m"``, ``"1h"``), stored as float seconds."""
    accepts = f"a duration like 30s, 500ms or 5m, {fmt_seconds(lo)}..{fmt_seconds(hi)}"

    def check(v: Any) -> float:
        return _duration_check(v, lo, hi, accepts)

    return Annotated[float, PlainValidator(check), Accepts(accepts, "duration")]


def AutoDuration(lo: float, hi: float) -> Any:
    """``auto`` (the plan or the machine decides) or a duration as :func:`Duration` reads it."""
    accepts = f"auto or a duration like 30s, 500ms or 5m, {fmt_seconds(lo)}..{fmt_seconds(hi)}"

    def check(v: Any) -> Any:
        if isinstance(v, str) and v.strip() == AUTO:
            return AUTO
        return _duration_check(v, lo, hi, accepts)

    return Annotated[Union[Literal[AUTO], float], PlainValidator(check),  # type: ignore[valid-type]
                     Accepts(accepts, "duration")]


# ---------------------------------------------------------------------------------------------------- GPU lists

MAX_GPU_INDEX = 255
_GPU_ACCEPTS = "all, none, an index, a list of indices like [0, 1], or a range like \"0-3\""


def _gpus(v: Any) -> Any:
    if isinstance(v, str):
        word = v.strip()
        if word == "all":
            return "all"
        if word == "none":
            return ()
        try:
            indices = parse_cpulist(word)
        except ValueError:
            indices = None
        if not indices:
            hint = did_you_mean(word, ("all", "none"))
            fail(f"got {describe(v)} (expected {_GPU_ACCEPTS}" + (f"; did you mean '{hint}'?)" if hint else ")"))
        v = list(indices)
    if _is_int(v):
        v = [v]
    if isinstance(v, (list, tuple)):
        seen: set[int] = set()
        for x in v:
            if not _is_int(x):
                fail(f"GPU index {describe(x)} is not an integer (expected {_GPU_ACCEPTS})")
            if x < 0 or x > MAX_GPU_INDEX:
                fail(f"GPU index {x} is out of range (expected 0..{MAX_GPU_INDEX})")
            if x in seen:
                fail(f"GPU {x} is listed twice")
            seen.add(x)
        return tuple(v)
    fail(f"got {describe(v)} (expected {_GPU_ACCEPTS})")


GpuSelection = Annotated[Union[Literal["all"], tuple[int, ...]], PlainValidator(_gpus), _AS_PLAIN,
                         Accepts(_GPU_ACCEPTS)]
"""``"all"`` or a tuple of GPU indices (empty: no GPU), in the order the user gave."""


# -------------------------------------------------------------------------------------------------- strings


def Text(pattern: str, accepts: str, *, nullable: bool = False, max_len: int = 256) -> Any:
    """A string matching ``pattern`` (full match); with ``nullable``, null is allowed."""
    rx = re.compile(pattern)
    full = accepts + (" or null" if nullable else "")

    def check(v: Any) -> Any:
        if v is None and nullable:
            return None
        if not isinstance(v, str):
            quote = "; quote it" if isinstance(v, (int, float, bool)) else ""
            fail(f"got {describe(v)} (expected {full}{quote})")
        if len(v) > max_len or not rx.fullmatch(v):
            fail(f"got {describe(v)} (expected {full})")
        return v

    base = Union[str, None] if nullable else str
    return Annotated[base, PlainValidator(check), Accepts(full)]


Name = Text(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", "a name of letters, digits, '_', '.', '-' (at most 63)")
EnvVarName = Text(r"[A-Za-z_][A-Za-z0-9_]*", "the name of an environment variable (like ORCHESTRATOR_API_KEY)",
                  nullable=True)
Alias = Text(r"[^\s/][^\s]*", "a model name without spaces (what clients send as \"model\")", nullable=True)
CorsOrigins = Text(r"\*|localhost|https?://[^\s,]+(\s*,\s*https?://[^\s,]+)*",
                   "*, localhost, or a comma-separated list of origins like https://app.example.com", nullable=True)
Namespace = Text(r"[A-Za-z0-9_.-]{1,64}", "a Ray namespace (letters, digits, '_', '.', '-')")

_HOSTNAME_RE = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                          r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def is_host(text: str) -> bool:
    """An IPv4/IPv6 address or a DNS host name (no port, no scheme)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME_RE.fullmatch(text))


def _split_host_port(text: str) -> tuple[str, str] | None:
    if text.startswith("["):  # [::1]:6379
        host, sep, port = text[1:].partition("]:")
        return (host, port) if sep else None
    host, sep, port = text.rpartition(":")
    return (host, port) if sep else None


def Host(accepts: str = "an IP address or host name", *, nullable: bool = False) -> Any:
    full = accepts + (" or null" if nullable else "")

    def check(v: Any) -> Any:
        if v is None and nullable:
            return None
        if not isinstance(v, str) or not is_host(v):
            why = ""
            if isinstance(v, str) and "://" in v:
                why = "; give the host only, without a scheme"
            elif isinstance(v, str) and _split_host_port(v) and is_host(_split_host_port(v)[0]):
                why = "; give the host only, without a port"
            fail(f"got {describe(v)} (expected {full}{why})")
        return v

    return Annotated[Union[str, None] if nullable else str, PlainValidator(check), Accepts(full)]


_RAY_ACCEPTS = "local, auto, ray://HOST:PORT or HOST:PORT"


def _ray_address(v: Any) -> str:
    if isinstance(v, str):
        if v in ("local", "auto"):
            return v
        rest = v[len("ray://"):] if v.startswith("ray://") else v
        hp = _split_host_port(rest)
        if "://" not in rest and hp and is_host(hp[0]) and hp[1].isdigit() and 1 <= int(hp[1]) <= 65535:
            return v
        if "://" in v and not v.startswith("ray://"):
            fail(f"got {describe(v)} (expected {_RAY_ACCEPTS}; the only scheme Ray clients use is ray://)")
        hint = did_you_mean(v, ("local", "auto"))
        if hint:
            fail(f"got {describe(v)} (expected {_RAY_ACCEPTS}; did you mean '{hint}'?)")
    fail(f"got {describe(v)} (expected {_RAY_ACCEPTS})")
    raise AssertionError  # unreachable


RayAddress = Annotated[str, PlainValidator(_ray_address), Accepts(_RAY_ACCEPTS)]


def _arg_list(v: Any) -> tuple[str, ...]:
    accepts = "a list of strings, one per argument, like [\"--no-warmup\", \"--seed\", \"1\"]"
    if isinstance(v, str):
        fail(f"got the string {describe(v)} (expected {accepts}; arguments are never split by a shell)")
    if not isinstance(v, (list, tuple)):
        fail(f"got {describe(v)} (expected {accepts})")
    for i, x in enumerate(v):
        if not isinstance(x, str):
            fail(f"item {i} is {describe(x)}, not a string (expected {accepts}; quote numbers)")
        if "\x00" in x or "\n" in x:
            fail(f"item {i} contains a NUL or newline character")
    return tuple(v)


ArgList = Annotated[tuple[str, ...], PlainValidator(_arg_list), _AS_PLAIN,
                    Accepts("a list of strings, one per argument, like [\"--no-warmup\", \"--seed\", \"1\"]")]


# --------------------------------------------------------------------------------------------------- file paths

def _base_dir(info: ValidationInfo | None) -> str | None:
    ctx = info.context if info is not None else None
    return (ctx or {}).get("base_dir")


def resolve_path(text: str, base_dir: str | None) -> str:
    """``~`` expanded; a relative path joined to ``base_dir`` (the topology file's folder); normalized but
    symlinks kept, so messages show the path the user would recognise."""
    p = os.path.expanduser(text)
    if not os.path.isabs(p) and base_dir is not None:
        p = os.path.join(base_dir, p)
    return os.path.normpath(os.path.abspath(p))


def FilePath(accepts: str, *, words: tuple[str, ...] = (), suffixes: tuple[str, ...] = ()) -> Any:
    """A file path (relative paths are resolved against the topology file's folder), or one of ``words``.
    With ``suffixes``, the file name must end with one of them. Existence is checked later by
    :meth:`Topology.check_files`, so a topology can be validated on another machine."""
    full = ((", ".join(words) + " or ") if words else "") + accepts

    def check(v: Any, info: ValidationInfo) -> str:
        if isinstance(v, str) and v in words:
            return v
        if not isinstance(v, str) or not v.strip():
            fail(f"got {describe(v)} (expected {full})")
        if "\x00" in v:
            fail(f"got {describe(v)} (expected {full}; it contains a NUL character)")
        if suffixes and not v.lower().endswith(suffixes):
            hint = did_you_mean(v, words, cutoff=0.7) if words else None
            fail(f"got {describe(v)} (expected {full}" + (f"; did you mean '{hint}'?)" if hint else ")"))
        return resolve_path(v, _base_dir(info))

    return Annotated[str, PlainValidator(check), Accepts(full)]


# A model named by URL (https://, http://), Hub file (hf://ORG/REPO/FILE.gguf) or Hub quantization (ORG/REPO:QUANT):
# kept as written (orchestrator.model.remote reads and downloads it); anything else is a local path.
_REMOTE_MODEL_RE = re.compile(r"^(?:(?:https?|hf)://\S+|[A-Za-z0-9][\w.-]*/[\w.-]+:[\w.-]+)$")


def is_remote_model(text: str) -> bool:
    return bool(_REMOTE_MODEL_RE.match(text))


def ModelPath(accepts: str) -> Any:
    """A local .gguf path (resolved like :func:`FilePath`) or a remote model reference, kept verbatim."""
    local = FilePath(accepts, suffixes=(".gguf",))
    check_local = local.__metadata__[0].func

    def check(v: Any, info: ValidationInfo) -> str:
        if isinstance(v, str) and is_remote_model(v.strip()):
            return v.strip()
        return check_local(v, info)

    return Annotated[str, PlainValidator(check), Accepts(accepts)]
