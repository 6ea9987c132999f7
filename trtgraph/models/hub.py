"""Where a checkpoint is: a `path` source's directory, or a `hub` source's snapshot in the
local Hugging Face cache (downloaded where the network answers and HF_HUB_OFFLINE is unset)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError


# What a Hub snapshot needs: configs, tokenizer, template, weights (never pickles).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]


def checkpoint_dir(source) -> Path:
    """The checkpoint directory of a `path` or `hub` source. A Hub id resolves to a snapshot
    in the local Hugging Face cache (HF_HUB_CACHE, or HF_HOME/hub); where HF_HUB_OFFLINE is
    unset and the network answers, a missing snapshot is downloaded."""
    if source.hub is None:
        return Path(source.path)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE") or (os.path.join(os.environ["HF_HOME"], "hub") if "HF_HOME" in os.environ
                                               else constants.HF_HUB_CACHE)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    for local_only in ((True,) if offline else (False, True)):
        try:
            return Path(snapshot_download(source.hub, revision=source.revision, cache_dir=cache,
                                          local_files_only=local_only, allow_patterns=HUB_PATTERNS))
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    mode = "HF_HUB_OFFLINE is set, so nothing was downloaded" if offline else "and it could not be downloaded"
    raise ConfigError(f"model.hub = {source.hub!r} (revision {source.revision!r}): no snapshot in the Hugging Face "
                      f"cache {cache}, {mode} ({why}). Download it there (`hf download {source.hub}`), point "
                      f"HF_HUB_CACHE or HF_HOME at the cache that has it, or use model.path.")


def hub_record(source, ckpt: Path) -> dict:
    """For the manifest: which Hub snapshot a `hub` source resolved to."""
    if source.hub is None:
        return {}
    return {"hub": {"repo": source.hub, "revision": source.revision, "snapshot": ckpt.name}}
