"""Official Hugging Face checkpoint layout <-> our modules, streamed one tensor at a time.

- `load_checkpoint(model, path)`: validate every key, then copy each on-disk tensor into its slice of the
  model's allocated parameters.
- `save_pretrained(model, dir)`: write the official layout (reloadable by transformers).
- `from_pretrained(path, dtype, device)`: config -> model on meta -> allocate -> load.
"""

from flashnext.checkpoint.load import load_checkpoint
from flashnext.checkpoint.pretrained import from_pretrained
from flashnext.checkpoint.save import save_pretrained

__all__ = ["from_pretrained", "load_checkpoint", "save_pretrained"]
