"""Shorthand is parsed once into canonical values: sizes in bytes, durations in seconds, GPU tuples, auto."""

import os

import pytest
import yaml

from orchestrator.config import AUTO, Topology, is_auto, load_topology, parse_duration, parse_topology
from orchestrator.errors import ConfigError
from orchestrator.units import GiB, MiB


def topo(text: str, base_dir: str = "/srv/topo") -> Topology:
    return parse_topology(text, source="t.yaml", base_dir=base_dir)


def test_minimal_topology_leaves_everything_to_the_plan():
    t = topo("model: m.gguf\n")
    assert t.model.path == "/srv/topo/m.gguf"
    for value in (t.model.context, t.model.parallel, t.model.cache_type_k, t.model.flash_attn, t.workers.layout,
                  t.workers.threads, t.workers.batch, t.workers.numa, t.workers.op_offload_min_batch,
                  t.workers.disable_numa_balancing, t.nodes[0].vram_limit, t.nodes[0].vram_reserve,
                  t.backend.binary, t.backend.flavor):
        assert is_auto(value), value
    assert t.model.alias is None and t.workers.host is None
    assert [n.name for n in t.nodes] == ["local"]
    assert t.nodes[0].machine == "live" and t.nodes[0].gpus == "all" and t.nodes[0].address is None
    assert (t.gateway.host, t.gateway.port, t.gateway.api_key_env) == ("127.0.0.1", 8080, None)
    assert t.gateway.cors_origins == "localhost"
    assert (t.ray.address, t.ray.dashboard_host, t.ray.dashboard_port) == ("local", "127.0.0.1", 8265)
    assert t.workers.warmup is False and t.workers.extra_args == ()


def test_model_shorthand_equals_long_form():
    assert topo("model: m.gguf\n").to_dict() == topo("model: {path: m.gguf}\n").to_dict()


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * GiB), ("512 MiB", 512 * MiB), ("1.5GiB", int(1.5 * GiB)), ("24GB", 24 * 10**9),
    (2 * GiB, 2 * GiB), ("[8GiB, 12GiB]", (8 * GiB, 12 * GiB)), ("auto", AUTO),
])
def test_vram_limit_values(text, expected):
    gpus = "[0, 1]" if str(text).startswith("[") else "all"
    t = topo(f"model: m.gguf\nnodes:\n  - gpus: {gpus}\n    vram_limit: {text}\n")
    assert t.nodes[0].vram_limit == expected


@pytest.mark.parametrize("text,expected", [
    ("all", "all"), ("none", ()), ("0", (0,)), ("[0, 1]", (0, 1)), ('"0-3"', (0, 1, 2, 3)), ('"0,2"', (0, 2)),
    ("[3, 1]", (3, 1)), ("[]", ()),
])
def test_gpu_selection(text, expected):
    assert topo(f"model: m.gguf\nnodes:\n  - gpus: {text}\n").nodes[0].gpus == expected


