"""Selective loading from the Hugging Face Hub: fetch only the shards the requested layers need.

    plan = plan_download("moonshotai/Kimi-K3", layers=range(0, 4))
    print(plan.describe())                    # which shards, how many bytes, what is cached already
    files, nbytes = plan                      # unpacks as (files, bytes)
    path = fetch(plan)                        # the local snapshot directory, ready for the loader

`from_pretrained("org/name", layers=...)` does both. The plan reads
`config.json` and `model.safetensors.index.json` first (small files), then takes the shard names
from the index's `weight_map` entries of exactly the tensors the loader will read (the global
tensors plus the requested layers' ones; never constructed from a naming pattern). Tokenizer
files are fetched when the repo has them. Sizes come from the Hub (`get_paths_info`) when online,
from the cached files when offline. Downloads go through `hf_hub_download` (its cache, its tqdm
progress bars, `revision=`, `token=`).

Offline means the cache only: `local_files_only=True`, `HF_HUB_OFFLINE=1` (read at call time), or a
Hub that does not answer one HEAD request within PROBE_TIMEOUT_S (huggingface_hub alone would
retry it for ~25 s per file). Every message names the reason and the cache directory it read.

A shard that cannot be had (offline and not cached, or a partial cache) is reported in one
`CheckpointError` that lists every missing file and the layers that need it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError
from ..model.config import KimiDecoderConfig
from .checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointDir,
    missing_shards_message,
    plan_tensors,
    resolve_layers,
    shards_needed,
)

__all__ = ["DownloadPlan", "TOKENIZER_FILES", "fetch", "fetch_tokenizer", "is_repo_id", "plan_download", "resolve_checkpoint"]

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
# fetched when present: the tiktoken vocabulary and its config (kimi_explore.tokenizer), and the chat template
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenization_kimi.py", "generation_config.json")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def is_repo_id(s) -> bool:
    """'org/name' (a Hub repo id), as opposed to a filesystem path."""
    return isinstance(s, str) and bool(_REPO_ID.match(s)) and ".." not in s


PROBE_TIMEOUT_S = 3.0  # one HEAD request to the endpoint; huggingface_hub alone retries an unreachable Hub for ~25 s


def _offline(local_files_only) -> str:
    """Why this load runs from the cache only ("" when the Hub is used): asked to, HF_HUB_OFFLINE is set
    (read now, not at import), or one quick request to the endpoint failed."""
    from huggingface_hub import constants

    if local_files_only:
        return "local_files_only=True"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return _unreachable(constants.ENDPOINT)


def _unreachable(endpoint: str) -> str:
    """"" if `endpoint` answers one HEAD request (any status) within PROBE_TIMEOUT_S, else why not."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)  # the Hub's own client: its proxies and headers
    except Exception as e:  # noqa: BLE001 - any failure to connect means the same: use the cache, say why
        return f"the Hub at {endpoint} is not reachable ({type(e).__name__}: {e})"
    return ""


def _cache_path(cache_dir=None) -> str:
    """The Hugging Face cache directory this load reads (cache_dir=, else HF_HUB_CACHE / HF_HOME's hub/)."""
    from huggingface_hub import constants

    return str(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)


@dataclass
class DownloadPlan:
    """What loading `layers` of `repo_id` needs. Unpacks as `(files, bytes)`.

    files:   every repo file needed, in fetch order (config, index, tokenizer files, shards)
    bytes:   their total size (files of unknown size counted as 0; see `unknown`)
    shards:  the weight shards, in index order
    sizes:   {file: bytes or None}
    cached:  files already in the local cache
    needed_by: {shard: sorted layer ids (with -1 for the global tensors)}
    """

    repo_id: str
    revision: str | None
    layers: list[int]
    files: list[str]
    bytes: int
    shards: list[str]
    sizes: dict[str, int | None]
    cached: set[str]
    needed_by: dict[str, list[int]]
    total_shards: int
    offline: str  # why the load runs from the cache only ("" when it uses the Hub)
    cache_dir: str | None = None
    token: object = field(default=None, repr=False)

    def __iter__(self):
        return iter((self.files, self.bytes))

    @property
    def to_fetch(self) -> list[str]:
        return [f for f in self.files if f not in self.cached]

    @property
    def bytes_to_fetch(self) -> int:
        return sum(self.sizes.get(f) or 0 for f in self.to_fetch)

    @property
    def unknown(self) -> list[str]:
        return [f for f in self.files if self.sizes.get(f) is None]

    def describe(self) -> str:
        """The one line said before downloading."""
        at = f"@{self.revision}" if self.revision else ""
        lay = _ranges(self.layers)
        shards = ", ".join(self.shards) if len(self.shards) <= 6 else f"{', '.join(self.shards[:3])}, ..., {self.shards[-1]}"
        size = _human(self.bytes) + (f" (+{len(self.unknown)} file(s) of unknown size)" if self.unknown else "")
        todo = self.to_fetch
        unsized = [f for f in todo if self.sizes.get(f) is None]
        fetch = (f"{_human(self.bytes_to_fetch)}{f' (+{len(unsized)} of unknown size)' if unsized else ''} in {len(todo)} "
                 "file(s) to download" if todo else "all cached, nothing to download")
        source = f" (cache only: {self.offline})" if self.offline else ""
        return (f"{self.repo_id}{at}: layers {lay} need {len(self.shards)} of {self.total_shards} weight shard(s) "
                f"[{shards}], {len(self.files)} files, {size} in all; {fetch}{source}")


