import pytest

from orchestrator.units import GiB, MiB, fmt_bytes, format_cpulist, parse_cpulist, parse_cpumask, parse_size


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * GiB), ("512 MiB", 512 * MiB), ("1.5GiB", int(1.5 * GiB)), ("2G", 2 * 10**9), (1024, 1024),
    ("0", 0), ("3TiB", 3 * 1024**4),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", "lots", "12 parsecs", True, -5, ""])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_fmt_bytes():
    assert fmt_bytes(3 * GiB) == "3.0 GiB"
    assert fmt_bytes(1536 * MiB) == "1.5 GiB"
    assert fmt_bytes(10) == "10 B"
    assert fmt_bytes(None) == "?"


@pytest.mark.parametrize("text,cpus", [
    ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)), ("", ()), ("5", (5,)), ("0-7:2", (0, 2, 4, 6)), ("3,1,2", (1, 2, 3)),
])
def test_cpulist_roundtrip(text, cpus):
    assert parse_cpulist(text) == cpus
    assert parse_cpulist(format_cpulist(cpus)) == cpus


def test_format_cpulist():
    assert format_cpulist([0, 1, 2, 3, 16, 17, 18, 19, 5]) == "0-3,5,16-19"


def test_parse_cpumask():
    assert parse_cpumask("0000ff00") == tuple(range(8, 16))
    assert parse_cpumask("00000001,00000000") == (32,)
    assert parse_cpumask("00000000") == ()


def test_bad_range():
    with pytest.raises(ValueError):
        parse_cpulist("7-3")
