"""Fetching a profile's checkpoints (``chimera prepare`` for profiles without a ``build:`` block, e.g. ``gpu``).

Every checkpoint a profile names is either a local directory (absolute, or relative to the model dir and present
there: used as is) or a hub id (``org/name``). A hub id is fetched into ``<model_dir>/<org>/<name>``, the
directory every engine looks in first (``core.config.resolve_path``), so the service then loads it from there with no network.

Only the files the engines read are fetched: config/tokenizer/processor files and, per folder, the
``*.safetensors`` weights (``*.bin`` only where a folder has no safetensors). With a key prefix (the MoonViT tower
inside the Kimi K2.5 checkpoint, ``vision_tower.``) only the shards that ``model.safetensors.index.json`` lists for
tensors under that prefix are fetched (``grafting.tower.tower_shards``), plus the index and the config files.

Sources: :class:`HubSource` (``huggingface_hub``; refuses under ``HF_HUB_OFFLINE``) or :class:`DirSource` (a local
mirror laid out as ``<root>/<org>/<name>/...``, e.g. an NFS copy of the hub repos; files are copied).
A fetched directory gets a ``.chimera-fetched.json`` manifest (file -> bytes): a later run whose files all match
it does nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from grafting.tower import tower_shards

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
META_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
INDEX = "model.safetensors.index.json"
MANIFEST = ".chimera-fetched.json"


class FetchError(RuntimeError):
    """A checkpoint cannot be fetched (offline, not in the mirror, no tower tensors in the index ...)."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint a profile names: ``where`` (dotted profile key, e.g. ``vlm.tower``), ``ref`` (hub id or
    directory as written), ``key_prefix`` (only tensors under it are needed: the tower in a full VLM checkpoint)."""

    where: str
    ref: str
    key_prefix: str | None = None


@dataclass
class Item:
    """What ``prepare`` does with one checkpoint: ``state`` is ``local`` (a directory in place), ``missing`` (a
    local directory that is not there), ``present`` (fetched before, manifest matches) or ``fetch``; ``files`` maps
    each file to fetch to its size in bytes (empty unless ``fetch``); ``dest`` is where it is (or will be)."""

    checkpoint: Checkpoint
    dest: Path
    state: str
    files: dict[str, int] = field(default_factory=dict)


def checkpoints(profile) -> list[Checkpoint]:
    """Every checkpoint of the profile's families that have no ``build:`` block (those are built, not fetched):
    ``vlm.tower`` (with ``tower_key_prefix``), ``vlm.llm``, ``vlm.projector``, a speculative draft ``model``,
    ``video.model``, ``video.i2v_model``, ``tts.lm``, ``tts.tokenizer``, ``tts.snac``."""
    out: list[Checkpoint] = []
    v = profile.vlm
    if v is not None and v.engine.build is None:
        e = v.engine
        out += [Checkpoint("vlm.tower", e.tower, e.tower_key_prefix), Checkpoint("vlm.llm", e.llm),
                Checkpoint("vlm.projector", e.projector)]
        draft = getattr(e.vllm.speculative, "model", None)
        if draft:
            out.append(Checkpoint("vlm.engine.vllm.speculative.model", draft))
    if profile.video is not None and profile.video.engine.build is None:
        e = profile.video.engine
        out += [Checkpoint("video.model", e.model)] + ([Checkpoint("video.i2v_model", e.i2v_model)]
                                                       if e.i2v_model else [])
    if profile.tts is not None and profile.tts.engine.build is None:
        e = profile.tts.engine
        out += [Checkpoint("tts.lm", e.lm), Checkpoint("tts.snac", e.snac)]
        if e.tokenizer:
            out.append(Checkpoint("tts.tokenizer", e.tokenizer))
    seen, unique = set(), []
    for c in out:  # the same repo named twice (e.g. tokenizer == lm) is fetched once
        if (c.ref, c.key_prefix) not in seen:
            seen.add((c.ref, c.key_prefix))
            unique.append(c)
    return unique


def select_files(files: dict[str, int], key_prefix: str | None = None, index_path: Path | None = None) -> dict[str, int]:
    """The files of a repo listing (``{path: bytes}``) that the engines read.

    Config/tokenizer files (``*.json``, ``*.txt``, ``*.model``, ``*.tiktoken``, ``*.jinja``); weights: with
    ``key_prefix``, the shards ``index_path`` maps tensors under the prefix to (KeyError if none, FetchError if a
    shard is not in the listing); otherwise per folder the ``*.safetensors`` files, or its ``*.bin`` files where it
    has none. Hidden paths (``.gitattributes``, ``.cache/``) are skipped.
    """
    visible = {f: n for f, n in files.items() if not any(part.startswith(".") for part in f.split("/"))}
    keep = {f for f in visible if f.endswith(META_SUFFIXES)}
    if key_prefix:
        shards = set(tower_shards(index_path, key_prefix))
        absent = sorted(shards - set(visible))
        if absent:
            raise FetchError(f"{INDEX} names shards the repo does not have: {absent}")
        keep |= shards
    else:
        folders: dict[str, list[str]] = {}
        for f in visible:
            folders.setdefault(os.path.dirname(f), []).append(f)
        for names in folders.values():
            st = [f for f in names if f.endswith(".safetensors")]
            keep |= set(st or [f for f in names if f.endswith(".bin")])
    return {f: visible[f] for f in sorted(keep)}


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value (read now, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


class HubSource:
    """The Hugging Face Hub via ``huggingface_hub`` (``HF_TOKEN``/``HF_ENDPOINT`` apply as usual; ``endpoint``
    overrides the latter). Every hub failure (unreachable, unknown or gated repo, HTTP error) is a FetchError
    naming the repo."""

    name = "hub"

    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint

    def _call(self, repo: str, fn):
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        try:
            return fn()
        except GatedRepoError:
            raise FetchError(f"{repo} is gated: accept its terms on the hub and set HF_TOKEN") from None
        except RepositoryNotFoundError:
            raise FetchError(f"{repo} not found on the hub (or private: set HF_TOKEN)") from None
        except Exception as err:  # noqa: BLE001 - HTTP errors, and the transport's own types (httpx2 here)
            raise FetchError(f"{repo}: hub request failed: {type(err).__name__}: {err}") from None

    def list_files(self, repo: str) -> dict[str, int]:
        """``{path: bytes}`` of the repo's files (``HfApi.model_info(files_metadata=True)``)."""
        from huggingface_hub import HfApi

        info = self._call(repo, lambda: HfApi(endpoint=self.endpoint).model_info(repo, files_metadata=True))
        return {s.rfilename: int(s.size or 0) for s in info.siblings}

    def index(self, repo: str) -> Path:
        """Local path of the repo's ``model.safetensors.index.json`` (downloaded into the hub cache)."""
        from huggingface_hub import hf_hub_download

        return Path(self._call(repo, lambda: hf_hub_download(repo, INDEX, endpoint=self.endpoint)))

    def fetch(self, repo: str, files: list[str], dest: Path) -> None:
        """Download exactly ``files`` of ``repo`` into ``dest`` (``snapshot_download(allow_patterns=files)``)."""
        from huggingface_hub import snapshot_download

        self._call(repo, lambda: snapshot_download(repo, local_dir=str(dest), allow_patterns=files,
                                                   endpoint=self.endpoint))


