"""`DictBounds`: a `kv_layouts.SequenceBounds` the tests fill by hand (seq id -> most tokens),
standing in for the engine's requests."""

from __future__ import annotations


class DictBounds(dict[int, int]):
    def max_tokens(self, seq_id: int) -> int | None:
        return self.get(seq_id)
