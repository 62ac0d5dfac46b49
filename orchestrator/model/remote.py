"""Models by URL or Hugging Face reference: read the header over HTTP range requests, download into the cache.

A model reference is one of:

- a local path (``models/m.gguf``): nothing here applies;
- a URL (``https://host/dir/m-00001-of-00003.gguf``, or ``http://``);
- a file on the Hugging Face Hub (``hf://org/repo/dir/m.gguf``);
- a quantization of a Hub repository (``org/repo:Q4_K_M``): the repository's GGUF file(s) of that quantization
  (split files ``-00001-of-0000N.gguf`` included; ``mmproj`` files are not models).

Reading a remote model fetches only the header and tensor index of each shard (:func:`orchestrator.model.reader.
read_gguf_source` asks for a growing prefix); a server that ignores ``Range`` (answers 200 with the whole body) is
refused before its body is read. The prefix is kept under ``cache_dir()/gguf-headers`` by URL and ETag, so
planning again costs one HEAD request per shard.

Downloading (``orchestrator pull``, and ``up`` before it starts workers) writes ``FILE.part`` and renames it when
complete and checked: a dropped connection is retried once from where it stopped, and a later pull resumes the
part (``Range`` + ``If-Range``, so a file changed on the server starts over). The Hub's LFS SHA-256 (its
``X-Linked-ETag``) is checked when the Hub publishes one. The Hub is reached through ``huggingface_hub``
(``HF_ENDPOINT`` and ``HF_TOKEN`` honoured); every request goes through its httpx client.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from orchestrator.errors import ModelError
from orchestrator.model.info import ModelInfo
from orchestrator.model.reader import GgufFile, MissingFile, read_gguf, read_gguf_source, read_model, shard_paths
from orchestrator.paths import cache_dir

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 30.0
CHUNK = 1 << 20
# what `orchestrator pull` keeps free on the cache's file system beyond the files themselves
DISK_MARGIN = 1 << 30

_HF_FILE_RE = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)/(?P<file>[^?#]+\.gguf)$")
_HF_QUANT_RE = re.compile(r"^(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<quant>[\w.-]+)$")
_SHARD_SUFFIX_RE = re.compile(r"-(\d{5})-of-(\d{5})$")
# the quantization at the end of a file name's stem: Q4_K_M, UD-Q4_K_XL, IQ2_XXS, Q8_0, BF16, F16, MXFP4_MOE, ...
_QUANT_RE = re.compile(r"(?:^|[-_.])(?P<q>(?:UD-)?(?:I?Q\d+(?:_[A-Za-z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|B?F16|F32))$",
                       re.IGNORECASE)


# ---- references -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteRef:
    """A parsed remote model reference. ``kind``: "url", "hf-file" or "hf-quant"."""

    text: str
    kind: str
    url: str = ""
    repo: str = ""
    file: str = ""
    quant: str = ""


def parse_ref(text: str) -> RemoteRef | None:
    """The remote reference ``text`` names, or None for a local path."""
    if text.startswith(("https://", "http://")):
        parts = urlsplit(text)
        if not parts.netloc or not parts.path.lower().endswith(".gguf"):
            raise ModelError(f"{text}: a model URL must name a .gguf file")
        return RemoteRef(text, "url", url=text)
    m = _HF_FILE_RE.match(text)
    if m:
        return RemoteRef(text, "hf-file", repo=m.group("repo"), file=m.group("file"))
    m = _HF_QUANT_RE.match(text)
    if m:
        return RemoteRef(text, "hf-quant", repo=m.group("repo"), quant=m.group("quant"))
    if text.startswith("hf://"):
        raise ModelError(f"{text}: expected hf://ORG/REPO/FILE.gguf or ORG/REPO:QUANT")
    return None


def is_remote(text: str) -> bool:
    return parse_ref(text) is not None


def hf_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _hf_token() -> str | None:
    # None lets huggingface_hub fall back to a token saved by `hf auth login`
    return os.environ.get("HF_TOKEN") or None


def _hf_url(repo: str, file: str) -> str:
    return f"{hf_endpoint()}/{repo}/resolve/main/{quote(file)}"


def _on_hub(url: str) -> bool:
    return urlsplit(url).netloc == urlsplit(hf_endpoint()).netloc


# ---- the Hub ----------------------------------------------------------------------------------------------

def _hub_error(what: str, err: Exception) -> ModelError:
    """One line for a huggingface_hub error about ``what`` (a repository or file reference); never the token."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, GatedRepoError) or status == 403:
        return ModelError(f"{what}: gated repository: accept its terms on the Hub, then set HF_TOKEN to a token "
                          f"of an account that has access (HTTP {status})")
    if isinstance(err, RepositoryNotFoundError) or status == 401:
        hint = ("HF_TOKEN is set but cannot read it" if _hf_token()
                else "if it is private or gated, set HF_TOKEN to a token that can read it")
        return ModelError(f"{what}: repository not found or not accessible ({hint}; HTTP {status})")
    if status == 404:
        return MissingFile(f"{what}: not found (HTTP 404)")
    if isinstance(err, HfHubHTTPError) and status is not None:
        return ModelError(f"{what}: the Hub answered HTTP {status}")
    if isinstance(err, (*_transport_errors(), OfflineModeIsEnabled)):
        return ModelError(unreachable(what, hf_endpoint()))
    return ModelError(f"{what}: unexpected answer from {hf_endpoint()}: {type(err).__name__}: {_reason(err)}")


