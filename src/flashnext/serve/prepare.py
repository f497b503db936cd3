"""`prepare_for_inference`: the one explicit step that turns a model into a serving model.

The model's layers have one forward; given serving state they take the fast paths of `flashnext.model.fused`
(same-input projections as one GEMM, skinny GEMMs as `W @ x.T`), whose concatenated weights this builds once.
After a weight update (a trainer's weight sync, `load_state_dict`, an optimizer step on the same parameters) the
fused weights are rebuilt on their next use: each group checks its members' parameter objects, storages and
in-place version counters, so a served step never uses stale weights; calling `prepare_for_inference` again after
an update rebuilds them at once instead. A forward without serving state (training, or a `no_grad` reference
forward) never reads them: it is the plain path whether or not the model was prepared.
"""

from __future__ import annotations

from torch import nn

from flashnext.model import fused


def prepare_for_inference(model: nn.Module) -> nn.Module:
    """Eval mode and the fused serving weights built (in place); returns `model`."""
    model.eval()
    fused.prepare(model)
    return model
