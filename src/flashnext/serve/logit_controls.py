"""Penalties and logit controls: what a request's history and its own settings do to its logits before sampling.

As OpenAI and vLLM define them (`SamplingParams` fields, checked by `sampling.check_controls`), applied in this
order to a row of next-token logits `x` (fp32), where `c[t]` counts token t in the request's generated tokens before the
position (drafts ahead of it included under speculation) and `seen[t]` is whether t is in its prompt or in those:
1. `logit_bias` {token id: b in [-100, 100]}: `x[t] += b`;
2. `min_tokens`: while fewer tokens than that are generated, EOS (unless `ignore_eos`) and every `stop_token_ids`
   id get `x[t] = -inf`;
3. `repetition_penalty` r > 0, over prompt and output: `x[t] = x[t] / r if x[t] > 0 else x[t] * r` where `seen[t]`;
4. `frequency_penalty` f and `presence_penalty` p in [-2, 2], over the generated tokens only:
   `x[t] -= f * c[t]`, then `x[t] -= p * (c[t] > 0)`.
Then `serve.sampling` takes over: temperature, top-k, `min_p` (a truncation: `sampling.target_probs`), top-p.
A greedy row takes the argmax of the controlled logits.

`LogitControls.apply` does this for a batch of rows in a few tensor ops: per-row parameter tensors, and a table of
output-token counts `[rows, V]` with one row per live penalised request (prompt presence beside it), updated
incrementally (each step adds the tokens the request emitted since the last one, one scatter per request); only
the columns some live request touched (a [V] mask) are gathered and changed, since no control moves another.
Rows of requests without any control are not touched (bitwise: the result's row is `logits.float()`'s), and a
batch without any costs nothing. A speculative verify step asks for the rows of one request's positions with the
drafts before each added (`extras`), so position k is penalised exactly as a plain step would after the tokens
before it: greedy output with speculation equals the output without (tested), and sampled drafts are accepted
against the same penalised target. The table is keyed by request (not slot), so preemption and recompute, `n`
choices (each its own row) and slot reuse need no bookkeeping; a finished request's row is reused.

Log-probs: "raw" stays the model's distribution (before any control); "processed" is of the controlled logits at
the row's temperature (`reported_logprobs`), the distribution actually sampled from (top-k/top-p/min-p aside).

Legend: R rows of the step, m of them controlled, V vocabulary.
"""

from __future__ import annotations

import torch

from flashnext.serve.sampling import mode_logprobs

__all__ = ["LogitControls", "controlled", "reported_logprobs"]

def controlled(p) -> bool:
    """Whether `SamplingParams` p changes the logits here (`min_p` is a truncation, applied by the sampler)."""
    return bool(
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias or p.min_tokens
    )


def reported_logprobs(raw: torch.Tensor, ctl: torch.Tensor, params: list) -> torch.Tensor:
    """fp32 [R, V] log-probs as each row's `logprobs_mode` asks: "raw" of the model's logits `raw`, "processed"
    of the controlled logits `ctl` (the same tensor when no row is controlled)."""
    if ctl is raw:
        return mode_logprobs(raw, params)
    processed = torch.tensor([p.logprobs_mode == "processed" for p in params], device=raw.device)
    return mode_logprobs(torch.where(processed[:, None], ctl, raw.float()), params)