def _like(what: str) -> str:
    """The synthetic model shape whose name the reference mentions (``DeepSeek-V3`` → ``deepseek-v3``)."""
    from orchestrator.model import shapes

    text = re.sub(r"[\s_.]+", "-", what.lower())
    known = sorted({*shapes.names(), *shapes.ALIASES}, key=len, reverse=True)      # the most specific first
    return next((n for n in known if n in text), "NAME")


def unreachable(what: str, where: str) -> str:
    """One line for a remote model whose server cannot be reached (offline): what to do instead, and the
    downloaded copy when the cache has one."""
    host = urlsplit(where).netloc or where
    line = f"{what}: cannot reach {host} (offline?): "
    if "://" in what and os.path.isfile((cached := cache_path_for(what)) + ".source.json"):   # a whole one
        return line + f"a downloaded copy is at {cached}: give it with --set model.path={cached}"
    return (line + "give a local file with --set model.path=FILE, generate one with `orchestrator synth-model "
            f"FILE --like {_like(what)}`, or `orchestrator pull` it first while online")


def _reason(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF file name ends with (``DeepSeek-V3-Q4_K_M-00001-of-00009.gguf`` → ``Q4_K_M``)."""
    stem = Path(filename).name
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    stem = _SHARD_SUFFIX_RE.sub("", stem)
    m = _QUANT_RE.search(stem)
    return m.group("q") if m else None


def pick_quant(repo: str, quant: str, files: list[str]) -> str:
    """The file (the first shard of a split model) of ``quant`` among a repository's ``files``."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in Path(f).name.lower()]
    want = quant.lower()
    hits = [f for f in ggufs if (quant_of(f) or "").lower() == want
            or any(part.lower() == want for part in Path(f).parent.parts)]
    firsts = sorted(f for f in hits if (m := _SHARD_SUFFIX_RE.search(f[:-5])) is None or int(m.group(1)) == 1)
    if not firsts:
        have = sorted({q for f in ggufs if (q := quant_of(f))}, key=str.lower)
        listed = ", ".join(have) if have else "none (no .gguf files)"
        raise ModelError(f"{repo}:{quant}: the repository has no {quant} GGUF; it has: {listed}")
    first = firsts[0]
    m = _SHARD_SUFFIX_RE.search(first[:-5])
    if m:
        n = int(m.group(2))
        stem = first[:m.start()]
        missing = [p for i in range(1, n + 1) if (p := f"{stem}-{i:05d}-of-{n:05d}.gguf") not in files]
        if missing:
            raise ModelError(f"{repo}:{quant}: {first} is one of {n} parts but the repository lacks "
                             f"{', '.join(missing)}")
    return first


def _list_repo(repo: str) -> list[str]:
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=hf_endpoint(), token=_hf_token()).model_info(repo)
    except Exception as err:  # noqa: BLE001 -- every failure becomes one line naming the repository
        raise _hub_error(repo, err) from None
    return [s.rfilename for s in (info.siblings or [])]


