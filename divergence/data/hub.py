"""`hf:NAME[:CONFIG]` sources, read through `datasets.load_dataset(..., split=cfg.hf_split)`.

NAME is a hub dataset (`hf:Salesforce/wikitext:wikitext-103-raw-v1`), or a local path, which keeps the same code
path usable offline and in tests: a folder goes to `load_dataset(folder)` (the builder is inferred from the files
in it), a file to the builder its extension names (`hf:corpus.jsonl` -> `load_dataset("json", data_files=...)`).
A hub dataset's cache key holds its name, config, split and column but no revision (that would need the network
on every run): delete its `tok-`/`ids-` files in the data cache to pick up a new upload.

HUB_COPIES names the hub copy of a named source (`wikitext-2`), fetched on first use when no local copy exists.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..errors import DataError
from ..recipe import DataConfig
from .base import Source, search_paths

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# name -> (hub dataset, config, split): the raw text of WikiText-2's training split (2.1M words, 10.9 MB; the
# local copy in ../shared/data holds the tokenised validation and test splits, 2.4 MB).
HUB_COPIES = {"wikitext-2": ("Salesforce/wikitext", "wikitext-2-raw-v1", "train")}
log = logging.getLogger(__name__)


class HubUnavailable(DataError):
    """A hub dataset that `datasets` cannot load; `cause` is the reason alone, for messages that wrap it."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def hub_unreachable():
    """Why the hub cannot be reached, or None: one TCP connect of at most 5 s, instead of huggingface_hub's five
    retries (25 s of "Retrying in 8s" lines measured on a machine without network, 2026-11-23). Skipped under
    HF_HUB_OFFLINE (datasets then answers from its own cache or fails at once) and behind a proxy."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no"):
        return None
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        return f"cannot reach {host}:{port}: {e.strerror or type(e).__name__}"
    return None


def hub_copy(name: str, cfg: DataConfig, tried: str, put: str) -> Source:
    """The hub copy of named source `name`, read through `datasets` (which caches the download) on first use;
    one line saying so before the download, and one line naming every way to get text when it fails.
    `tried`: the local places looked at; `put`: the folder where a local copy would be found."""
    repo, config, split = HUB_COPIES[name]
    spec = f"{repo}:{config}"
    inner = hub_source(spec, dataclasses.replace(cfg, hf_split=split, hf_text_field="text"))

    def read():
        def fail(cause):
            return DataError(f"data.source {name!r}: no local copy (tried {tried}) and the hub copy hf:{spec} "
                             f"cannot be fetched ({cause}); put its *.txt files in {put}, or train on "
                             f"synthetic text: --set data.source=synthetic")

        cause = hub_unreachable()
        if cause:
            raise fail(cause)
        log.warning("data.source %r: no local copy (tried %s); fetching hf:%s split %s through `datasets` "
                    "(first use only: cached afterwards)", name, tried, spec, split)
        try:
            return inner.read()
        except HubUnavailable as e:
            raise fail(e.cause) from None

    return Source(f"{name} (no local copy): {inner.description}", inner.identity, read)


def hub_source(spec: str, cfg: DataConfig) -> Source:
    name, _, config = spec.partition(":")
    if not name:
        raise DataError(f"data.source 'hf:{spec}': expected hf:NAME or hf:NAME:CONFIG")
    config = config or None
    local = _local_path(name)
    identity = {"hf": name, "config": config, "split": cfg.hf_split, "field": cfg.hf_text_field}
    if local is None:
        args, kwargs = (name, config), {}
    elif local.is_dir():
        args, kwargs = (str(local), config), {}
        hidden = lambda p: any(q.startswith(".") for q in p.relative_to(local).parts)  # .cache/, .git/
        files = sorted(p for p in local.rglob("*") if p.is_file() and not hidden(p))
        identity["files"] = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    else:
        builder = BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise DataError(f"data.source 'hf:{spec}': no `datasets` builder for {local.suffix!r} files; "
                            f"known: {', '.join(BUILDERS)}")
        args, kwargs = (builder, config), {"data_files": str(local)}
        identity["files"] = [[str(local), local.stat().st_size, local.stat().st_mtime_ns]]
    shown = str(local) if local is not None else name
    description = f"hf:{shown}{':' + config if config else ''} split={cfg.hf_split} field={cfg.hf_text_field}"
    if cfg.max_chars is not None:
        description += f" first {cfg.max_chars:,} chars"
    return Source(description, identity, lambda: _read(spec, args, kwargs, cfg))


def _local_path(name: str):
    for cand in search_paths(Path(name).expanduser()):
        if cand.exists():
            return cand.resolve()
    return None


def _read(spec: str, args: tuple, kwargs: dict, cfg: DataConfig) -> list:
    """The rows' text as one document, rows joined by newlines, stopping after cfg.max_chars characters."""
    import datasets

    where, field, left = f"data.source 'hf:{spec}'", cfg.hf_text_field, cfg.max_chars
    parts = []
    try:
        # Streaming when max_chars is set: FineWeb-Edu's train split is terabytes; streaming reads only the head.
        ds = datasets.load_dataset(*args, split=cfg.hf_split, streaming=left is not None, **kwargs)
        for row in ds:
            if field not in row:
                raise DataError(f"{where}: no column {field!r} (data.hf_text_field); columns: {', '.join(row)}")
            text = row[field]
            if text is None:
                continue
            if not isinstance(text, str):
                kind = type(text).__name__
                raise DataError(f"{where}: column {field!r} holds {kind}, not text; set data.hf_text_field")
            if not text.endswith("\n"):  # the `text` builder strips line ends; rows are lines or documents
                text += "\n"
            if left is not None:
                text, left = text[:left], left - len(text)
            parts.append(text)
            if left is not None and left <= 0:
                break
    except DataError:
        raise
    except Exception as e:  # ConnectionError offline, DatasetNotFoundError, ValueError for a bad split, ...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise HubUnavailable(
            f"{where}: cannot load ({type(e).__name__}: {first}); offline, use a local file or folder "
            f"(data.source: path, or hf:path), and set HF_HUB_OFFLINE=1 to fail fast instead of retrying",
            cause=f"{type(e).__name__}: {first}") from None
    if not any(p.strip() for p in parts):
        raise DataError(f"{where}: split {cfg.hf_split!r} column {field!r} holds no text")
    return ["".join(parts)]
