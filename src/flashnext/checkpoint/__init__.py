"""Official Hugging Face checkpoint layout <-> our modules, streamed one tensor at a time.

- `load_checkpoint(model, path)`: validate every key, then copy each on-disk tensor into its slice of the
  model's allocated parameters.
- `save_pretrained(model, dir)`: write the official layout (reloadable by transformers).

Building a model from a checkpoint (`from_pretrained`) is `flashnext.build`'s: this package reads and writes
tensors by name and never imports the model classes.
"""

from flashnext.checkpoint.load import load_checkpoint
from flashnext.checkpoint.save import save_pretrained

__all__ = ["load_checkpoint", "save_pretrained"]