# ---- files ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteFile:
    """One file of a remote model: where it is read from, and where it is downloaded to."""

    url: str              # the address the user's reference names (a Hub /resolve/ URL for the Hub)
    location: str         # where the bytes are fetched (the Hub's CDN after its redirect)
    size: int
    etag: str | None
    sha256: str | None    # the Hub's LFS hash, when it publishes one
    cache_path: str


def _client():
    import httpx2

    return httpx2.Client(timeout=httpx2.Timeout(TIMEOUT_S), follow_redirects=True,
                         headers={"Accept-Encoding": "identity"})


def _transport_errors() -> tuple[type[BaseException], ...]:
    import httpx2

    return (httpx2.TransportError,)


def _status_error(url: str, status: int) -> ModelError:
    if status == 404:
        return MissingFile(f"{url}: not found (HTTP 404)")
    if status in (401, 403):
        hint = ("HF_TOKEN is set but has no access: accept the repository's terms on the Hub with that account"
                if _hf_token() else "for a gated or private Hub repository set HF_TOKEN")
        return ModelError(f"{url}: access denied (HTTP {status}): {hint}")
    if status == 416:
        return ModelError(f"{url}: the server refused the byte range (HTTP 416)")
    return ModelError(f"{url}: the server answered HTTP {status}")


def cache_path_for(url: str) -> str:
    """Where the file at ``url`` is downloaded: ``cache_dir()/models/huggingface/ORG/REPO/FILE`` for the Hub,
    ``cache_dir()/models/url/HOST/DIGEST/FILE`` otherwise (the shards of one model share a folder, as
    llama-server expects)."""
    parts = urlsplit(url)
    if _on_hub(url) and "/resolve/" in parts.path:
        repo, _, rest = parts.path.lstrip("/").partition("/resolve/")
        _rev, _, file = rest.partition("/")
        return str(cache_dir() / "models" / "huggingface" / repo / unquote(file))
    folder, _, name = parts.path.rpartition("/")
    digest = hashlib.sha256(f"{parts.scheme}://{parts.netloc}{folder}?{parts.query}".encode()).hexdigest()[:16]
    host = re.sub(r"[^\w.-]", "_", parts.netloc)
    return str(cache_dir() / "models" / "url" / host / digest / unquote(name))


def _headers_for(url: str) -> dict[str, str]:
    """The Hub's authorization for a Hub URL; nothing for other hosts (the token never leaves the Hub)."""
    if not _on_hub(url):
        return {}
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(token=_hf_token())


def file_metadata(url: str, client) -> RemoteFile:
    """Size, ETag, hash and fetch location of ``url``: the Hub's file metadata for a Hub URL, a HEAD otherwise."""
    if _on_hub(url):
        from huggingface_hub import get_hf_file_metadata

        try:
            meta = get_hf_file_metadata(url, token=_hf_token(), endpoint=hf_endpoint())
        except Exception as err:  # noqa: BLE001 -- one line naming the URL
            raise _hub_error(url, err) from None
        if meta.size is None:
            raise ModelError(f"{url}: the Hub did not give the file's size")
        etag = meta.etag
        sha = etag if etag and re.fullmatch(r"[0-9a-f]{64}", etag) else None
        return RemoteFile(url, meta.location or url, meta.size, etag, sha, cache_path_for(url))
    try:
        r = client.head(url, headers=_headers_for(url))
    except _transport_errors() as err:
        raise ModelError(unreachable(url, url)) from None
    if r.status_code >= 400:
        raise _status_error(url, r.status_code)
    size = r.headers.get("Content-Length")
    if size is None or not size.isdigit():
        raise ModelError(f"{url}: the server does not say the file's size (no Content-Length)")
    etag = r.headers.get("ETag")
    return RemoteFile(url, str(r.url), int(size), etag, None, cache_path_for(url))


# ---- header reading --------------------------------------------------------------------------------------

def _header_cache(f: RemoteFile) -> Path | None:
    if not f.etag:
        return None
    key = hashlib.sha256(f"{f.url}\0{f.etag}\0{f.size}".encode()).hexdigest()
    return cache_dir() / "gguf-headers" / f"{key}.bin"