class DirSource:
    """A local mirror of hub repos: ``<root>/<org>/<name>/<files>``; selected files are copied."""

    name = "mirror"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def _repo(self, repo: str) -> Path:
        d = self.root / repo
        if not d.is_dir():
            raise FetchError(f"{repo} is not in the mirror {self.root} (no directory {d})")
        return d

    def list_files(self, repo: str) -> dict[str, int]:
        """``{path: bytes}`` of every file under ``<root>/<repo>``."""
        d = self._repo(repo)
        return {p.relative_to(d).as_posix(): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}

    def index(self, repo: str) -> Path:
        """``<root>/<repo>/model.safetensors.index.json``."""
        return self._repo(repo) / INDEX

    def fetch(self, repo: str, files: list[str], dest: Path) -> None:
        """Copy ``files`` from the mirror into ``dest`` (keeping sub-folders)."""
        d = self._repo(repo)
        for f in files:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(d / f, dest / f)


def _fetched(dest: Path) -> bool:
    """True when ``dest`` holds a manifest and every file in it with its recorded size."""
    m = dest / MANIFEST
    if not m.exists():
        return False
    files = json.loads(m.read_text())
    return all((dest / f).is_file() and (dest / f).stat().st_size == n for f, n in files.items())


def plan(profile, source, model_dir: Path) -> list[Item]:
    """One :class:`Item` per checkpoint of ``profile``. Lists repos through ``source`` only for checkpoints that
    are neither local nor fetched already. Raises FetchError when the hub is needed under ``HF_HUB_OFFLINE``
    (naming every checkpoint that is missing), or from the source."""
    items: list[Item] = []
    for c in checkpoints(profile):
        p = Path(c.ref).expanduser()
        local = p if p.is_absolute() else model_dir / p
        if p.is_absolute() or not HUB_ID.match(c.ref):
            items.append(Item(c, local, "local" if local.exists() else "missing"))
        elif _fetched(local):
            items.append(Item(c, local, "present"))
        elif local.exists() and not (local / MANIFEST).exists():
            items.append(Item(c, local, "local"))  # put there by hand (e.g. huggingface-cli download --local-dir)
        else:
            items.append(Item(c, local, "fetch"))
    need = [i for i in items if i.state == "fetch"]
    if need and isinstance(source, HubSource) and hub_offline():
        names = "\n".join(f"  {i.checkpoint.where}: {i.checkpoint.ref} -> {i.dest}" for i in need)
        raise FetchError("HF_HUB_OFFLINE is set and these checkpoints are not in the model directory:\n" + names +
                         "\nunset HF_HUB_OFFLINE, copy them there, or pass --mirror DIR (a local copy of the repos)")
    for i in need:
        c = i.checkpoint
        files = source.list_files(c.ref)
        idx = source.index(c.ref) if c.key_prefix else None
        if c.key_prefix and INDEX not in files:
            raise FetchError(f"{c.where}: {c.ref} has no {INDEX}, so the {c.key_prefix}* shards cannot be chosen")
        i.files = select_files(files, c.key_prefix, idx)
    return items


def fetch(items: list[Item], source) -> None:
    """Fetch every ``fetch`` item into its ``dest`` through ``source`` and write its manifest there."""
    for i in items:
        if i.state != "fetch":
            continue
        i.dest.mkdir(parents=True, exist_ok=True)
        source.fetch(i.checkpoint.ref, list(i.files), i.dest)
        (i.dest / MANIFEST).write_text(json.dumps(i.files, indent=1, sort_keys=True) + "\n")