@pytest.mark.parametrize("text,seconds", [("30", 30.0), ("30s", 30.0), ("500ms", 0.5), ("5m", 300.0),
                                          ("1h", 3600.0), ("1.5s", 1.5), ("2 min", 120.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds
    t = topo(f"model: m.gguf\nrestart:\n  backoff_initial: 0\n  backoff_max: '{text}'\n")
    assert t.restart.backoff_max == seconds


@pytest.mark.parametrize("word,value", [("on", "on"), ("off", "off"), ("yes", "on"), ("false", "off"),
                                        ('"on"', "on"), ("auto", "auto")])
def test_on_off_keys_accept_yaml_booleans(word, value):
    # YAML 1.1 reads on/off/yes/no as booleans: `smt: on` must still mean "on"
    t = topo(f"model: {{path: m.gguf, flash_attn: {word}}}\nworkers: {{smt: {word}}}\n")
    assert t.workers.smt == value and t.model.flash_attn == value


def test_op_offload_min_batch_off_and_number():
    assert topo("model: m.gguf\nworkers: {op_offload_min_batch: off}\n").workers.op_offload_min_batch == "off"
    assert topo("model: m.gguf\nworkers: {op_offload_min_batch: 64}\n").workers.op_offload_min_batch == 64


@pytest.mark.parametrize("address", ["local", "auto", "10.0.0.1:6379", "ray://head.example:10001",
                                     "head:6379", "[::1]:6379"])
def test_ray_addresses(address):
    assert topo(f"model: m.gguf\nray: {{address: '{address}'}}\n").ray.address == address


def test_relative_paths_resolve_against_the_topology_folder(tmp_path):
    sub = tmp_path / "topologies"
    sub.mkdir()
    f = sub / "t.yaml"
    f.write_text("model: ../models/m.gguf\nbackend: {binary: bin/llama-server}\n"
                 "nodes:\n  - machine: ../machines/box.json\n")
    t = load_topology(f)
    assert t.model.path == str(tmp_path / "models" / "m.gguf")
    assert t.backend.binary == str(sub / "bin" / "llama-server")
    assert t.nodes[0].machine == str(tmp_path / "machines" / "box.json")


def test_relative_paths_resolve_the_same_from_any_working_directory(tmp_path, monkeypatch):
    f = tmp_path / "t.yaml"
    f.write_text("model: m.gguf\n")
    monkeypatch.chdir("/")
    assert load_topology(os.path.relpath(f, "/")).model.path == str(tmp_path / "m.gguf")


def test_absolute_and_home_paths(monkeypatch):
    monkeypatch.setenv("HOME", "/home/me")
    assert topo("model: /data/m.gguf\n").model.path == "/data/m.gguf"
    assert topo("model: ~/m.gguf\n").model.path == "/home/me/m.gguf"


def test_empty_section_means_defaults():
    assert topo("model: m.gguf\ngateway:\nworkers:\n").to_dict() == topo("model: m.gguf\n").to_dict()


def test_topology_is_frozen():
    t = topo("model: m.gguf\n")
    with pytest.raises(Exception):
        t.workers.threads = 4  # type: ignore[misc]
    hash(t.workers)  # frozen models hash: usable as cache keys by the planner


def test_to_dict_roundtrips_through_yaml(tmp_path):
    src = load_topology(os.path.join(os.path.dirname(__file__), "..", "..", "topologies", "2socket-8gpu.yaml"))
    f = tmp_path / "dumped.yaml"
    f.write_text(yaml.safe_dump(src.to_dict()))
    again = load_topology(f)
    assert again.to_dict() == src.to_dict()
    d = src.to_dict()
    assert d["nodes"][0]["gpus"] == "all" and d["nodes"][0]["ram_reserve"] == 32 * GiB
    assert d["restart"]["startup_timeout"] == 3600.0


def test_yaml_anchors_and_merge_keys():
    t = topo("x-gpu-node: &gpu {gpus: all, vram_reserve: 2GiB}\n"
             "model: m.gguf\n"
             "ray: {address: auto}\n"
             "nodes:\n"
             "  - {<<: *gpu, name: a, address: 10.0.0.1}\n"
             "  - <<: *gpu\n"
             "    name: b\n"
             "    address: 10.0.0.2\n"
             "    vram_reserve: 1GiB\n")
    assert [(n.name, n.vram_reserve) for n in t.nodes] == [("a", 2 * GiB), ("b", GiB)]


def test_error_inside_a_merged_mapping_points_at_the_anchor():
    with pytest.raises(ConfigError) as info:
        topo("x-base: &base\n  threads: lots\nmodel: m.gguf\nworkers:\n  <<: *base\n")
    assert str(info.value) == "t.yaml:2: workers.threads: got 'lots' (expected auto or an integer 1..4096)"


def test_explicit_keys_are_known_to_the_planner():
    t = topo("model: m.gguf\nworkers: {numa: auto, threads: 8}\n")
    assert t.workers.explicit("numa") and t.workers.explicit("threads") and not t.workers.explicit("batch")


def test_planner_errors_point_at_the_key(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("model: m.gguf\nnodes:\n  - name: box\n    gpus: [0, 3]\n")
    t = load_topology(f)
    assert t.where("nodes.0.gpus") == f"{f}:4"
    assert t.where("nodes.0.vram_limit") == f"{f}:3"  # not written: the node's line
    err = t.error("nodes.0.gpus", "GPU 3 does not exist (the machine has GPUs 0-1)")
    assert isinstance(err, ConfigError)
    assert str(err) == f"{f}:4: nodes[0].gpus: GPU 3 does not exist (the machine has GPUs 0-1)"


def test_check_files(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("model: m.gguf\nnodes:\n  - machine: box.json\n")
    t = load_topology(f)
    with pytest.raises(ConfigError) as info:
        t.check_files()
    assert str(info.value) == f"{f}:1: model.path: model file {tmp_path / 'm.gguf'} does not exist"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError) as info:
        t.check_files()
    assert str(info.value) == f"{f}:3: nodes[0].machine: recorded machine {tmp_path / 'box.json'} does not exist"
    (tmp_path / "box.json").write_text("{}")
    t.check_files()


def test_check_files_binary_must_be_executable(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    f = tmp_path / "t.yaml"
    f.write_text("model: m.gguf\nbackend:\n  binary: llama-server\n")
    with pytest.raises(ConfigError) as info:
        load_topology(f).check_files()
    assert str(info.value) == f"{f}:3: backend.binary: {tmp_path / 'llama-server'} is not executable"
    (tmp_path / "llama-server").chmod(0o755)
    load_topology(f).check_files()


def test_override_revalidates_and_keeps_what_the_plan_decides(tmp_path):
    from orchestrator.config import parse_overrides

    f = tmp_path / "t.yaml"
    f.write_text("model: m.gguf\nnodes:\n  - gpus: [0]\n    vram_limit: 12GiB\n")
    t = load_topology(f)
    budgets = [t.override(parse_overrides([f"nodes.0.vram_limit={gib}GiB"])) for gib in (8, 12, 16)]
    assert [b.nodes[0].vram_limit for b in budgets] == [8 * GiB, 12 * GiB, 16 * GiB]
    assert all(is_auto(b.workers.batch) and not b.workers.explicit("batch") for b in budgets)
    # the value now comes from the command line, not from line 4 of the file: no line is named for it
    assert budgets[0].where("nodes.0.vram_limit") == f"{f} (from --set)"
    assert budgets[0].where("nodes.0.gpus") == f"{f}:3" and budgets[0].where("model") == f"{f}:1"
    assert t.nodes[0].vram_limit == 12 * GiB  # the original is unchanged
    u = t.override({"workers.threads": 8, "nodes.1.name": "b", "nodes.1.address": "10.0.0.2",
                    "nodes.0.address": "10.0.0.1", "ray.address": "auto"})
    assert u.workers.threads == 8 and [n.name for n in u.nodes] == ["local", "b"]


def test_an_error_about_a_set_key_names_no_line_of_the_file(tmp_path):
    """`--set backend.binary=...` of a file without a backend section was reported at the first line of the
    file (its `model:`): a key given on the command line has no line there. A relative path given there is taken
    from the current directory, as the shell completes it."""
    from orchestrator.config import parse_overrides

    f = tmp_path / "t.yaml"
    f.write_text("# a comment\n\nmodel: m.gguf\n")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    t = load_topology(f).override(parse_overrides(["backend.binary=no-such-llama-server"]))
    with pytest.raises(ConfigError) as info:
        t.check_files()
    missing = os.path.join(os.getcwd(), "no-such-llama-server")
    assert str(info.value) == f"{f} (from --set): backend.binary: llama-server binary {missing} does not exist"


@pytest.mark.parametrize("items,expected", [
    (["workers.thread=3"], "override: workers.thread: unknown key (did you mean 'threads'?)"),
    (["workers.threads=0"], "override: workers.threads: 0 is out of range (expected auto or an integer 1..4096)"),
    (["nodes.3.name=x"], "override nodes[3].name: no item 3 in nodes"),
    (["threads"], "override 'threads': expected KEY=VALUE, like workers.threads=8"),
    (["workers.threads=[1"], "override 'workers.threads=[1': the value is not valid YAML"),
])
def test_override_errors(items, expected):
    from orchestrator.config import parse_overrides

    with pytest.raises(ConfigError) as info:
        topo("model: m.gguf\n").override(parse_overrides(items))
    assert str(info.value) == expected
