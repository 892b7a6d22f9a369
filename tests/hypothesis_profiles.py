"""The Hypothesis budgets of the property tests and state machines.

`make test` and `make test-fast` run Hypothesis's default profile: 100 examples per property
test (a state machine: 100 runs of up to its `stateful_step_count` steps). Tests that are slow
per example set fewer themselves. `pytest --hypothesis-profile=thorough` gives every test that
sets no budget of its own `THOROUGH_EXAMPLES`, for a longer search before a release or after
changing what the properties cover; a failure found either way is replayed from
`.hypothesis/` on the next run.
"""

from __future__ import annotations

from hypothesis import settings

THOROUGH_EXAMPLES = 300
"""Examples per test under the `thorough` profile: at least the budgets these tests ran in every
`make test` before (200-300 for the block manager's state machines, the n-gram index, the
detokenizer, the KV directory's and prefix index's models and the OpenAI body fuzz)."""


def register() -> None:
    """Register the `thorough` profile (`--hypothesis-profile=thorough` selects it)."""
    settings.register_profile("thorough", max_examples=THOROUGH_EXAMPLES)