class HttpRangeSource:
    """A :class:`orchestrator.model.reader.ByteSource` over HTTP range requests, starting from a cached prefix.
    ``fetched`` counts the bytes that came over the network."""

    def __init__(self, f: RemoteFile, client, cached: bytes = b"") -> None:
        self.name = f.url
        self.size = f.size
        self.file = f
        self.client = client
        self.prefix = bytearray(cached)
        self.fetched = 0

    def read(self, offset: int, n: int) -> bytes:
        end = offset + n
        if end <= len(self.prefix):
            return bytes(self.prefix[offset:end])
        if offset > len(self.prefix):
            raise AssertionError("the GGUF parser reads a contiguous prefix")
        start = len(self.prefix)
        for attempt in (1, 2):
            try:
                self.prefix += self._get(start, end - start)
                break
            except _transport_errors() as err:
                if attempt == 2:
                    raise ModelError(f"{self.name}: connection dropped while reading the GGUF header at byte "
                                     f"{start} (tried twice): {_reason(err)}") from None
        return bytes(self.prefix[offset:end])

    def _get(self, start: int, n: int) -> bytes:
        headers = {**_headers_for(self.file.location), "Range": f"bytes={start}-{start + n - 1}"}
        with self.client.stream("GET", self.file.location, headers=headers) as r:
            if r.status_code == 200:
                raise ModelError(f"{self.name}: the server ignores HTTP range requests (it answered 200 with the "
                                 f"whole {self.size / 2**30:.1f} GiB file); reading the header would download it "
                                 f"all: `orchestrator pull {self.name}` downloads it once, then this URL works")
            if r.status_code != 206:
                raise _status_error(self.name, r.status_code)
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > n:
                    break
        self.fetched += len(data)
        if len(data) != n:
            raise ModelError(f"{self.name}: the server sent {len(data)} bytes for a range of {n} at offset {start}")
        return bytes(data)


@dataclass(frozen=True)
class RemoteModel:
    """A remote model read from its headers: ``info`` names the URLs in its paths; ``files`` where each shard is
    fetched and cached; ``local_info`` is ``info`` with the cache paths llama-server will be given."""

    ref: str
    info: ModelInfo
    files: tuple[RemoteFile, ...]
    fetched: int          # header bytes that came over the network (0 when all came from the cache)

    @property
    def local_info(self) -> ModelInfo:
        return dataclasses.replace(self.info, paths=tuple(f.cache_path for f in self.files))

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def first_url(ref: RemoteRef) -> str:
    """The URL of the (first) file a reference names; asks the Hub which file a quantization is."""
    if ref.kind == "url":
        return ref.url
    if ref.kind == "hf-file":
        return _hf_url(ref.repo, ref.file)
    return _hf_url(ref.repo, pick_quant(ref.repo, ref.quant, _list_repo(ref.repo)))


def read_remote_model(text: str) -> RemoteModel:
    """Read the remote model ``text`` names (every shard's header and tensor index), nothing more."""
    ref = parse_ref(text)
    if ref is None:
        raise ModelError(f"{text}: not a URL or Hugging Face reference")
    url = first_url(ref)
    files: dict[str, RemoteFile] = {}
    fetched = 0
    with _client() as client:
        def read(u: str) -> GgufFile:
            nonlocal fetched
            f = file_metadata(u, client)
            files[u] = f
            if is_downloaded(f):
                # this very version is already in the cache (`pull`, or an earlier `up`): read it there, which
                # also serves a server that ignores range requests, and costs no request beyond the HEAD
                return dataclasses.replace(read_gguf(f.cache_path), path=u)
            cache = _header_cache(f)
            cached = b""
            if cache is not None:
                try:
                    cached = cache.read_bytes()
                except OSError:
                    pass
            src = HttpRangeSource(f, client, cached)
            g = read_gguf_source(src)
            fetched += src.fetched
            if cache is not None and src.fetched:
                from orchestrator.fsutil import write_atomic

                cache.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(cache, bytes(src.prefix))
            return g

        info = read_model(url, read=read)
    return RemoteModel(text, info, tuple(files[u] for u in info.paths), fetched)


@dataclass(frozen=True)
class RemoteFiles:
    """The files a remote reference names, without reading them (what a download needs)."""

    ref: str
    files: tuple[RemoteFile, ...]


