"""Grammar constraints on the engine's logits, through xgrammar: compile, mask, accept, roll back.

Why xgrammar (measured on this box, `benchmarks/RESULTS.md` "Structured outputs"): its per-step mask fill is a few
microseconds at 512 and 32k ids (llguidance: 20-40 us), compiles are milliseconds and cached by content, it has a
native CPU kernel that applies a bitmask to fp32 / bf16 logits in place (llguidance's torch kernel is a
`torch.compile` function, which on a CPU box needs a C++ toolchain and a compile), unlimited `rollback` for
rejected speculative drafts, and a structural tag for the Qwen XML tool dialect (`get_model_structural_tag
("qwen_3_5")`), the model's own tool-call format. It is an optional dependency (`pip install 'flashnext[grammar]'`):
without it a constrained request is refused with a 400 naming the field.

Parts:
- `Grammars` (one per engine): the tokenizer's vocabulary for xgrammar (built on first use), a small thread pool
  that compiles grammars off the engine thread, a cache of compiles by content (`Compiled`), and a time limit;
  `compile` is called where a request is built (the HTTP handler's worker thread), so a request waits for its own
  grammar while the engine keeps stepping the others.
- `Constraint` (one per choice): a matcher over the compiled grammar; `fill` writes the allowed-token bitmask row,
  `accept` advances, `rollback` takes tokens back (speculative verification and draft proposal).
- `apply_bitmask` (xgrammar's kernel) and its reference twin `apply_bitmask_ref` (plain torch: unpack the bits,
  `masked_fill`); `tests/serve/test_structured_outputs.py` holds them together.

Bitmask legend: int32 [rows, ceil(V / 32)], bit j of word w allows token 32 w + j (1 = allowed; all ones = row
untouched).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from flashnext.serve.sampling import FieldError, drop_maxima

COMPILE_TIMEOUT_S = 30.0
"""Longest a request waits for its grammar to compile; past it the request is refused (400)."""
CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
THINK_END = "</think>"
THINK_EXCLUDES = ["<think>", "</think>"]
REASONING_SUFFIX = "\n\n"  # the chat template's `</think>\n\n` before the answer
QWEN_XML = "qwen_3_5"  # xgrammar's builtin structural tag of the Qwen3-Coder XML tool dialect

try:
    import xgrammar as xgr
except ImportError:  # optional: structured outputs need it
    xgr = None


def available() -> bool:
    return xgr is not None


def require(field: str) -> None:
    """`FieldError` naming `field` when xgrammar is not installed."""
    if xgr is None:
        raise FieldError(
            f"{field}: structured outputs need the grammar library xgrammar (pip install 'flashnext[grammar]')", field
        )


class Grammars:
    """Compiles constraints for one engine's tokenizer and vocabulary (see the module doc).

    Args:
        tokenizer: the engine's `flashnext.tokenizer.Tokenizer` (a byte-level BPE).
        vocab_size: the model's logits width (ids past the tokenizer's are never allowed).
        eos_id: the stop token of a finished grammar (a request's `stop_token_ids` are added per matcher).
        threads: compile workers.
        timeout_s: how long `compile` waits.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_id: int | None, threads: int = 2,
                 timeout_s: float = COMPILE_TIMEOUT_S):  # fmt: skip
        self.tokenizer, self.vocab_size, self.eos_id, self.timeout_s = tokenizer, vocab_size, eos_id, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flashnext-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._compiler = None
        self.compile_seconds: list[float] = []  # wall time of each compile that ran (not cache hits)

    def compiler(self):
        """xgrammar's compiler over this vocabulary (built once, on the first structured request)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tokenizer, self.vocab_size, self.eos_id),
                                                     max_threads=1, cache_enabled=False)  # fmt: skip
            return self._compiler

    def compile(self, fmt: dict, field: str):
        """The compiled structural tag `fmt` (a structural-tag format dict, `serve.structured.grammar_format`),
        from the cache or compiled in the pool; `FieldError` naming `field` when it does not compile or takes
        longer than `timeout_s`."""
        require(field)
        key = json.dumps(fmt)  # not sorted: a schema's property order is the order the output follows
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._cache[key] = self._pool.submit(self._compile, key)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise FieldError(f"{field}: the grammar did not compile within {self.timeout_s:g} s", field) from None
        except Exception as e:
            with self._lock:
                if self._cache.get(key) is fut:  # not kept: a later identical request tries again
                    del self._cache[key]
            raise FieldError(f"{field}: the grammar library cannot compile it: {_reason(e)}", field) from None

    def _compile(self, key: str):
        import time

        t0 = time.perf_counter()
        compiled = self.compiler().compile_structural_tag(json.dumps({"type": "structural_tag", "format":
                                                                      json.loads(key)}))  # fmt: skip
        self.compile_seconds.append(time.perf_counter() - t0)
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def tokenizer_info(tokenizer, vocab_size: int, eos_id: int | None):
    """xgrammar's view of a `flashnext.tokenizer.Tokenizer`: every id's token string (added tokens included), the
    vocabulary's encoding (byte-level, read from the tokenizer's JSON), `vocab_size` ids in all."""
    backend = tokenizer.backend
    vocab = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            vocab[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(vocab, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=[eos_id] if eos_id is not None else None,
                             add_prefix_space=meta["add_prefix_space"])  # fmt: skip


class Constraint:
    """One choice's grammar state: a matcher over `compiled` that ends on `stop_ids` (EOS and the request's stop
    token ids). Tokens are accepted as the request emits them; speculative proposal and verification accept
    drafts tentatively and `rollback` them."""

    def __init__(self, compiled, stop_ids: list[int]):
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_ids)) or None)
        self.stops = frozenset(self.matcher.stop_token_ids)
        self.ended = False  # a stop token was accepted (mirrors `is_terminated` without a call per token)
        self.tentative = 0  # drafts accepted while proposing (taken back by `end_drafts`)
        self.dead = False  # a proposed draft broke the grammar: later drafts of this proposal are not masked

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (all ones once the grammar has ended)."""
        if self.ended:
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) if the grammar does not allow it."""
        if self.ended or not self.matcher.accept_token(token):
            return False
        self.ended = token in self.stops  # the matcher ends exactly when it accepts a stop token
        return True

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            self.ended = False  # a stop token is always the last accepted: taking any token back reopens

    @property
    def done(self) -> bool:
        return self.ended


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-ones (nothing masked) bitmask int32 [rows, ceil(vocab_size / 32)]."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set `logits[r, t]` to -inf for every token t that row r of `bitmask` forbids, for each r in `rows` (the other
    rows are not touched); in place, xgrammar's CPU kernel (fp32, bf16, fp16). logits [n, V], bitmask [n, W]."""
    if logits.device.type != "cpu" or not logits.is_contiguous():
        apply_bitmask_ref(logits, bitmask, rows)
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The reference of `apply_bitmask`: unpack the bits of each listed row and `masked_fill` -inf."""
    V = logits.shape[-1]
    for r in rows:
        words = bitmask[r].to(torch.int64)
        allowed = ((words[:, None] >> _BITS.to(torch.int64)) & 1).bool().reshape(-1)[:V]
        logits[r].masked_fill_(~allowed.to(logits.device), float("-inf"))


# ---- the engine's hooks (each called from one line of the engine, sampler or speculator) ----------------------
def mask_rows(logits: torch.Tensor, reqs) -> torch.Tensor:
    """Row i of `logits` [n, V] masked in place by `reqs[i]`'s grammar, for the constrained requests only (the
    other rows are not touched); returns `logits`."""
    rows = [i for i, r in enumerate(reqs) if r.constraint is not None]
    if not rows:
        return logits
    bitmask = allocate(logits.shape[0], logits.shape[-1])
    for i in rows:
        reqs[i].constraint.fill(bitmask, i)
    drop_maxima(logits)  # the rows' maxima it may carry are the unmasked ones
    with torch.inference_mode():  # the model's logits are inference tensors
        logits = logits.contiguous()
        apply_bitmask(logits, bitmask, rows)
    return logits


def accept_emitted(req, tokens: list[int]) -> str | None:
    """Advance `req`'s grammar by its emitted tokens; why it failed (a token the grammar forbids), or None."""
    c = req.constraint
    if c is None:
        return None
    for tok in tokens:
        if c.done:  # ended by a stop token: the request stops with it
            return None
        if not c.accept(tok):
            return f"token {tok} breaks the request's grammar (structured output)"
    return None


