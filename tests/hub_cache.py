"""A Hugging Face Hub cache laid out by hand, as ``huggingface_hub`` leaves it after a download,
so tests can resolve hub repo ids with no network::

    <cache>/models--<org>--<name>/
        refs/<revision>            the commit hash the revision points at
        snapshots/<commit>/...     the repo's files

(A real cache keeps the bytes in ``blobs/`` and symlinks to them from the snapshot; plain files
read the same.)
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Mapping
from pathlib import Path


def commit_of(repo_id: str, revision: str = "main") -> str:
    """A deterministic 40-hex commit hash for ``repo_id`` at ``revision``."""
    return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()


def add_to_hub_cache(
    cache: Path,
    repo_id: str,
    files: Path | Mapping[str, bytes | str],
    revision: str = "main",
) -> Path:
    """Put ``files`` (a directory to copy, or names to contents) into ``cache`` as repo
    ``repo_id`` at ``revision``; returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit_of(repo_id, revision)
    snapshot = repo / "snapshots" / commit
    if isinstance(files, Path):
        shutil.copytree(files, snapshot)
    else:
        snapshot.mkdir(parents=True)
        for name, content in files.items():
            path = snapshot / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, str):
                path.write_text(content)
            else:
                path.write_bytes(content)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
