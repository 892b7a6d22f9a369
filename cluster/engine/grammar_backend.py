"""Grammars compiled against the model's vocabulary, and one matcher per constrained branch.

`GrammarCompilerCache` turns a `ConstraintSpec` into an xgrammar `CompiledGrammar` once: the
cache is keyed by the exact constraint and the tokenizer's digest (one cache per engine, one
tokenizer per engine, so the digest is part of every key by construction), bounded by entries
(least recently used goes first). It is thread-safe: the async engine compiles in a worker
thread so that a compile never holds up the step loop, then admits the request, whose lookup is
a hit. The vocabulary tables xgrammar needs are built on the first constrained request, so an
engine that never sees one pays nothing.

`BranchGrammar` is a branch's matcher. It lives beside the branch's tokens in the engine (not on
a worker), advanced by every token the branch keeps, so preemption by recompute or swap, which
keep a branch's output tokens, keep it valid; `sync` replays it from the output tokens should
they ever differ from what it accepted. Speculative drafts are checked against it and rolled
back (`valid_drafts`), and each position a step samples gets the mask of the state after the
drafts before it (`bitmasks`), so a kept draft run is always one the grammar accepts.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.engine.cycle_guard import HISTORY, cut_cycles
from cluster.engine.structured_outputs import ConstraintError, ConstraintSpec, parse_grammar


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one vocabulary; makes the matchers of its branches."""

    spec: ConstraintSpec
    compiled: Any
    """The xgrammar `CompiledGrammar`."""

    def new_matcher(self) -> BranchGrammar:
        import xgrammar as xgr

        return BranchGrammar(xgr.GrammarMatcher(self.compiled), self.compiled.tokenizer_info)


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0


class GrammarCompilerCache:
    """Compiles constraints for one tokenizer, each once (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        tokenizer_digest: str,
        *,
        max_entries: int = 256,
        max_threads: int = 2,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.tokenizer_digest = tokenizer_digest
        self.max_entries = max_entries
        self._max_threads = max_threads
        self._compiler: Any | None = None
        self._entries: OrderedDict[tuple[str, ConstraintSpec], CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def cached(self, spec: ConstraintSpec) -> CompiledConstraint | None:
        with self._lock:
            entry = self._entries.get((self.tokenizer_digest, spec))
            if entry is not None:
                self._entries.move_to_end((self.tokenizer_digest, spec))
            return entry

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """The compiled constraint, from the cache or compiled now (in the calling thread).
        Raises ConstraintError naming the field when it does not compile."""
        entry = self.cached(spec)
        if entry is not None:
            with self._lock:
                self.stats.hits += 1
            return entry
        grammar = parse_grammar(spec)
        began = time.perf_counter()
        try:
            compiled = self._get_compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError) as error:
            raise ConstraintError(spec.kind, str(error).splitlines()[0]) from None
        entry = CompiledConstraint(spec, compiled)
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds += time.perf_counter() - began
            key = (self.tokenizer_digest, spec)
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return entry

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids,
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_enabled=False
                )
            return self._compiler


class BranchGrammar:
    """One branch's matcher: masks for its next positions, and the tokens it accepted.

    Invariant: `num_accepted` equals the number of output tokens the branch kept (see `sync`);
    `_recent` holds the last of them, for the guard against endless cycles (`cycle_guard`).
    """

    def __init__(self, matcher: Any, tokenizer_info: Any) -> None:
        self._matcher = matcher
        self._words = -(-tokenizer_info.vocab_size // 32)
        self.num_accepted = 0
        self._recent: list[int] = []

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the branch ends."""
        return bool(self._matcher.is_terminated())

    def accept(self, token_id: int) -> bool:
        """Advances by one kept token; False (state unchanged) when the grammar forbids it."""
        if not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        self._recent.append(token_id)
        if len(self._recent) > 2 * HISTORY:
            del self._recent[:HISTORY]
        return True

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Makes the matcher's state that of `output_token_ids` (a replay from the start when it
        accepted a different number of tokens)."""
        if self.num_accepted == len(output_token_ids):
            return
        self._matcher.reset()
        self.num_accepted = 0
        self._recent.clear()
        for token in output_token_ids:
            if not self.accept(token):
                raise RuntimeError(f"the grammar refuses token {token} of the branch's output")

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading `drafts` the grammar accepts from the current state (unchanged)."""
        accepted = 0
        for token in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def bitmasks(self, drafts: Sequence[int] = ()) -> torch.Tensor:
        """`[1 + len(drafts), ceil(vocab / 32)]` int32 token bitmasks (bit set: allowed): row i
        is the state after the first i drafts, which the grammar must accept (`valid_drafts`),
        less the token that would continue an endless cycle (`cycle_guard.cut_cycles`)."""
        masks = torch.full((1 + len(drafts), self._words), -1, dtype=torch.int32)
        self._fill(masks, 0)
        for row, token in enumerate(drafts, start=1):
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                if row > 1:
                    self._matcher.rollback(row - 1)
                raise RuntimeError(f"draft token {token} is not accepted by the grammar")
            self._fill(masks, row)
        if drafts:
            self._matcher.rollback(len(drafts))
        cut_cycles(masks, self._recent, drafts)
        return masks

    def _fill(self, masks: torch.Tensor, row: int) -> None:
        """Row `row` is what may follow the current state; once the stop token was accepted
        (a draft that ends the branch) nothing follows, and the row stays all-allowed: the
        branch ends at that draft, so no token is ever sampled from it."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(masks, row)
