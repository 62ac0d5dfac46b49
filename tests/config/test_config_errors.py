"""Every class of bad topology gives one exact line: FILE:LINE: key.path: what is wrong (expected …)."""

import pytest

from orchestrator.config import load_topology
from orchestrator.errors import ConfigError, OrchestratorError

M = "model: m.gguf\n"

CASES = [
    # --- unknown keys: did-you-mean from the schema, or where the key belongs
    ("modle: m.gguf\n",
     "1: modle: unknown key (did you mean 'model'?)"),
    (M + "workers:\n  numaa: bind\n",
     "3: workers.numaa: unknown key (did you mean 'numa'?)"),
    (M + "nodes:\n  - name: a\n    gpu: [0]\n",
     "4: nodes[0].gpu: unknown key (did you mean 'gpus'?)"),
    (M + "threads: 4\n",
     "2: threads: unknown key here (it belongs at workers.threads)"),
    (M + "gateway:\n  api_key: secret\n",
     "3: gateway.api_key: unknown key (did you mean 'api_key_env'?)"),
    (M + "colour: blue\n",
     "2: colour: unknown key (valid keys: model, backend, nodes, workers, gateway, ray, restart)"),
    # --- duplicate keys (YAML would keep the last silently)
    (M + "workers:\n  numa: bind\n  threads: 4\n  numa: none\n",
     "5: workers.numa: duplicate key (first set at line 3; YAML would silently keep only the last)"),
    (M + "model: n.gguf\n",
     "2: model: duplicate key (first set at line 1; YAML would silently keep only the last)"),
    # --- malformed YAML, with its line
    (M + "workers:\n  threads: [1, 2\n",
     "4: malformed YAML: did not find expected ',' or ']' while parsing a flow sequence (column 1)"),
    (M + "workers:\n\tthreads: 2\n",
     "3: malformed YAML: a tab character (column 1); YAML indents with spaces"),
    ("- model: m.gguf\n",
     "1: the topology is a list (expected a mapping of sections: model:, nodes:, workers:, …)"),
    (M + "1: x\n",
     "2: a key must be a name, got 1"),
    # --- wrong types
    (M + "workers:\n  threads: lots\n",
     "3: workers.threads: got 'lots' (expected auto or an integer 1..4096)"),
    (M + "workers:\n  threads: '8'\n",
     "3: workers.threads: got '8', a string (expected auto or an integer 1..4096; write the number without quotes)"),
    (M + "workers:\n  threads: 8.5\n",
     "3: workers.threads: got 8.5 (expected auto or an integer 1..4096)"),
    (M + "workers:\n  threads: true\n",
     "3: workers.threads: got true (expected auto or an integer 1..4096)"),
    (M + "workers:\n  threads:\n",
     "3: workers.threads: got null (expected auto or an integer 1..4096)"),
    (M + "workers: auto\n",
     "2: workers: got 'auto' (expected a mapping of keys)"),
    (M + "nodes: {name: a}\n",
     "2: nodes: got a mapping (expected a list)"),
    (M + "workers:\n  warmup: sometimes\n",
     "3: workers.warmup: got 'sometimes' (expected true or false)"),
    (M + "workers:\n  extra_args: --no-warmup --seed 1\n",
     "3: workers.extra_args: got the string '--no-warmup --seed 1' (expected a list of strings, one per argument, "
     "like [\"--no-warmup\", \"--seed\", \"1\"]; arguments are never split by a shell)"),
    (M + "workers:\n  extra_args: [--seed, 1]\n",
     "3: workers.extra_args: item 1 is 1, not a string (expected a list of strings, one per argument, like "
     "[\"--no-warmup\", \"--seed\", \"1\"]; quote numbers)"),
    (M + "nodes:\n  - name: 7\n",
     "3: nodes[0].name: got 7 (expected a name of letters, digits, '_', '.', '-' (at most 63); quote it)"),
    # --- choices, with did-you-mean on values
    (M + "workers:\n  numa: interleaved\n",
     "3: workers.numa: got 'interleaved' (expected one of auto, bind, interleave, none; did you mean 'interleave'?)"),
    (M + "backend:\n  flavor: ik_llama\n",
     "3: backend.flavor: got 'ik_llama' (expected one of auto, mainline, ik_llama.cpp; did you mean 'ik_llama.cpp'?)"),
    (M + "model:\n  path: m.gguf\n",
     "2: model: duplicate key (first set at line 1; YAML would silently keep only the last)"),
    ("model:\n  path: m.gguf\n  cache_type_k: q8\n",
     "3: model.cache_type_k: got 'q8' (expected one of auto, f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, "
     "q6_0, q8_KV; did you mean 'q8_0'?)"),
    (M + "ray:\n  address: lcoal\n",
     "3: ray.address: got 'lcoal' (expected local, auto, ray://HOST:PORT or HOST:PORT; did you mean 'local'?)"),
    (M + "ray:\n  address: http://head:6379\n",
     "3: ray.address: got 'http://head:6379' (expected local, auto, ray://HOST:PORT or HOST:PORT; the only scheme "
     "Ray clients use is ray://)"),
    (M + "nodes:\n  - gpus: al\n",
     "3: nodes[0].gpus: got 'al' (expected all, none, an index, a list of indices like [0, 1], or a range like "
     "\"0-3\"; did you mean 'all'?)"),
    (M + "nodes:\n  - machine: lvie\n",
     "3: nodes[0].machine: got 'lvie' (expected live or a recorded machine: a .tar.gz from `orchestrator inspect "
     "--save` or a .json from `orchestrator inspect --json`; did you mean 'live'?)"),
    ("model: m.txt\n",
     "1: model.path: got 'm.txt' (expected a .gguf file (relative to the topology file's folder), "
     "a model URL or a Hugging Face id)"),
    # --- negative, absurd and out-of-range numbers and sizes
    (M + "nodes:\n  - vram_reserve: -1GiB\n",
     "3: nodes[0].vram_reserve: -1GiB is negative (expected auto or a size like 24GiB or 512MiB, 0..1TiB)"),
    (M + "nodes:\n  - vram_limit: 24\n",
     "3: nodes[0].vram_limit: 24 bytes is out of range (expected auto, a size like 24GiB or 512MiB, 256MiB..4TiB "
     "for every GPU, or a list of such sizes, one per GPU; a number without a unit is bytes: did you mean '24GiB'?)"),
    (M + "nodes:\n  - vram_limit: 900TiB\n",
     "3: nodes[0].vram_limit: 900TiB is out of range (expected auto, a size like 24GiB or 512MiB, 256MiB..4TiB for "
     "every GPU, or a list of such sizes, one per GPU)"),
    (M + "nodes:\n  - ram_reserve: 24 parsecs\n",
     "3: nodes[0].ram_reserve: got '24 parsecs' (expected auto or a size like 24GiB or 512MiB, 0..64TiB)"),
    (M + "workers:\n  threads: 0\n",
     "3: workers.threads: 0 is out of range (expected auto or an integer 1..4096)"),
    ("model:\n  path: m.gguf\n  context: -8192\n",
     "3: model.context: -8192 is out of range (expected auto or an integer 256..16777216)"),
    (M + "gateway:\n  port: 70000\n",
     "3: gateway.port: 70000 is out of range (expected an integer 1..65535)"),
    (M + "restart:\n  startup_timeout: -5s\n",
     "3: restart.startup_timeout: -5s is negative (expected a duration like 30s, 500ms or 5m, 1s..24h)"),
    (M + "restart:\n  health_interval: 2 days\n",
     "3: restart.health_interval: got '2 days' (expected a duration like 30s, 500ms or 5m, 100ms..10m)"),
    (M + "nodes:\n  - gpus: [0, 0]\n",
     "3: nodes[0].gpus: GPU 0 is listed twice"),
    (M + "nodes:\n  - gpus: [0, 999]\n",
     "3: nodes[0].gpus: GPU index 999 is out of range (expected 0..255)"),
    # --- hosts, names
    (M + "gateway:\n  host: http://0.0.0.0\n",
     "3: gateway.host: got 'http://0.0.0.0' (expected an IP address or host name; give the host only, without a "
     "scheme)"),
    (M + "nodes:\n  - address: 10.0.0.1:6379\n",
     "3: nodes[0].address: got '10.0.0.1:6379' (expected the Ray node's IP address or host name or null; give the "
     "host only, without a port)"),
    (M + "gateway:\n  api_key_env: my key\n",
     "3: gateway.api_key_env: got 'my key' (expected the name of an environment variable (like "
     "ORCHESTRATOR_API_KEY) or null)"),
    (M + "gateway:\n  cors_origins: app.example.com\n",
     "3: gateway.cors_origins: got 'app.example.com' (expected *, localhost, or a comma-separated list of origins "
     "like https://app.example.com or null)"),
    # --- missing keys
    ("model:\n  context: 8192\n",
     "1: model.path: missing required key (expected a .gguf file (relative to the topology file's folder), "
     "a model URL or a Hugging Face id)"),
    ("workers:\n  threads: 4\n",
     "1: model: missing required key (every topology names its model: `model: FILE.gguf`)"),
    (M + "nodes: []\n",
     "2: nodes: got an empty list (expected at least one node; leave nodes out to use this machine)"),
    # --- cross-field: name the key to change and what to do instead
    ("model: {path: m.gguf, flash_attn: off, cache_type_v: q8_0}\n",
     "1: model.cache_type_v: a quantized V cache (q8_0) needs flash attention, but model.flash_attn is off: set "
     "flash_attn to on or auto, or cache_type_v to f16"),
    (M + "workers:\n  batch: 512\n  ubatch: 1024\n",
     "4: workers.ubatch: ubatch 1024 is larger than batch 512: set ubatch ≤ batch"),
    (M + "workers:\n  layout: socket\n  gpu_group_size: 2\n",
     "4: workers.gpu_group_size: only applies to layout gpu-group, but layout is socket: remove gpu_group_size or "
     "set layout: gpu-group"),
    (M + "nodes:\n  - gpus: [0, 1]\n    vram_limit: [8GiB]\n",
     "4: nodes[0].vram_limit: gives 1 size but gpus lists 2 GPUs (give one size per GPU, or one size for all)"),
    (M + "nodes:\n  - gpus: none\n    vram_limit: 8GiB\n",
     "4: nodes[0].vram_limit: vram_limit is set but gpus is none: remove vram_limit, or choose GPUs with gpus"),
    (M + "nodes:\n  - name: a\n    address: 10.0.0.1\n  - name: a\n    address: 10.0.0.2\nray: {address: auto}\n",
     "5: nodes[1].name: 'a' is already the name of nodes[0]: node names must be unique"),
    (M + "nodes:\n  - name: a\n  - name: b\nray: {address: auto}\n",
     "4: nodes[1].address: nodes[0] and nodes[1] both leave address out, so both mean this machine: give each node "
     "its Ray node's address"),
    (M + "nodes:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.1}\nray: {address: auto}\n",
     "4: nodes[1].address: nodes[0] has the same address: give each node its own address, or set ray_resource when "
     "two Ray nodes share an address"),
    (M + "nodes:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n",
     "1: ray.address: 2 nodes need a Ray cluster, but ray.address is local (a private Ray on this machine): set "
     "ray.address to the cluster's HOST:PORT, or auto"),
    (M + "workers:\n  split_mode: graph\nbackend:\n  flavor: mainline\n",
     "3: workers.split_mode: split_mode graph exists only in ik_llama.cpp, but backend.flavor is mainline: use "
     "tensor or layer, or an ik_llama.cpp binary"),
    (M + "workers:\n  split_mode: tensor\nbackend:\n  flavor: ik_llama.cpp\n",
     "3: workers.split_mode: split_mode tensor is mainline llama.cpp only, but backend.flavor is ik_llama.cpp: use "
     "graph or layer"),
    ("model:\n  path: m.gguf\n  flash_attn: off\nworkers:\n  split_mode: tensor\n",
     "3: model.flash_attn: split_mode tensor needs flash attention, but model.flash_attn is off: set it to on or "
     "auto, or use another split_mode"),
    ("model:\n  path: m.gguf\n  cache_type_k: q8_KV\nbackend:\n  flavor: mainline\n",
     "3: model.cache_type_k: q8_KV is an ik_llama.cpp cache type, but backend.flavor is mainline: use one of f32, "
     "f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"),
    (M + "nodes:\n  - gpus: none\nworkers:\n  layout: gpu-group\n",
     "5: workers.layout: gpu-group needs GPUs, but every node has gpus: none: use layout machine or socket, or give "
     "a node GPUs"),
    (M + "workers:\n  extra_args: [-ngl, '99']\n",
     "3: workers.extra_args[0]: -ngl is controlled by the topology: placement is decided by the plan; steer it with "
     "nodes[].gpus / nodes[].vram_limit instead"),
    (M + "workers:\n  extra_args: [--no-warmup, --port=9000]\n",
     "3: workers.extra_args[1]: --port is controlled by the topology: set workers.port_base instead"),
    (M + "gateway:\n  port: 8081\n",
     "3: gateway.port: port 8081 is also workers.port_base: give the gateway another port"),
    (M + "gateway:\n  port: 8265\n",
     "3: gateway.port: port 8265 is also ray.dashboard_port: give the gateway another port"),
    (M + "ray:\n  address: head:6379\n  dashboard_port: 9000\n",
     "4: ray.dashboard_port: only applies to a local Ray head (ray.address: local), but address is 'head:6379': the "
     "cluster's dashboard is set where it was started; remove dashboard_port"),
    (M + "restart:\n  backoff_initial: 1m\n  backoff_max: 10s\n",
     "3: restart.backoff_initial: backoff_initial (60s) is longer than backoff_max (10s): lower it or raise "
     "backoff_max"),
]


