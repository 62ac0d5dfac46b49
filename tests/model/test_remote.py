"""Remote models: header-only reads over HTTP range requests, downloads, and every error, against real HTTP
servers on 127.0.0.1 (tests/model/remote_servers.py) and a stand-in of the Hugging Face Hub that
huggingface_hub itself talks to (HF_ENDPOINT)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import ModelError
from lab.calibmodels import PRESETS, build
from orchestrator.model.writer import write_gguf
from orchestrator.model.reader import read_model
from orchestrator.model.remote import (is_downloaded, parse_ref, pick_quant, pull, quant_of, read_remote_model)

from .remote_servers import Blob, FileServer, HubServer

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_testsecretTOKEN123"


def same_model(remote_info, local_info) -> bool:
    return dataclasses.replace(remote_info, paths=local_info.paths) == local_info


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B at full size (16.8 GiB, sparse: only the 3.6 MB header takes disk)."""
    md, ts = build(PRESETS["qwen3-30b-a3b"])
    path = tmp_path_factory.mktemp("big") / "Qwen3-30B-A3B-Q4_0.gguf"
    write_gguf(path, md, ts)
    return path


@pytest.fixture()
def cache(isolated_cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))    # no token saved by `hf auth login`
    return isolated_cache


@pytest.fixture()
def server():
    with FileServer() as s:
        yield s


@pytest.fixture()
def hub(monkeypatch):
    """The Hub stand-in and its CDN; HF_ENDPOINT points huggingface_hub at it."""
    with FileServer() as cdn, HubServer(cdn, token=TOKEN) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.base)
        yield h


def split_model(write_model, tiny_specs, name="split.gguf"):
    return write_model(tiny_specs["qwen3moe"], name, split_max_tensors=10)     # 4 shards


# ---- references -------------------------------------------------------------------------------------------

def test_references_are_told_apart():
    assert parse_ref("models/m.gguf") is None and parse_ref("/abs/m.gguf") is None
    assert parse_ref("https://h.example/a/m.gguf").kind == "url"
    r = parse_ref("hf://unsloth/DeepSeek-V3-GGUF/Q4_K_M/DeepSeek-V3-Q4_K_M-00001-of-00009.gguf")
    assert (r.kind, r.repo, r.file) == ("hf-file", "unsloth/DeepSeek-V3-GGUF",
                                        "Q4_K_M/DeepSeek-V3-Q4_K_M-00001-of-00009.gguf")
    r = parse_ref("unsloth/DeepSeek-V3-GGUF:Q4_K_M")
    assert (r.kind, r.repo, r.quant) == ("hf-quant", "unsloth/DeepSeek-V3-GGUF", "Q4_K_M")
    with pytest.raises(ModelError, match="must name a .gguf file"):
        parse_ref("https://h.example/a/m.bin")


def test_config_keeps_remote_references_verbatim_and_agrees_with_the_reader():
    from orchestrator.config import parse_topology
    from orchestrator.config.types import is_remote_model

    for text in ("unsloth/DeepSeek-V3-GGUF:Q4_K_M", "hf://org/repo/m.gguf", "https://h.example/x/m.gguf",
                 "models/m.gguf", "m.gguf", "../models/x-00001-of-00002.gguf"):
        assert is_remote_model(text) == (parse_ref(text) is not None), text
    t = parse_topology("model: unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M\n", source="t.yaml", base_dir="/somewhere")
    assert t.model.path == "unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M"
    t.check_files()     # a remote model is not a missing file