def _gather(t: torch.Tensor, flat: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Elements `flat` (row * V + column) of a contiguous [*, V] tensor, as [len(flat) // K, K] (K columns)."""
    return t.reshape(-1).index_select(0, flat).view(-1, cols.numel())


class _Row:
    """A live controlled request's row of the count table and its constant tensors."""

    def __init__(self, index: int, bias_ids, bias_vals, stop_ids):
        self.index, self.counted = index, 0  # row of the table; output tokens added to it so far
        self.bias_ids, self.bias_vals, self.stop_ids = bias_ids, bias_vals, stop_ids


class LogitControls:
    """The engine's per-request token counts and the batched application of the controls (see the module doc).

    Args:
        eos_id: the id `min_tokens` blocks (with each request's `stop_token_ids`) unless the request ignores EOS.
    """

    def __init__(self, eos_id: int | None):
        self.eos_id = eos_id
        self.rows: dict = {}  # Request -> _Row (requests compare by identity)
        self.free: list[int] = []
        self.counts: torch.Tensor | None = None  # int32 [capacity, V]: generated-token counts
        self.prompt: torch.Tensor | None = None  # bool [capacity, V]: token in the prompt
        self.touched: torch.Tensor | None = None  # bool [V]: a prompt, output, bias or stop id of some live row

    def apply(self, logits: torch.Tensor, reqs: list, extras: list[list[int]] | None = None) -> torch.Tensor:
        """Row i of `logits` [R, V] controlled for `reqs[i]`, as if `extras[i]` (default none) had been generated
        after its output so far. Returns `logits` itself when no row is controlled, else a new fp32 [R, V] whose
        uncontrolled rows are `logits.float()`'s. Only the K columns some live request has touched (prompt,
        output, bias or stop ids: `touched`) are gathered and changed, so the work is [m, K], not [m, V]."""
        act = [i for i, r in enumerate(reqs) if controlled(r.params)]
        if not act:
            return logits
        V, dev = logits.shape[1], logits.device
        self._release_finished()
        rows = [self._sync(reqs[i], V, dev) for i in act]
        extra = [list(extras[i]) if extras is not None else [] for i in act]
        flat = [(j, t) for j, e in enumerate(extra) for t in e]
        if flat:
            j_x, t_x = torch.tensor(flat, dtype=torch.long, device=dev).T.contiguous()
            self.touched[t_x] = True
        cols = self.touched.nonzero().squeeze(1)  # [K], ascending
        idx = torch.tensor([r.index for r in rows], dtype=torch.long, device=dev)[:, None]
        at_table, at_logits = (idx * V + cols).view(-1), (torch.tensor(act, device=dev)[:, None] * V + cols).view(-1)
        counts = _gather(self.counts, at_table, cols)  # [m, K], a copy: the extras are this call's alone
        if flat:
            counts.index_put_((j_x, torch.searchsorted(cols, t_x)), torch.ones_like(j_x, dtype=counts.dtype),
                              accumulate=True)  # fmt: skip
        params = [reqs[i].params for i in act]
        x = _gather(logits, at_logits, cols).float()  # [m, K]
        self._bias(x, rows, cols)
        lengths = [len(reqs[i].output_ids) + len(e) for i, e in zip(act, extra, strict=True)]
        self._min_tokens(x, rows, lengths, params, cols)
        if any(p.repetition_penalty != 1.0 for p in params):
            r = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
            seen = _gather(self.prompt, at_table, cols) | (counts > 0)
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            f = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
            pr = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
            x = x - f * counts - pr * (counts > 0)
        out = logits.float().contiguous()
        out = out.clone() if out is logits else out
        out.view(-1).index_copy_(0, at_logits, x.view(-1))
        return out

    @staticmethod
    def _bias(x: torch.Tensor, rows: list[_Row], cols: torch.Tensor) -> None:
        have = [(j, r) for j, r in enumerate(rows) if r.bias_ids is not None]
        if have:
            at = torch.cat([torch.full_like(r.bias_ids, j) for j, r in have])
            ids = torch.searchsorted(cols, torch.cat([r.bias_ids for _, r in have]))
            x.index_put_((at, ids), torch.cat([r.bias_vals for _, r in have]), accumulate=True)

    @staticmethod
    def _min_tokens(x: torch.Tensor, rows: list[_Row], lengths: list[int], params, cols: torch.Tensor) -> None:
        block = [(j, r) for j, (r, n, p) in enumerate(zip(rows, lengths, params, strict=True))
                 if n < p.min_tokens and r.stop_ids.numel()]  # fmt: skip
        if block:
            at = torch.cat([torch.full_like(r.stop_ids, j) for j, r in block])
            ids = torch.searchsorted(cols, torch.cat([r.stop_ids for _, r in block]))
            x.index_put_((at, ids), torch.tensor(float("-inf"), device=x.device))

    def _sync(self, req, V: int, dev) -> _Row:
        """The request's row, created on first use (prompt presence set), its counts brought up to its output."""
        row = self.rows.get(req)
        if row is None:
            row = self.rows[req] = self._new_row(req, V, dev)
        new = req.output_ids[row.counted :]
        if new:
            t = torch.tensor(new, dtype=torch.long, device=dev)
            at = torch.full_like(t, row.index)
            self.counts.index_put_((at, t), torch.ones_like(t, dtype=self.counts.dtype), accumulate=True)
            self.touched[t] = True
            row.counted += len(new)
        return row

    def _new_row(self, req, V: int, dev) -> _Row:
        if not self.free:
            self._grow(V, dev)
        index = self.free.pop()
        self.counts[index].zero_()
        self.prompt[index].zero_()
        prompt_ids = torch.tensor(req.prompt_ids, dtype=torch.long, device=dev)
        self.prompt[index, prompt_ids] = True
        self.touched[prompt_ids] = True
        p = req.params
        bias_ids = bias_vals = None
        if p.logit_bias:
            bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            bias_vals = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=dev)
        stops = set(p.stop_token_ids) | ({self.eos_id} if self.eos_id is not None and not p.ignore_eos else set())
        stop_ids = torch.tensor(sorted(t for t in stops if 0 <= t < V), dtype=torch.long, device=dev)
        self.touched[stop_ids] = True
        if bias_ids is not None:
            self.touched[bias_ids] = True
        return _Row(index, bias_ids, bias_vals, stop_ids)

    def _grow(self, V: int, dev) -> None:
        """Double the table (4 rows at first); the old rows keep their content."""
        old = 0 if self.counts is None else self.counts.shape[0]
        new = max(4, 2 * old)
        counts = torch.zeros(new, V, dtype=torch.int32, device=dev)
        prompt = torch.zeros(new, V, dtype=torch.bool, device=dev)
        if old:
            counts[:old], prompt[:old] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt
        if self.touched is None:
            self.touched = torch.zeros(V, dtype=torch.bool, device=dev)
        self.free.extend(range(new - 1, old - 1, -1))

    def _release_finished(self) -> None:
        for req in [r for r in self.rows if r.finished]:
            self.free.append(self.rows.pop(req).index)
        if not self.rows and self.touched is not None:
            self.touched.zero_()  # columns of gone requests stop costing work
