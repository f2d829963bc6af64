"""Hugging Face Hub ids as model folders: `resolve_model("ORG/NAME")` -> the cached snapshot folder
(downloaded with huggingface_hub when online, else read from the HF cache); an existing path is used
as it is. huggingface_hub is optional. Rules: docs/internals/runtime.md.
"""
from __future__ import annotations

import os
import re

# ORG/NAME as the Hub spells repo ids (letters, digits, '-', '_', '.'; no leading '.' or '-').
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
# Weight formats the loader never reads (converters/sources.py: *.safetensors, pytorch_model*.bin).
IGNORE_PATTERNS = ["*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack", "*.ot", "*.tflite", "original/*"]


class HubError(ValueError):
    """A Hub id that cannot be resolved (one line: what failed and the command that fixes it)."""


def is_repo_id(text) -> bool:
    """True when `text` is spelled like a Hub repo id ORG/NAME (and is no local path)."""
    return (isinstance(text, str) and _REPO_ID.fullmatch(text) is not None and ".." not in text
            and "--" not in text and not os.path.exists(text))


def hub_cache_dir() -> str:
    """The Hugging Face hub cache folder, read from the environment now (HF_HUB_CACHE, else
    HF_HOME/hub, else huggingface_hub's default)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return os.path.expanduser(env)
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set (1 / true / yes / on), read from the environment now."""
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in ("1", "ON", "YES", "TRUE")
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def download_command(repo_id: str) -> str:
    return f"hf download {repo_id}"


def _reason(e: Exception | None) -> str:
    """Why the online try failed, in a few words."""
    if e is None:
        return "offline (HF_HUB_OFFLINE is set)"
    if type(e).__name__ == "LocalEntryNotFoundError" and e.__cause__ is not None:
        e = e.__cause__  # huggingface_hub's own cache fallback wraps the network error
    name = type(e).__name__
    if name == "GatedRepoError":
        return "it is a gated repo: accept its terms on huggingface.co and log in (hf auth login)"
    if name == "RepositoryNotFoundError":
        return "no such model on the Hub (a private repo needs: hf auth login)"
    if name == "RevisionNotFoundError":
        return "the Hub has no such revision"
    text = " ".join(str(e).split())[:120]
    text = f"{name}: {text}" if text else name
    if isinstance(e, (ConnectionError, TimeoutError)) or "Connect" in name or "Timeout" in name:
        return f"the Hub could not be reached ({text})"
    return f"the download failed ({text})"


def resolve_model(path_or_id):
    """A model folder for `path_or_id`: the path itself when it exists or is not spelled like a
    Hub id (the caller reports a missing folder); otherwise the Hub snapshot folder in the
    Hugging Face cache (downloaded when online). HubError (a ValueError) when huggingface_hub is
    missing, or the id is neither downloadable nor cached."""
    if not is_repo_id(path_or_id):
        return path_or_id
    repo_id = path_or_id
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HubError(f"{repo_id!r} is not a local folder; to use it as a Hugging Face Hub id install "
                       f"huggingface_hub (pip install 'dinfer-jax[hub]'), or pass a local model folder") from None
    cache = hub_cache_dir()
    online_error = None
    if not hub_offline():
        try:
            return snapshot_download(repo_id, cache_dir=cache, ignore_patterns=IGNORE_PATTERNS)
        except Exception as e:  # network, auth, missing repo: the cache may still hold it
            online_error = e
    try:
        return snapshot_download(repo_id, cache_dir=cache, ignore_patterns=IGNORE_PATTERNS, local_files_only=True)
    except Exception as e:
        incomplete = " (its cached snapshot is incomplete)" if type(e).__name__ == "IncompleteSnapshotError" else ""
        raise HubError(f"{repo_id!r} is not a local folder and not in the Hugging Face cache {cache}{incomplete}: "
                       f"{_reason(online_error)}; download it with: {download_command(repo_id)}") from None