def test_quantization_names():
    assert quant_of("Q4_K_M/DeepSeek-V3-Q4_K_M-00001-of-00009.gguf") == "Q4_K_M"
    assert quant_of("Qwen3-30B-A3B-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert quant_of("gpt-oss-120b-MXFP4_MOE.gguf") == "MXFP4_MOE"
    assert quant_of("qwen3-30b-a3b-q8_0.gguf") == "q8_0"
    assert quant_of("model-BF16-00002-of-00003.gguf") == "BF16"
    files = ["README.md", "m-Q8_0.gguf", "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
             "mmproj-F16.gguf"]
    assert pick_quant("o/r", "q4_k_m", files) == "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf"
    assert pick_quant("o/r", "Q8_0", files) == "m-Q8_0.gguf"
    with pytest.raises(ModelError) as e:
        pick_quant("o/r", "Q2_K", files)
    assert str(e.value) == "o/r:Q2_K: the repository has no Q2_K GGUF; it has: Q4_K_M, Q8_0"
    with pytest.raises(ModelError, match="lacks Q4_K_M/m-Q4_K_M-00002-of-00002.gguf"):
        pick_quant("o/r", "Q4_K_M", files[:3][:2] + [files[3]])


# ---- header-only reads -------------------------------------------------------------------------------------

def test_header_only_read_fetches_under_one_percent(cache, server, big_model):
    blob = server.files["/m/big.gguf"] = Blob(big_model)
    remote = read_remote_model(server.url("/m/big.gguf"))
    assert blob.size > 16 * 2**30
    assert 0 < server.stats.sent < blob.size / 100, server.stats.sent
    assert remote.fetched == server.stats.sent
    assert all(r[2] and r[2].startswith("bytes=") for r in server.stats.gets())
    assert same_model(remote.info, read_model(big_model))
    assert remote.info.paths == (server.url("/m/big.gguf"),)
    # read again: the header comes from the cache (keyed by URL and ETag), only a HEAD goes out
    before = len(server.stats.requests)
    again = read_remote_model(server.url("/m/big.gguf"))
    assert again.fetched == 0 and [r[0] for r in server.stats.requests[before:]] == ["HEAD"]
    assert again.info == remote.info
    # the file changed (new ETag): read again
    server.files["/m/big.gguf"] = Blob(big_model, etag='"v2"')
    assert read_remote_model(server.url("/m/big.gguf")).fetched > 0


def test_sharded_model_by_url_reads_every_shard(cache, server, write_model, tiny_specs):
    paths = split_model(write_model, tiny_specs)
    for p in paths:
        server.files[f"/models/{p.name}"] = Blob(p)
    remote = read_remote_model(server.url(f"/models/{paths[0].name}"))
    assert len(remote.files) == 4
    assert remote.info.paths == tuple(server.url(f"/models/{p.name}") for p in paths)
    assert same_model(remote.info, read_model(paths[0]))
    # the shards are downloaded side by side, as llama-server looks for them
    assert len({Path(f.cache_path).parent for f in remote.files}) == 1
    assert [Path(f.cache_path).name for f in remote.files] == [p.name for p in paths]


def test_plan_from_url_equals_plan_from_the_local_files(cache, server, write_model, tiny_specs, tmp_path):
    from orchestrator.commands.plan import plan_document
    from orchestrator.resolve import nominal_backend, resolve

    paths = split_model(write_model, tiny_specs)
    for p in paths:
        server.files[f"/models/{p.name}"] = Blob(p)
    url = server.url(f"/models/{paths[0].name}")
    machine = REPO / "tests" / "fixtures" / "machines" / "described" / "1socket-1gpu-24g.json"
    topo = tmp_path / "t.yaml"
    topo.write_text(f"model: {{path: {url}, context: 4096}}\nnodes:\n  - {{name: ws, machine: {machine}}}\n")
    backend = nominal_backend("mainline", cuda=True)
    by_url = resolve(topo, backend=backend)
    local = resolve(topo, overrides={"model.path": str(paths[0])}, backend=backend)
    cached = by_url.model.paths[0]
    assert cached.startswith(str(cache)) and Path(cached).name == paths[0].name
    assert ["-m", cached] == [a for a in by_url.specs[0].argv if a in ("-m", cached)][:2]
    doc_url = json.dumps(plan_document(by_url)["workers"]).replace(cached, str(paths[0]))
    assert doc_url == json.dumps(plan_document(local)["workers"])
    assert by_url.plan.to_dict()["model"] | {"path": None} == local.plan.to_dict()["model"] | {"path": None}
    assert any("read over the network" in n for n in by_url.notes)


# ---- header errors ----------------------------------------------------------------------------------------

def test_server_that_ignores_ranges_is_refused_without_downloading(cache, big_model):
    with FileServer({"/big.gguf": Blob(big_model)}, ranges=False) as s:
        with pytest.raises(ModelError) as e:
            read_remote_model(s.url("/big.gguf"))
        assert str(e.value).startswith(f"{s.url('/big.gguf')}: the server ignores HTTP range requests")
        assert s.stats.sent < Blob(big_model).size / 100
    assert not (cache / "gguf-headers").exists()


@pytest.mark.parametrize("status,expect", [
    (404, "not found (HTTP 404)"),
    (401, "access denied (HTTP 401): for a gated or private Hub repository set HF_TOKEN"),
    (403, "access denied (HTTP 403)"),
    (500, "the server answered HTTP 500"),
])
def test_http_errors_are_one_line_naming_the_url(cache, server, status, expect):
    url = server.url("/x/m.gguf")
    if status != 404:
        server.status["/x/m.gguf"] = status
    with pytest.raises(ModelError) as e:
        read_remote_model(url)
    assert str(e.value) == f"{url}: {expect}" or str(e.value).startswith(f"{url}: {expect}")
    assert "\n" not in str(e.value)
    assert not cache.exists() or not any(cache.rglob("*.gguf*"))


def test_missing_shard_is_named(cache, server, write_model, tiny_specs):
    paths = split_model(write_model, tiny_specs)
    for p in paths[:2] + paths[3:]:
        server.files[f"/m/{p.name}"] = Blob(p)
    with pytest.raises(ModelError) as e:
        read_remote_model(server.url(f"/m/{paths[0].name}"))
    assert str(e.value) == (f"{server.url('/m/' + paths[2].name)}: missing shard 3 of 4 "
                            f"(of {server.url('/m/' + paths[0].name)})")


def test_truncated_and_corrupt_headers(cache, server, tiny_models):
    from orchestrator.model.reader import read_gguf

    data = tiny_models["qwen3moe"].read_bytes()
    cut = read_gguf(tiny_models["qwen3moe"]).data_offset - 40      # inside the tensor index
    server.files["/trunc.gguf"] = Blob(head=data[:cut], size=cut)
    server.files["/junk.gguf"] = Blob(head=b"NOPE" + data[4:], size=len(data))
    with pytest.raises(ModelError) as e:
        read_remote_model(server.url("/trunc.gguf"))
    assert str(e.value).startswith(f"{server.url('/trunc.gguf')}: truncated GGUF: the file ends at byte ")
    assert "inside the tensor index" in str(e.value)
    with pytest.raises(ModelError) as e:
        read_remote_model(server.url("/junk.gguf"))
    assert str(e.value) == f"{server.url('/junk.gguf')}: not a GGUF file (starts with b'NOPE', expected b'GGUF')"
    assert not (cache / "gguf-headers").exists()


def test_connection_dropped_mid_header_is_retried_once(cache, server, big_model):
    server.files["/big.gguf"] = Blob(big_model)
    server.drop_after, server.drops = 5000, 1
    remote = read_remote_model(server.url("/big.gguf"))
    assert same_model(remote.info, read_model(big_model))
    server.files["/big2.gguf"] = Blob(big_model, etag='"other"')
    server.drops = 2
    with pytest.raises(ModelError) as e:
        read_remote_model(server.url("/big2.gguf"))
    assert str(e.value).startswith(f"{server.url('/big2.gguf')}: connection dropped while reading the GGUF "
                                   "header at byte 0 (tried twice)")


# ---- downloads ------------------------------------------------------------------------------------------

def test_pull_downloads_every_shard_into_the_cache(cache, server, write_model, tiny_specs):
    paths = split_model(write_model, tiny_specs)
    for p in paths:
        server.files[f"/m/{p.name}"] = Blob(p)
    remote = read_remote_model(server.url(f"/m/{paths[0].name}"))
    local = pull(remote, progress=False)
    assert [Path(p).read_bytes() for p in local] == [p.read_bytes() for p in paths]
    assert not list(cache.rglob("*.part"))
    assert same_model(read_model(local[0]), read_model(paths[0]))
    assert all(is_downloaded(f) for f in remote.files)
    sent = server.stats.sent
    pull(remote, progress=False)            # already there: nothing fetched
    assert server.stats.sent == sent


def test_interrupted_download_resumes(cache, server, tiny_models):
    src = tiny_models["deepseek2"]
    size = src.stat().st_size
    server.files["/m.gguf"] = Blob(src)
    remote = read_remote_model(server.url("/m.gguf"))
    (f,) = remote.files
    server.drop_after, server.drops = size // 3, 2      # the download and its one retry both break off
    with pytest.raises(ModelError) as e:
        pull(remote, progress=False)
    assert "connection dropped at byte" in str(e.value) and "run `orchestrator pull` again to resume" in str(e.value)
    part = Path(f.cache_path + ".part")
    assert part.exists() and 0 < part.stat().st_size < size and not Path(f.cache_path).exists()
    have = part.stat().st_size
    server.stats.requests.clear()
    pull(remote, progress=False)
    assert server.stats.gets()[0][2] == f"bytes={have}-"
    assert Path(f.cache_path).read_bytes() == src.read_bytes() and not part.exists()


def test_a_drop_mid_download_is_retried_from_where_it_stopped(cache, server, tiny_models):
    src = tiny_models["gpt-oss"]
    server.files["/m.gguf"] = Blob(src)
    remote = read_remote_model(server.url("/m.gguf"))
    server.drop_after, server.drops = 3000, 1
    server.stats.requests.clear()
    pull(remote, progress=False)
    assert [r[2] for r in server.stats.gets()] == [None, "bytes=3000-"]
    assert Path(remote.files[0].cache_path).read_bytes() == src.read_bytes()


def test_a_part_of_a_changed_file_starts_over(cache, server, tiny_models):
    src = tiny_models["llama"]
    server.files["/m.gguf"] = Blob(src, etag='"v1"')
    remote = read_remote_model(server.url("/m.gguf"))
    part = Path(remote.files[0].cache_path + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"X" * 1000)           # left by an earlier pull of another version
    server.files["/m.gguf"] = Blob(src, etag='"v2"')
    remote = read_remote_model(server.url("/m.gguf"))
    pull(remote, progress=False)
    assert Path(remote.files[0].cache_path).read_bytes() == src.read_bytes()


def test_no_disk_space_is_refused_before_anything_is_written(cache, server, big_model):
    huge = 1 << 50          # 1 PiB: more than any test machine's disk
    server.files["/big.gguf"] = Blob(big_model)
    remote = read_remote_model(server.url("/big.gguf"))
    remote = dataclasses.replace(remote, files=tuple(dataclasses.replace(f, size=huge) for f in remote.files))
    sent = server.stats.sent
    with pytest.raises(ModelError) as e:
        pull(remote, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{server.url('/big.gguf')}: not enough disk space in ") and "1048576.00 GiB" in msg
    assert "GiB free" in msg and server.stats.sent == sent
    assert not list(cache.rglob("*.part")) and not list((cache / "models").rglob("*.gguf"))


# ---- the Hub --------------------------------------------------------------------------------------------

def hub_repo(hub, write_model, tiny_specs, tiny_models, repo="someorg/Tiny-GGUF"):
    paths = split_model(write_model, tiny_specs, "Tiny-Q4_K_M.gguf")
    files = {f"Q4_K_M/{p.name}": Blob(p) for p in paths}
    files["Tiny-Q8_0.gguf"] = Blob(tiny_models["deepseek2"])
    files["README.md"] = Blob(head=b"# tiny\n")
    hub.add_repo(repo, files)
    return repo, paths


def test_hub_quantization_reads_the_split_files_and_pulls_them_checked(cache, hub, write_model, tiny_specs,
                                                                     tiny_models):
    repo, paths = hub_repo(hub, write_model, tiny_specs, tiny_models)
    remote = read_remote_model(f"{repo}:Q4_K_M")
    assert len(remote.files) == 4 and same_model(remote.info, read_model(paths[0]))
    assert all(f.sha256 == hub.sha(repo, "Q4_K_M/" + Path(f.url).name) for f in remote.files)
    assert remote.files[0].cache_path == str(cache / "models" / "huggingface" / repo / "Q4_K_M" / paths[0].name)
    local = pull(remote, progress=False)
    assert [Path(p).read_bytes() for p in local] == [p.read_bytes() for p in paths]
    q8 = read_remote_model(f"hf://{repo}/Tiny-Q8_0.gguf")
    assert same_model(q8.info, read_model(tiny_models["deepseek2"]))


def test_hub_errors(cache, hub, write_model, tiny_specs, tiny_models):
    repo, _ = hub_repo(hub, write_model, tiny_specs, tiny_models)
    with pytest.raises(ModelError) as e:
        read_remote_model(f"{repo}:IQ1_S")
    assert str(e.value) == f"{repo}:IQ1_S: the repository has no IQ1_S GGUF; it has: Q4_K_M, Q8_0"
    with pytest.raises(ModelError) as e:
        read_remote_model("nobody/Nothing-GGUF:Q4_K_M")
    assert str(e.value).startswith("nobody/Nothing-GGUF: repository not found or not accessible (if it is private "
                                   "or gated, set HF_TOKEN")
    with pytest.raises(ModelError) as e:
        read_remote_model(f"hf://{repo}/Tiny-Q2_K.gguf")
    assert str(e.value) == f"{hub.base}/{repo}/resolve/main/Tiny-Q2_K.gguf: not found (HTTP 404)"


def test_sha256_mismatch_leaves_nothing(cache, hub, write_model, tiny_specs, tiny_models):
    repo, _ = hub_repo(hub, write_model, tiny_specs, tiny_models)
    hub.bad_sha.add("Tiny-Q8_0.gguf")
    remote = read_remote_model(f"{repo}:Q8_0")
    with pytest.raises(ModelError, match="SHA-256 mismatch"):
        pull(remote, progress=False)
    assert not list(cache.rglob("*.part")) and not list((cache / "models").rglob("*.gguf"))


def test_gated_repository_needs_hf_token_which_is_never_printed(cache, hub, write_model, tiny_specs, tiny_models,
                                                                monkeypatch, tmp_path):
    repo, _ = hub_repo(hub, write_model, tiny_specs, tiny_models, repo="gatedorg/Gated-GGUF")
    hub.gated.add(repo)
    with pytest.raises(ModelError) as e:
        read_remote_model(f"{repo}:Q8_0")
    assert str(e.value).startswith(f"{repo}: gated repository: accept its terms on the Hub, then set HF_TOKEN")
    env = {**os.environ, "HF_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "orchestrator", "pull", f"{repo}:Q8_0"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip()
    assert path == str(cache / "models" / "huggingface" / repo / "Tiny-Q8_0.gguf")
    assert Path(path).read_bytes() == tiny_models["deepseek2"].read_bytes()
    assert TOKEN not in r.stdout + r.stderr
    # the token went to the Hub, never to the CDN it redirects to
    assert any(a == f"Bearer {TOKEN}" for *_, a in hub.stats.requests)
    assert not any(a for *_, a in hub.cdn.stats.requests)
    env["HF_TOKEN"] = "hf_wrong"
    r = subprocess.run([sys.executable, "-m", "orchestrator", "model", f"{repo}:Q8_0"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "hf_wrong" not in r.stderr
    assert "gated repository" in r.stderr


def test_download_checks_the_file_reads_as_a_model_and_keeps_nothing_that_does_not(cache, server):
    from orchestrator.model.remote import download

    server.files["/junk.gguf"] = Blob(head=b"<html>not a model</html>" * 100)
    with pytest.raises(ModelError) as e:
        download(server.url("/junk.gguf"), progress=False)
    assert str(e.value) == (f"{server.url('/junk.gguf')}: downloaded, but it is not a usable GGUF model (removed): "
                            "not a GGUF file (starts with b'<htm', expected b'GGUF')")
    assert not [p for p in (cache / "models").rglob("*") if p.is_file()]


def test_a_resumed_hub_download_is_checked_whole(cache, hub, write_model, tiny_specs, tiny_models):
    repo, _ = hub_repo(hub, write_model, tiny_specs, tiny_models)
    remote = read_remote_model(f"{repo}:Q8_0")
    (f,) = remote.files
    size = f.size
    hub.cdn.drop_after, hub.cdn.drops = size // 4, 2     # two drops leave half of it
    with pytest.raises(ModelError, match="again to resume"):
        pull(remote, progress=False)
    part = Path(f.cache_path + ".part")
    have = part.stat().st_size
    sent = hub.cdn.stats.sent
    pull(remote, progress=False)            # resumes; the hash covers the bytes of both pulls
    assert hub.cdn.stats.gets()[-1][2] == f"bytes={have}-" and hub.cdn.stats.sent - sent == size - have
    assert Path(f.cache_path).read_bytes() == tiny_models["deepseek2"].read_bytes()
    # the same again, with a byte of the first pull's part spoiled on disk: the check catches it
    Path(f.cache_path).unlink()
    hub.cdn.drops = 2
    with pytest.raises(ModelError, match="again to resume"):
        pull(remote, progress=False)
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="SHA-256 mismatch"):
        pull(remote, progress=False)
    assert not part.exists() and not Path(f.cache_path).exists()


def test_a_server_that_is_not_there(cache):
    import socket

    with socket.socket() as s:            # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/m.gguf"
    with pytest.raises(ModelError) as e:
        read_remote_model(url)
    msg = str(e.value)
    assert msg.startswith(f"{url}: cannot reach 127.0.0.1:") and "\n" not in msg
    assert "--set model.path=FILE" in msg and "orchestrator pull" in msg


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_hub_reference_says_what_to_do_instead(cache, monkeypatch):
    """Offline (the Hub unreachable, or HF_HUB_OFFLINE): one line with a local file, the synthetic model of the
    shape the reference names, or a pull while online."""
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    for ref, like in (("unsloth/DeepSeek-V3-GGUF:Q4_0", "deepseek-v3"), ("Qwen/Qwen3-30B-A3B-GGUF:Q8_0",
                                                                          "qwen3-30b-a3b"),
                      ("someorg/Unknown-GGUF:Q4_0", "NAME")):
        with pytest.raises(ModelError) as e:
            read_remote_model(ref)
        msg = str(e.value)
        assert "\n" not in msg and "(offline?)" in msg, msg
        assert msg.startswith(ref.split(":")[0] + ": cannot reach 127.0.0.1:"), msg
        assert f"`orchestrator synth-model FILE --like {like}`" in msg and "--set model.path=FILE" in msg, msg


def test_offline_url_with_a_downloaded_copy_names_it(cache, server, tiny_models):
    p = tiny_models["qwen3moe"]
    server.files[f"/m/{p.name}"] = Blob(p)
    url = server.url(f"/m/{p.name}")
    local = pull(read_remote_model(url), progress=False)
    server.__exit__(None, None, None)          # the server gone: offline
    with pytest.raises(ModelError) as e:
        read_remote_model(url)
    assert str(e.value) == (f"{url}: cannot reach {url.split('/')[2]} (offline?): a downloaded copy is at "
                            f"{local[0]}: give it with --set model.path={local[0]}")