@pytest.mark.parametrize("text,expected", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_topology_gives_exact_line(tmp_path, text, expected):
    f = tmp_path / "topo.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_topology(f)
    msg = str(info.value)
    assert msg == f"{f}:{expected}"
    assert "\n" not in msg
    assert isinstance(info.value, OrchestratorError) and info.value.exit_code == 2


def test_several_errors_report_the_first_by_line_and_count_the_rest(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("model: m.gguf\nworkers:\n  threads: 0\n  numa: interleaved\ngateway:\n  port: 0\n")
    with pytest.raises(ConfigError) as info:
        load_topology(f)
    assert str(info.value) == (f"{f}:3: workers.threads: 0 is out of range (expected auto or an integer 1..4096) "
                               "(+2 more errors)")


def test_misspelled_required_key_is_not_also_reported_missing(tmp_path):
    # `modle:` suggests 'model'; the "model: missing" error that follows from it would only be noise
    f = tmp_path / "t.yaml"
    f.write_text("modle: m.gguf\n")
    with pytest.raises(ConfigError) as info:
        load_topology(f)
    assert "more error" not in str(info.value)


@pytest.mark.parametrize("setup,expected", [
    ("missing", "{f}: no such file (expected a topology .yaml file; see topologies/example.yaml)"),
    ("dir", "{f}: is a directory (expected a topology .yaml file)"),
    ("empty", "{f}: empty topology (expected a mapping with at least 'model: FILE.gguf'; see topologies/example.yaml)"),
    ("comments", "{f}: empty topology (expected a mapping with at least 'model: FILE.gguf'; see "
                 "topologies/example.yaml)"),
    ("binary", "{f}:2: not UTF-8 text (byte 14)"),
    ("huge", "{f}: larger than 1024 KiB: not a topology file"),
])
def test_file_level_errors(tmp_path, setup, expected):
    f = tmp_path / "t.yaml"
    if setup == "dir":
        f.mkdir()
    elif setup == "empty":
        f.write_text("")
    elif setup == "comments":
        f.write_text("# just a comment\n\n")
    elif setup == "binary":
        f.write_bytes(b"model: m.gguf\n\xff\xfe\n")
    elif setup == "huge":
        f.write_text("model: m.gguf\n" + "#" * (1 << 20))
    with pytest.raises(ConfigError) as info:
        load_topology(f)
    assert str(info.value) == expected.format(f=f)


def test_path_through_a_file(tmp_path):
    f = tmp_path / "plain"
    f.write_text("")
    with pytest.raises(ConfigError) as info:
        load_topology(f / "t.yaml")
    assert str(info.value) == f"{f / 't.yaml'}: cannot read: Not a directory"


def test_unreadable_file(tmp_path, monkeypatch):
    # root reads any file, so the permission error is injected at the one seam that reads the file
    import builtins

    f = tmp_path / "t.yaml"
    f.write_text("model: m.gguf\n")
    real_open = builtins.open

    def deny(path, *args, **kwargs):
        if str(path) == str(f):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(ConfigError) as info:
        load_topology(f)
    assert str(info.value) == f"{f}: permission denied"
