"""Models by Hugging Face hub id: ``model.path=Qwen/Qwen2.5-0.5B-Instruct``.

    local_dir = resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", "model.path")

A path that is a local directory is returned as it is. Otherwise an
``org/name`` id (optionally ``org/name@revision``) is fetched with
``huggingface_hub.snapshot_download`` into the hub cache (``HF_HOME``,
``HF_HUB_CACHE``) and the snapshot directory is returned; with
``HF_HUB_OFFLINE=1`` (or no network) the cached snapshot that ``refs/<revision>``
names is used. Only what megarl reads is downloaded: config, safetensors,
tokenizer files. A model that is neither local nor obtainable is one
ConfigError naming the key and the fix.
"""
from __future__ import annotations

import os
import re

from megarl.errors import ConfigError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
DOWNLOADED = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab.*",
              "*.jinja"]  # config, weights (index included), tokenizer files, chat templates
MODEL_KEYS = ("model.path", "model.tokenizer", "critic.path", "ref.path", "reward.model.path")


def looks_like_repo_id(path: str) -> bool:
    """``org/name`` or ``org/name@revision`` that is not a local path."""
    return bool(_REPO_ID.match(path)) and not os.path.exists(path) and not path.startswith((".", "/", "~"))


def resolve_model_path(path: str, key: str) -> str:
    """A local directory for ``path`` (the value of config key ``key``); see the module docstring."""
    if not looks_like_repo_id(path):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo_id, _, revision = path.partition("@")
    try:
        return snapshot_download(repo_id, revision=revision or None, allow_patterns=DOWNLOADED)
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}={path}: no such local directory, and the Hugging Face hub has no model "
                          f"{repo_id!r} (or it is gated: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE

        why = "HF_HUB_OFFLINE=1" if HF_HUB_OFFLINE else "the hub cannot be reached"
        raise ConfigError(f"{key}={path}: not a local directory and not in the Hugging Face cache {HF_HUB_CACHE} "
                          f"({why}); download it where there is network (hf download {repo_id}) or point {key} "
                          "at a local directory") from None
    except (HfHubHTTPError, OSError) as e:
        raise ConfigError(f"{key}={path}: downloading from the Hugging Face hub failed "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:160]}); retry, or point {key} at a "
                          "local directory") from None


def resolve_hub_models(cfg) -> None:
    """Every model path of a run config (``MODEL_KEYS``) given as a hub id becomes its local snapshot."""
    for key in MODEL_KEYS:
        section, _, field = key.rpartition(".")
        owner = cfg
        for part in section.split("."):
            owner = getattr(owner, part)
        value = getattr(owner, field)
        if value:
            setattr(owner, field, resolve_model_path(value, key))
