"""Package data shipped with megarl (found relative to this file, so it works installed)."""
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TINY_DIR = ASSETS_DIR / "tiny"  # tiny digit-reversal task: tokenizer/, train/test/sft.jsonl


def asset_path(relative: str) -> Path:
    """Absolute path of a shipped asset, e.g. asset_path("tiny/tokenizer")."""
    path = ASSETS_DIR / relative
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such megarl asset; regenerate with "
                                "python megarl/assets/tiny/make_assets.py")
    return path