def mask_verify_rows(req, rows: torch.Tensor) -> torch.Tensor:
    """The verify rows [d + 1, V] of a speculating request, masked in place: row j by the grammar after the
    request's drafts 0 .. j-1 (accepted tentatively, then rolled back). A draft the grammar forbids is
    rejected by its own masked row, so the rows after it are left unmasked: they are never read."""
    c = req.constraint
    if c is None:
        return rows
    bitmask = allocate(rows.shape[0], rows.shape[-1])
    c.fill(bitmask, 0)
    taken = 0
    try:
        for j, tok in enumerate(req.drafts):
            if not c.accept(tok):
                break
            taken += 1
            c.fill(bitmask, j + 1)
    finally:
        c.rollback(taken)
    with torch.inference_mode():
        rows = rows.contiguous()
        apply_bitmask(rows, bitmask, list(range(taken + 1)))
    return rows


def draft_argmax(reqs, logits: torch.Tensor) -> list[int]:
    """Each request's next draft: the argmax of its row of the MTP head's `logits` [n, V], masked by its grammar
    after the drafts proposed so far (accepted tentatively; `end_drafts` takes them back)."""
    rows = [i for i, r in enumerate(reqs) if r.constraint is not None and not r.constraint.dead]
    if rows:
        logits = logits.clone().contiguous()
        bitmask = allocate(logits.shape[0], logits.shape[-1])
        for i in rows:
            reqs[i].constraint.fill(bitmask, i)
        apply_bitmask(logits, bitmask, rows)
    picks = logits.argmax(-1).tolist()
    for i in rows:
        c = reqs[i].constraint
        if c.accept(picks[i]):
            c.tentative += 1
        else:
            c.dead = True
    return picks


def end_drafts(reqs) -> None:
    """Take back the drafts `draft_argmax` accepted tentatively."""
    for r in reqs:
        c = r.constraint
        if c is not None:
            c.rollback(c.tentative)
            c.tentative, c.dead = 0, False
