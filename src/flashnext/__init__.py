"""flashnext: train and serve Qwen3.8-Flash-Next (`qwen4_exp`) exactly, on packed token streams."""

from flashnext.config import ModelConfig, TextConfig, load_config

__all__ = ["ModelConfig", "TextConfig", "from_pretrained", "load_config"]


def __getattr__(name: str):
    # Lazy: `import flashnext` stays cheap (no model or safetensors import until first use).
    if name == "from_pretrained":
        from flashnext.checkpoint.pretrained import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'flashnext' has no attribute {name!r}")
