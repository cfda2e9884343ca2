"""Models named by their Hugging Face Hub id (`meta-llama/Llama-3.1-8B`), read from the local
Hugging Face cache only: nothing is downloaded at run time. The cache is huggingface_hub's own
(`HF_HOME`, or `HF_HUB_CACHE`; default ~/.cache/huggingface/hub), so a model fetched once with
`hf download ORG/NAME` is found offline."""

from __future__ import annotations

import re
from pathlib import Path

COMMIT = re.compile(r"^[0-9a-f]{40}$")  # what refs/main holds: a commit's hash
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_hub_id(source: str) -> bool:
    """`ORG/NAME` that is not an existing local path."""
    return bool(HUB_ID.match(source)) and not Path(source).exists()


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of `repo_id` (its main revision) with a config.json, or None. It reads the
    cache's layout as huggingface_hub's own offline lookup does (`snapshot_download(local_files_only=True)`:
    refs/main names the commit whose folder under snapshots/ holds the files), without importing that
    module's download machinery (a fifth of a CPU-second before `advise` can start)."""
    folder = Path(cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    ref = folder / "refs" / "main"
    if not ref.is_file():  # a FIFO or a device there is not a ref either: nothing reads it
        return None
    try:
        commit = ref.read_text(errors="replace").strip()
    except OSError:
        return None
    if not COMMIT.match(commit):
        return None
    path = folder / "snapshots" / commit
    return path if (path / "config.json").is_file() else None


def download_fix(repo_id: str) -> str:
    return (
        f"download it once where there is network (`hf download {repo_id}`, into {cache_dir()}; set HF_HOME to "
        "use another cache), or point model.source at a local model directory"
    )
