"""Run under torchrun: `flashnext rl` with its weight sync observed. Each rank writes `<report dir>/rank<r>.json`:
the n-gram tables it holds (rows, its row range), the shapes of every tensor it gathered whole (`full_tensor`), and
every piece it sent to the server (name, rows, first row).

    torchrun ... tests/rl/rl_launch_probe.py REPORT_DIR [flashnext rl arguments]
"""

import json
import os
import sys

from torch.distributed.tensor import DTensor

from flashnext.parallel import owner_embedding
from flashnext.rl import weights

report = {"tables": [], "gathered": [], "sent": []}

_full_tensor = DTensor.full_tensor


def full_tensor(self, *args, **kwargs):
    t = _full_tensor(self, *args, **kwargs)
    report["gathered"].append(list(t.shape))
    return t


_push = weights.HTTPWeightSync.push


def push(self, update_id, pieces):
    def watched():
        for p in pieces:
            report["sent"].append([p.name, int(p.tensor.shape[0]) if p.tensor.dim() else 0, int(p.start)])
            yield p

    return _push(self, update_id, watched())


_swap = owner_embedding.swap_ngram_embeddings


def swap(model, group, *args, **kwargs):
    out = _swap(model, group, *args, **kwargs)
    for name, m in model.named_modules():
        if isinstance(m, owner_embedding.OwnerRoutedEmbedding):
            report["tables"].append([f"{name}.weight", m.num_embeddings, m.row_start, m.row_end,
                                     int(m.weight.shape[0])])  # fmt: skip
    return out


if __name__ == "__main__":
    DTensor.full_tensor = full_tensor
    weights.HTTPWeightSync.push = push
    owner_embedding.swap_ngram_embeddings = swap
    import flashnext.parallel.fsdp as fsdp

    fsdp.swap_ngram_embeddings = swap
    from flashnext.cli.rl import main

    out_dir, argv = sys.argv[1], sys.argv[2:]
    rc = main(argv)
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(report, f)
    sys.exit(rc)