def locate(text: str) -> RemoteFiles:
    """Every file (shard) of the remote model ``text`` names, with sizes, versions and hashes; reads none."""
    ref = parse_ref(text)
    if ref is None:
        raise ModelError(f"{text}: not a URL or Hugging Face reference")
    urls = shard_paths(first_url(ref))
    with _client() as client:
        files = []
        for i, u in enumerate(urls):
            try:
                files.append(file_metadata(u, client))
            except MissingFile:
                if i == 0:
                    raise
                raise MissingFile(f"{u}: missing shard {i + 1} of {len(urls)} (of {urls[0]})") from None
    return RemoteFiles(text, tuple(files))


def download(text: str, *, progress: bool = True) -> list[str]:
    """Download the remote model ``text`` names into the cache (what is not there yet), check that it reads as a
    GGUF model, and return the local paths."""
    target = locate(text)
    paths = pull(target, progress=progress)
    try:
        read_model(paths[0])
    except ModelError as err:
        for f in target.files:
            for p in (Path(f.cache_path), _done_marker(f)):
                p.unlink(missing_ok=True)
        raise ModelError(f"{target.files[0].url}: downloaded, but it is not a usable GGUF model (removed): "
                         f"{str(err).removeprefix(paths[0] + ': ')}") from None
    return paths


def load_model(path: str) -> tuple[ModelInfo, RemoteModel | None]:
    """A local model read from its file(s), or a remote one read from its headers (its ModelInfo then names the
    cache paths the files are downloaded to)."""
    if parse_ref(path) is None:
        return read_model(path), None
    remote = read_remote_model(path)
    return remote.local_info, remote


# ---- downloading -----------------------------------------------------------------------------------------

def _part(f: RemoteFile) -> Path:
    return Path(f.cache_path + ".part")


def _part_marker(f: RemoteFile) -> Path:
    """Which version of the file the part holds: a part of another version is not resumed."""
    return Path(f.cache_path + ".part.json")


def _source_doc(f: RemoteFile) -> str:
    return json.dumps({"url": f.url, "etag": f.etag, "size": f.size, "sha256": f.sha256})


def _done_marker(f: RemoteFile) -> Path:
    return Path(f.cache_path + ".source.json")


