"""Speculative decoding with the model's MTP head: propose drafts, verify them in one model step, roll back.

A speculating request (`Request.spec_k` > 0: `SamplingParams.num_speculative_tokens`, or the engine's default)
carries `drafts`, tokens its MTP head proposed for the positions after its last known token. A step feeds the
request's known tokens not yet in the cache and then its drafts as one entry, and the model returns the logits of
the last known token and of every draft (`SpecForward`), so one step verifies 1 + d positions (`verify`):
- greedy: drafts are accepted while each equals the target's argmax at the position before it; the next token is
  the target's argmax after the last accepted one (a bonus token when all d are accepted);
- penalties and logit controls (`serve.logit_controls`) apply to each position's row as if the drafts before it
  had been generated, so the target at position k is the one a plain step would have there;
- sampled: the drafts are the head's argmax (a point mass q = one-hot(d)), so draft j is accepted with
  probability p(d_j) under the target's sampling distribution p at its position (temperature, top-k, top-p); at
  the first rejection the token is drawn from p with d_j removed (renormalised); after d acceptances a bonus token
  is drawn from p. That is rejection sampling against q: every emitted token has exactly the target's
  distribution, whatever the drafts.

Rollback. After the step the entry's window and recurrent state include every draft. When all d are accepted that is
the state wanted. Otherwise, where the step's entries were short (at most `ops.deltanet.SHORT` tokens each: a decode
batch verifying drafts, not one carrying a prompt chunk) and their states fit `KEEP_BYTES`, the step kept per-
position material (`StepBatch.kept`: each recurrent layer's state after every position, each window's fed rows), and
the engine sets the slot's windows and recurrent states to those after its last accepted token
(`StateCache.keep_prefix`, the windows' earlier rows from a snapshot taken before the step): the request goes on
from there, as vLLM keeps the state of every verified position. Else the engine restores the slot's window and
recurrent state from the snapshot (`StateCache.snapshot` / `restore`) and puts `num_cached` back, so the request's
next step feeds this step's known tokens and accepted drafts again, then its new token and new drafts: the replay
rides in the next verify step (a batch-1 step is weight-bound, so a few more tokens in it cost little) instead of a
step of its own. Positional state (QSA keys and values, the head's cells) needs nothing: rows past the accepted
length are never read before they are written again (`model.state`). So that a replay stays bounded when drafts keep
failing, a request whose pending known tokens exceed k + 1 gets no drafts for a step (its state is exact again after
it): `draft_count`. Keeping rather than replaying (deep tiny config, batch 1, eager, thread time): a k = 2 step that
accepted one draft had re-fed 3, then 5 tokens and then drafted nothing for a step; "auto" measured k = 2 in such
steps and kept k = 1 (1.49x plain), and now drafts 2 (1.62x).

Proposal (`propose`, after sampling). The head's cell i needs the trunk's residual R_i and the token x_{i+1}. The
step returns every token's residual (valid up to the last accepted position of each entry), so each speculating
request's new cells, from `req.mtp_cells` to the position before its last known token, run through
`model.draft_step` in one batch (prefill chunks too: their next tokens are known). The last cell of a request that
just sampled gives draft 1; draft steps j = 1, 2, ... then feed (R_next, d_j) at the next position, one cell per
request, while the request wants more drafts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from flashnext.model.state import make_step
from flashnext.ops.deltanet import can_keep_positions
from flashnext.serve import grammar
from flashnext.serve.cache import Snapshot, StateCache
from flashnext.serve.logit_controls import LogitControls, reported_logprobs
from flashnext.serve.request import Request
from flashnext.serve.sampling import target_probs
from flashnext.serve.stats import EngineStats

log = logging.getLogger("flashnext.serve")

KEEP_BYTES = 1 << 30  # per-position recurrent states a verify step may keep (entries x positions x state)


@dataclass
class SpecForward:
    """One speculative model step's outputs and what verification and proposal need of it.

    Attributes:
        logits: [R, V] the rows of every entry that reached the end of its known tokens: its last known token's,
            then one per draft.
        residual: [T, hc*D] every fed token's pre-final-mixer residual (the MTP head's input).
        cu: host cu_seqlens of the step's entries.
        cached: per entry, its `num_cached` before the step (its first fed position).
        first_row: per entry, the row of `logits` of its last known token (None: a prompt chunk that samples
            nothing).
        snapshot: window (and, unless `kept`, recurrent) state of the slots that carried drafts, before the step.
        valid: per entry, how many of its fed tokens are committed (known tokens + accepted drafts): the residual
            rows the head may read.
        kept: the step's per-position material (`StepBatch.kept`) when its entries were short, else None (a
            rejection then rolls back to the snapshot and replays).
    """

    logits: torch.Tensor
    residual: torch.Tensor
    cu: list[int]
    cached: list[int]
    first_row: list[int | None]
    snapshot: Snapshot | None
    valid: list[int] = field(default_factory=list)
    kept: list | None = None


@dataclass
class Verdict:
    """A verified entry: the emitted tokens (accepted drafts, then the target's next token), how many drafts
    were accepted, and the emitted tokens' log-probs (None unless requested; `top` a `torch.topk` result with
    one row per emitted token, or None)."""

    tokens: list[int]
    accepted: int
    chosen: list[float] | None = None
    top: object | None = None


class Speculator:
    """Draft proposal, verification and rollback bookkeeping for an engine whose model has an MTP head.

    Args:
        model: a `FlashNextForCausalLM` or `FlashNextForConditionalGeneration` with `mtp` (prepared for serving).
        cache: the engine's `StateCache` (it holds the head's cells after the trunk's layers).
        max_model_len: the engine's longest sequence (drafts never reach past it).
        stats: the engine's `EngineStats` (speculation counters).
    """

    def __init__(self, model, cache: StateCache, max_model_len: int, stats: EngineStats):
        self.model, self.cache, self.max_model_len, self.stats = model, cache, max_model_len, stats
        self.controls = LogitControls(None)  # the engine shares its sampler's (penalties per draft position)
        self.device = next(model.parameters()).device
        self.state_bytes = cache.recurrent_bytes()  # per slot and position: what a kept verify step holds
        self.auto = None  # the engine's `serve.spec_auto.AutoSpec` under num_speculative_tokens="auto"

    # ---- the verify step ------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, step, embeds, plan: list[tuple[Request, int]], cu: list[int], routing=False,
                extra_rows: list[int] | None = None):  # fmt: skip
        """Run the model step over the plan's stream (drafts appended to their entries), keeping what verification
        and proposal need. The slots that carry drafts are snapshotted first (see the module doc). Returns the
        `SpecForward`, with `routing` the stream's routed experts [T, L, k] (else None), and the logits of
        `extra_rows` (stream rows the engine asks for besides: prompt positions to score; None without)."""
        rows, first = [], []
        for i, (req, n) in enumerate(plan):
            if req.num_cached + n == req.num_tokens:  # reaches its last known token: samples (and verifies)
                first.append(len(rows))
                rows.extend(range(cu[i + 1] - 1 - len(req.drafts), cu[i + 1]))
            else:
                first.append(None)
        with_drafts = [req.slot for req, _ in plan if req.drafts]
        lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
        keep = bool(with_drafts) and can_keep_positions(lengths)
        keep = keep and len(plan) * max(lengths) * self.state_bytes <= KEEP_BYTES
        if keep:
            step.kept = []  # the stateful layers keep per-position material: a rejection keeps the accepted prefix
        # kept: the windows' earlier rows only (the recurrent states come from the step: a copy saved of the largest
        # state per slot, 113 MB in the released model's 36 GDN layers); else everything a rollback restores
        snapshot = self.cache.snapshot(with_drafts, windows_only=keep) if with_drafts else None
        rows_t = torch.tensor(rows + list(extra_rows or ()), dtype=torch.long, device=self.device)
        logits, residual, *routed = self.model.forward_step(
            ids, step, self.cache, inputs_embeds=embeds, rows=rows_t, with_residual=True, return_routing=routing
        )
        logits, extra = logits[: len(rows)], (logits[len(rows) :] if extra_rows else None)
        cached = [req.num_cached for req, _ in plan]
        out = SpecForward(logits, residual, cu, cached, first, snapshot, [n for _, n in plan], step.kept)
        return out, (routed[0] if routing else None), extra

    def verify(self, req: Request, out: SpecForward, i: int) -> Verdict | None:
        """Accept entry i's drafts against the target's logits (see the module doc); None when a row is not
        finite (the request fails, as a plain row would)."""
        d = len(req.drafts)
        rows = out.logits[out.first_row[i] : out.first_row[i] + d + 1].float()
        if not bool(torch.isfinite(rows).all()):
            return None
        rows = grammar.mask_verify_rows(req, rows)  # a constrained request: row j under its grammar after j drafts
        # then the logit controls, as the plain step (`Engine`: grammar mask, then `Sampler.sample`)
        raw, rows = rows, self.controls.apply(rows, [req] * (d + 1), [req.drafts[:j] for j in range(d + 1)])
        maxes, argmax = rows.max(-1)
        if req.params.greedy:
            best = argmax.tolist()
            accepted = next((j for j in range(d) if best[j] != req.drafts[j]), d)
            tokens = req.drafts[:accepted] + [best[accepted]]
        else:
            tokens, accepted = self._accept_sampled(rows, maxes, req)
        verdict = Verdict(tokens, accepted)
        if req.params.logprobs is not None:
            src = raw[: len(tokens)]  # raw or processed (the controlled rows), as asked
            lp = reported_logprobs(src, src if rows is raw else rows[: len(tokens)], [req.params] * len(tokens))
            verdict.chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
            if req.params.logprobs:
                verdict.top = torch.topk(lp, req.params.logprobs, dim=-1)
        return verdict

    def commit(self, req: Request, i: int, n: int, verdict: Verdict, out: SpecForward) -> None:
        """Keep entry i's accepted drafts: all of them; some, from the step's per-position material (`out.kept`:
        the slot's windows and recurrent states after its last accepted token); or else roll the slot back to
        before the step (the snapshot; `num_cached` back by the `n` known tokens fed) so that the known tokens and
        the accepted drafts are fed again next step. Counts the verification."""
        d, recomputed = len(req.drafts), 0
        if verdict.accepted < d and out.kept is not None:
            self.cache.keep_prefix(out.snapshot, out.kept, req.slot, i, out.cu[i], n + verdict.accepted)
            req.num_cached += verdict.accepted
        elif verdict.accepted < d:
            self.cache.restore(out.snapshot, [req.slot])
            req.num_cached -= n
            recomputed = n + verdict.accepted
        else:
            req.num_cached += d
        out.valid[i] = n + verdict.accepted
        req.drafts = []
        req.num_drafted += d
        req.num_accepted += verdict.accepted
        req.num_verify_steps += 1
        self.stats.speculation(d, verdict.accepted, recomputed)
        if d and self.auto is not None:
            self.auto.observe(req, d, verdict.accepted)

    def settle(self, req: Request, i: int, n: int, out: SpecForward) -> tuple[Verdict | None, str | None]:
        """Verify entry i's drafts and commit the verdict (`verify`, `commit`): (verdict, None), or (None, why the
        request fails) when verifying raised or its rows are not finite (its problem alone)."""
        try:
            verdict = self.verify(req, out, i)
        except Exception as e:  # this request's problem alone, as a failing sampled row
            log.exception("request %s: verifying its drafts failed", req.request_id)
            return None, f"verifying draft tokens failed: {type(e).__name__}: {e}"
        if verdict is None:
            return None, "the model's logits for this request are not finite (NaN or inf)"
        self.commit(req, i, n, verdict, out)
        return verdict, None

    @staticmethod
    def _accept_sampled(rows: torch.Tensor, maxes: torch.Tensor, req: Request) -> tuple[list[int], int]:
        """Rejection sampling of point-mass drafts: (emitted tokens, drafts accepted)."""
        gen, p = req.generator, req.params
        for j, draft in enumerate(req.drafts):
            probs = target_probs(rows[j], maxes[j], p)
            probs = probs / probs.sum()
            if float(torch.rand((), generator=gen, device=probs.device)) < float(probs[draft]):
                continue
            probs[draft] = 0.0  # rejected: the rest of p, renormalised by multinomial
            return req.drafts[:j] + [int(torch.multinomial(probs, 1, generator=gen))], j
        bonus = target_probs(rows[-1], maxes[-1], p)
        return req.drafts + [int(torch.multinomial(bonus, 1, generator=gen))], len(req.drafts)

    def draft_count(self, req: Request) -> int:
        """Drafts to propose for the request's next step: its k, at most the tokens it may still produce minus
        the one the verify step always gives; none while its replay exceeds k + 1 tokens, nor while its n choices
        wait for its prompt (they fork from the state after the prompt, without drafts)."""
        if req.num_tokens - req.num_cached > req.spec_k + 1 or req.forks:
            return 0
        remaining = min(req.params.max_tokens - len(req.output_ids), self.max_model_len - req.num_tokens)
        k = max(0, min(req.spec_k, remaining - 1))
        if k and self.auto is not None and req.params.num_speculative_tokens is None:  # the engine's "auto"
            k = self.auto.draft_count(req, k)
        elif self.auto is not None and remaining <= 1:  # its last step, without drafts: no cost of auto's k
            self.auto.ending.add(req)
        return k

    # ---- the proposal -----------------------------------------------------------------------------------
    def propose_or_stop(self, cells: list[tuple[Request, int]], out: SpecForward) -> None:
        """`propose`; a failure only turns speculation off for the requests of `cells` (their tokens stay exact:
        drafts are only ever proposals)."""
        try:
            self.propose(cells, out)
        except Exception:
            log.exception("the MTP draft head failed; speculation is off for the requests of this step")
            for req, _ in cells:
                req.spec_k, req.drafts = 0, []

    @torch.inference_mode()
    def propose(self, cells: list[tuple[Request, int]], out: SpecForward) -> None:
        """Feed the head the new cells of every speculating request in `cells` ((request, its entry in the
        step): a forked choice names its parent's entry) and set `drafts` of those that just sampled."""
        todo = []  # (request, first new cell, end of new cells, its first residual row, its cell lo resumed)
        for req, i in cells:
            if req.finished or req.spec_k == 0:
                continue
            start = out.cached[i]
            lo, hi = req.mtp_cells, min(start + out.valid[i], req.num_tokens - 1)
            resumed = lo == start - 1 and req.resume_residual is not None  # a prefix-cache hit's last cell
            if lo < start and not resumed:  # cells missing below this step (the head failed before): poor drafts
                req.spec_k, req.drafts = 0, []
            elif hi > lo:
                todo.append((req, lo, hi, out.cu[i] + lo - start, resumed))
        if not todo:
            return
        cu, rows, next_ids, kept = [0], [], [], []
        for req, lo, hi, r0, resumed in todo:
            if resumed:  # cell lo's residual is not in this step: the one kept with the prefix-cache snapshot
                kept.append((len(rows), req.resume_residual))
                rows.append(0)
                rows.extend(range(r0 + 1, r0 + hi - lo))
            else:
                rows.extend(range(r0, r0 + hi - lo))
            next_ids.extend(req.tokens(lo + 1, hi + 1))
            cu.append(cu[-1] + hi - lo)
        mrope = [t[0].mrope for t in todo]  # an image prompt's cells rotate at their tokens' MRoPE positions
        step = make_step(cu, [t[0].slot for t in todo], [t[1] for t in todo], self.cache.scratch_slot, self.device,
                         mrope)  # fmt: skip
        residual = out.residual.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
        for row, kept_row in kept:
            residual[row] = kept_row
        logits, r_next = self.model.draft_step(residual, self._ids(next_ids), step, self.cache)
        for req, _, hi, _, _ in todo:
            req.mtp_cells, req.resume_residual = hi, None
        want = [self.draft_count(req) if hi == req.num_tokens - 1 else 0 for req, _, hi, _, _ in todo]
        live = [j for j, w in enumerate(want) if w > 0]
        if live:
            last = torch.tensor([cu[j + 1] - 1 for j in live], dtype=torch.long, device=self.device)
            self._draft([todo[j][0] for j in live], [want[j] for j in live], logits[live], r_next[last])

    def _draft(self, reqs: list[Request], want: list[int], logits: torch.Tensor, r_last: torch.Tensor) -> None:
        """Draft 1 from the head's last cells (`logits` [n, V], their R_next `r_last` [n, hc*D]), then chained
        draft steps, one cell per request still wanting more. A constrained request's drafts are the argmax under
        its grammar (`grammar.draft_argmax`), taken back from its matcher at the end."""
        try:
            self._draft_chain(reqs, want, logits, r_last)
        finally:
            grammar.end_drafts(reqs)

    def _draft_chain(self, reqs: list[Request], want: list[int], logits: torch.Tensor, r_last: torch.Tensor):
        drafts = [[tok] for tok in grammar.draft_argmax(reqs, logits)]
        live = list(range(len(reqs)))
        for j in range(1, max(want)):
            keep = [k for k, idx in enumerate(live) if want[idx] > j]
            live = [live[k] for k in keep]
            if not keep:
                break
            sel = torch.tensor(keep, dtype=torch.long, device=self.device)
            r_last = r_last.index_select(0, sel)
            positions = [reqs[idx].num_tokens - 2 + j for idx in live]
            step = make_step(
                list(range(len(live) + 1)), [reqs[idx].slot for idx in live], positions, self.cache.scratch_slot,
                self.device, [reqs[idx].mrope for idx in live],
            )  # fmt: skip
            step_logits, r_last = self.model.draft_step(r_last, self._ids([drafts[idx][-1] for idx in live]), step,
                                                         self.cache)  # fmt: skip
            for idx, tok in zip(live, grammar.draft_argmax([reqs[k] for k in live], step_logits), strict=True):
                drafts[idx].append(tok)
        for req, d in zip(reqs, drafts, strict=True):
            req.drafts = d

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)
