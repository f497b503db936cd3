"""The frozen PLE n-gram tables behind one interface, `NgramTable` (`ngram/table.py`), and the storage modes
that choose them at load (`ngram/storage.py`).

| storage  | class               | file        | holds in memory                          |
|----------|---------------------|-------------|------------------------------------------|
| `stored` | `StoredNGramTable`  | `stored.py` | the rows as on disk (FP8 + scale, BF16)  |
| `nf4`    | `NF4NGramTable`     | `nf4.py`    | 4-bit codes + an fp16 scale per row      |
| `mmap`   | `OnDiskNGramTable`  | `ondisk.py` | a bounded row cache; rows read by pread  |

The trainable table is the model's own `nn.Embedding` (`model/ngram.py`). This package sits above `checkpoint/`
(it reads the files' layout and the FP8 format from there) and below `build.py`; `model/` never imports it.
"""

from flashnext.ngram.nf4 import NF4NGramTable
from flashnext.ngram.ondisk import DEFAULT_RESIDENT_MB, OnDiskNGramTable
from flashnext.ngram.storage import STORAGES, fill_quantized_tables, prepare_ngram_storage
from flashnext.ngram.stored import StoredNGramTable
from flashnext.ngram.table import NgramTable, apply_keeping_storage

__all__ = [
    "DEFAULT_RESIDENT_MB",
    "STORAGES",
    "NF4NGramTable",
    "NgramTable",
    "OnDiskNGramTable",
    "StoredNGramTable",
    "apply_keeping_storage",
    "fill_quantized_tables",
    "prepare_ngram_storage",
]
