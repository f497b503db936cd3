"""flashnext: train and serve Qwen3.8-Flash-Next (`qwen4_exp`) exactly, on packed token streams."""

from flashnext.config import ModelConfig, TextConfig, load_config

__all__ = ["ModelConfig", "TextConfig", "build_model", "from_pretrained", "load_config", "save_pretrained"]


def __getattr__(name: str):
    # Lazy: `import flashnext` stays cheap (no model or safetensors import until first use).
    if name in ("from_pretrained", "build_model"):
        from flashnext import build

        return getattr(build, name)
    if name == "save_pretrained":
        from flashnext.checkpoint import save_pretrained

        return save_pretrained
    raise AttributeError(f"module 'flashnext' has no attribute {name!r}")