def _ranges(ids: list[int]) -> str:
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def _download(repo_id, filename, *, revision, cache_dir, offline, token) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir, local_files_only=bool(offline),
                                token=token))


def _cached(repo_id, filename, *, revision, cache_dir) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    p = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
    return Path(p) if isinstance(p, str) and Path(p).exists() else None


def _remote_sizes(repo_id, files, *, revision, token) -> tuple[dict[str, int], bool]:
    """({path: size} of the files that exist on the Hub, whether the Hub answered)."""
    from huggingface_hub import HfApi

    try:
        infos = HfApi().get_paths_info(repo_id, list(files), revision=revision, token=token)
    except Exception as e:  # noqa: BLE001 - network/HTTP failures only cost us the size estimate
        log.info("could not get file sizes from the Hub for %s: %s", repo_id, e)
        return {}, False
    return {i.path: int(i.size) for i in infos if getattr(i, "size", None) is not None}, True


def fetch_config(repo_id: str, *, revision: str | None = None, cache_dir=None, local_files_only: bool | None = None,
                 token=None) -> Path:
    """The local path of `repo_id`'s config.json (fetched, or from the cache), and nothing else."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if not is_repo_id(repo_id):
        raise ValueError(f"{repo_id!r} is not a Hub repo id ('org/name')")
    offline = _offline(local_files_only)
    try:
        return _download(repo_id, CONFIG_FILE, revision=revision, cache_dir=cache_dir, offline=offline, token=token)
    except LocalEntryNotFoundError:
        why = f"and {offline}" if offline else "and could not be downloaded"
        raise CheckpointError(
            f"{repo_id}: {CONFIG_FILE} is not in the Hugging Face cache at {_cache_path(cache_dir)} {why}; "
            f"nor is {repo_id!r} a local directory"
        ) from None


def fetch_tokenizer(repo_id: str, *, revision: str | None = None, cache_dir=None, local_files_only: bool | None = None,
                    token=None) -> Path:
    """The local snapshot directory holding `repo_id`'s config.json and the tokenizer's two files (`tiktoken.model`,
    `tokenizer_config.json`), fetched or from the cache; no weights. A file the repo lacks is left to
    `load_tokenizer` to name."""
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    snapshot = fetch_config(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                            token=token).parent
    for f in TOKENIZER_FILES[:2]:
        try:
            _download(repo_id, f, revision=revision, cache_dir=cache_dir, offline=_offline(local_files_only), token=token)
        except (EntryNotFoundError, LocalEntryNotFoundError):
            pass
    return snapshot


def plan_download(repo_id: str, *, layers=None, revision: str | None = None, cache_dir=None,
                  local_files_only: bool | None = None, token=None, embedding: bool = True,
                  head: bool = True) -> DownloadPlan:
    """Which files loading `layers` (0-based; None = all) needs, and how many bytes they are
    (embedding=False / head=False: without the embedding / the output head, as a pipeline stage loads).

    Fetches `config.json` and the index (or uses the cached ones), nothing else.
    """
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    if isinstance(repo_id, (str, os.PathLike)) and Path(repo_id).is_dir():  # (as from_pretrained reads it: before the Hub)
        raise ValueError(f"plan_download: {str(repo_id)!r} is a local directory: from_pretrained reads it as it is, and "
                         "nothing is downloaded (a plan is for a Hub repo id, 'org/name')")
    offline = _offline(local_files_only)
    kw = dict(revision=revision, cache_dir=cache_dir, offline=offline, token=token)
    config_path = fetch_config(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                               token=token)
    snapshot = config_path.parent
    cfg = KimiDecoderConfig.from_file(config_path)
    layer_ids = resolve_layers(layers, cfg.num_hidden_layers)
    try:
        _download(repo_id, INDEX_FILE, **kw)
        ckpt = CheckpointDir(snapshot)
        plan = plan_tensors(cfg, layer_ids, ckpt, embedding, head)
        needed_by = shards_needed(ckpt, plan)  # raises, listing them, if the index lacks tensors we need
        total_shards = len(set(ckpt.weight_map.values()))
    except EntryNotFoundError as e:
        # no index: an unsharded repo, where one file holds everything (offline we can only tell from the cache)
        single = _cached(repo_id, SINGLE_FILE, revision=revision, cache_dir=cache_dir)
        if isinstance(e, LocalEntryNotFoundError) and single is None:
            raise CheckpointError(
                f"{repo_id}: neither {INDEX_FILE} nor {SINGLE_FILE} is in the Hugging Face cache at "
                f"{_cache_path(cache_dir)} {f'and {offline}' if offline else 'and the Hub could not be reached'}: {e}"
            ) from None
        needed_by = {SINGLE_FILE: [-1] + layer_ids}
        total_shards = 1
    shards = list(needed_by)
    candidates = [CONFIG_FILE] + ([INDEX_FILE] if (snapshot / INDEX_FILE).exists() else [])
    remote, answered = ({}, False) if offline else _remote_sizes(repo_id, list(TOKENIZER_FILES) + shards + candidates,
                                                                   revision=revision, token=token)
    if answered:
        tok = [f for f in TOKENIZER_FILES if f in remote]
    else:
        tok = [f for f in TOKENIZER_FILES if _cached(repo_id, f, revision=revision, cache_dir=cache_dir)]
    files = candidates + tok + shards
    sizes, cached = {}, set()
    for f in files:
        local = _cached(repo_id, f, revision=revision, cache_dir=cache_dir)
        if local is not None:
            cached.add(f)
        sizes[f] = remote.get(f, local.stat().st_size if local is not None else None)
    return DownloadPlan(repo_id=repo_id, revision=revision, layers=layer_ids, files=files,
                        bytes=sum(s or 0 for s in sizes.values()), shards=shards, sizes=sizes, cached=cached,
                        needed_by=needed_by, total_shards=total_shards, offline=offline,
                        cache_dir=None if cache_dir is None else str(cache_dir), token=token)


def fetch(plan: DownloadPlan, *, progress: bool = True) -> Path:
    """Download what `plan` lists (skipping cached files); return the local snapshot directory.

    Every shard is attempted; the ones that cannot be had are reported together, with the layers
    that need them.
    """
    from huggingface_hub.errors import LocalEntryNotFoundError

    line = plan.describe()
    log.info(line)
    if progress:
        print(line, file=sys.stderr, flush=True)
    kw = dict(revision=plan.revision, cache_dir=plan.cache_dir, offline=plan.offline, token=plan.token)
    snapshot, missing = None, []
    for f in plan.files:
        try:
            p = _download(plan.repo_id, f, **kw)
        except LocalEntryNotFoundError:
            if f in plan.shards:
                missing.append(f)
                continue
            if f in TOKENIZER_FILES:
                continue  # optional
            raise
        snapshot = snapshot or p.parent
    if missing:
        why = (f"not in the Hugging Face cache at {_cache_path(plan.cache_dir)}, and {plan.offline}" if plan.offline
               else f"not in the Hugging Face cache at {_cache_path(plan.cache_dir)} and the Hub could not be reached")
        where = snapshot if snapshot is not None else plan.repo_id
        raise CheckpointError(
            f"{plan.repo_id}: {len(missing)} shard file(s) the requested layers need are missing ({why}): "
            + missing_shards_message({s: plan.needed_by[s] for s in missing})
            + f". Snapshot: {where}. Download them online once, or load only layers whose shards are cached."
        )
    return snapshot


def resolve_checkpoint(path, *, layers=None, revision=None, cache_dir=None, local_files_only=None, token=None,
                       progress: bool = True, embedding: bool = True, head: bool = True) -> Path:
    """A local checkpoint directory for `path`: itself if it is a directory, else the fetched Hub snapshot."""
    p = Path(path)
    if p.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repo ids, but {p} is a local directory")
        return p
    if not is_repo_id(str(path)):
        raise CheckpointError(
            f"{path}: not a checkpoint directory (expected config.json + safetensors) and not a Hub repo id ('org/name')"
        )
    plan = plan_download(str(path), layers=layers, revision=revision, cache_dir=cache_dir,
                         local_files_only=local_files_only, token=token, embedding=embedding, head=head)
    return fetch(plan, progress=progress)