def is_downloaded(f: RemoteFile) -> bool:
    """The cache holds this very file: complete, and downloaded from the same URL and version."""
    try:
        if os.path.getsize(f.cache_path) != f.size:
            return False
        meta = json.loads(_done_marker(f).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("url") == f.url and meta.get("etag") == f.etag


def download_missing(text: str, say, *, progress: bool = True) -> list[str] | None:
    """What ``pull`` and ``up`` do with a model path: for a remote model, say how much is left to download
    (``say`` takes one line) and download it into the cache, returning the local paths; None for a local model."""
    if not is_remote(text):
        return None
    target = locate(text)
    left = bytes_to_download(target.files)
    if left:
        say(f"pull: {target.ref}: {len(target.files)} file(s), {left / 2**30:.2f} GiB to download into "
            f"{os.path.dirname(target.files[0].cache_path)}")
    return download(text, progress=progress)


def bytes_to_download(files: tuple[RemoteFile, ...]) -> int:
    left = 0
    for f in files:
        if is_downloaded(f):
            continue
        try:
            have = _part(f).stat().st_size
        except OSError:
            have = 0
        left += max(f.size - have, 0)
    return left


def check_disk(model: RemoteModel | RemoteFiles) -> int:
    """The bytes left to download; refuses with the numbers when the cache's file system cannot hold them."""
    need = bytes_to_download(model.files)
    if not need:
        return 0
    folder = Path(model.files[0].cache_path).parent
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need + DISK_MARGIN > free:
        raise ModelError(f"{model.ref}: not enough disk space in {folder}: the download needs "
                         f"{need / 2**30:.2f} GiB (+{DISK_MARGIN / 2**30:.0f} GiB margin), "
                         f"{free / 2**30:.2f} GiB free")
    return need


def pull(model: RemoteModel | RemoteFiles, *, progress: bool = True) -> list[str]:
    """Download every file of ``model`` not yet in the cache; returns the local paths."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    check_disk(model)
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())
    with _client() as client, Progress(*columns, console=console, disable=not progress,
                                       transient=False) as bar:
        for f in model.files:
            if is_downloaded(f):
                continue
            task = bar.add_task(Path(f.cache_path).name, total=f.size)
            _download(f, client, lambda n, t=task: bar.update(t, completed=n))
    return [f.cache_path for f in model.files]


def _download(f: RemoteFile, client, report) -> None:
    part = _part(f)
    hasher = _PartHash() if f.sha256 else None
    for attempt in (1, 2):
        try:
            _fetch_into(f, part, client, report, hasher)
            break
        except _transport_errors() as err:
            have = part.stat().st_size if part.exists() else 0
            if attempt == 2:
                raise ModelError(f"{f.url}: connection dropped at byte {have} of {f.size} (tried twice): "
                                 f"{_reason(err)}; run `orchestrator pull` again to resume") from None
    have = part.stat().st_size
    if have != f.size:
        raise ModelError(f"{f.url}: downloaded {have} bytes but the file has {f.size}; run `orchestrator pull` "
                         f"again to resume")
    if hasher is not None:
        hasher.catch_up(part, have)
        digest = hasher.h.hexdigest()
        if digest != f.sha256:
            part.unlink()
            _part_marker(f).unlink(missing_ok=True)
            raise ModelError(f"{f.url}: SHA-256 mismatch: the Hub publishes {f.sha256}, the download is {digest} "
                             f"(the part file was removed; pull again)")
    from orchestrator.fsutil import write_atomic

    write_atomic(_done_marker(f), _source_doc(f))
    os.replace(part, f.cache_path)
    _part_marker(f).unlink(missing_ok=True)


class _PartHash:
    """SHA-256 of a part file as it grows: bytes are hashed as they arrive, and what an earlier pull left is
    read once from disk, so a 400 GB download is not read back whole to be checked."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.n = 0

    def catch_up(self, part: Path, have: int) -> None:
        """Hash the part's bytes ``n..have`` (starting over when the part was cut below what was hashed)."""
        if have < self.n:
            self.h, self.n = hashlib.sha256(), 0
        if have == self.n:
            return
        with open(part, "rb") as fh:
            fh.seek(self.n)
            while self.n < have and (chunk := fh.read(min(8 * CHUNK, have - self.n))):
                self.h.update(chunk)
                self.n += len(chunk)

    def update(self, chunk: bytes) -> None:
        self.h.update(chunk)
        self.n += len(chunk)


def _fetch_into(f: RemoteFile, part: Path, client, report, hasher: _PartHash | None) -> None:
    """Append the rest of ``f`` to ``part`` (created on the first byte received)."""
    have = part.stat().st_size if part.exists() else 0
    if have:
        try:
            same = json.loads(_part_marker(f).read_text()) == json.loads(_source_doc(f))
        except (OSError, ValueError):
            same = False
        if not same or have > f.size:
            part.unlink()
            have = 0
    report(have)
    if have == f.size:
        return
    headers = dict(_headers_for(f.location))
    if have:
        headers["Range"] = f"bytes={have}-"
        # a plain URL's ETag is the resource's own: resume only the same version. A Hub file's ETag is its LFS
        # hash, not the CDN's ETag (that would never match): its CDN address names the content, and the hash
        # is checked at the end.
        if f.etag and not f.sha256:
            headers["If-Range"] = f.etag
    with client.stream("GET", f.location, headers=headers) as r:
        if r.status_code == 200:
            have = 0            # no range support, or the file changed since the part was written: start over
        elif r.status_code == 206:
            if not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                raise ModelError(f"{f.url}: the server resumed at the wrong place "
                                 f"({r.headers.get('Content-Range')!r} for bytes {have}-)")
        else:
            raise _status_error(f.url, r.status_code)
        if hasher is not None:
            hasher.catch_up(part, have)
        part.parent.mkdir(parents=True, exist_ok=True)
        out = None
        try:
            for chunk in r.iter_bytes():     # as it arrives: a drop loses nothing received
                if out is None:
                    if not have:
                        from orchestrator.fsutil import write_atomic

                        write_atomic(_part_marker(f), _source_doc(f))
                    out = open(part, "r+b" if have and part.exists() else "wb")
                    out.seek(have)
                    out.truncate()
                try:
                    out.write(chunk)
                    if hasher is not None:
                        hasher.update(chunk)
                except OSError as err:
                    raise ModelError(f"{f.url}: cannot write {part}: {err.strerror or err}; the part is kept, "
                                     f"pull again to resume once there is room") from None
                have += len(chunk)
                report(have)
        finally:
            if out is not None:
                out.close()
