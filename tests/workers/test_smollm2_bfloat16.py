"""SmolLM2-135M-Instruct in bfloat16 against HF transformers in float32: what the fast mode trades.

bfloat16 keeps 8 mantissa bits, so its logits differ from float32's by far more than the 2e-3 the
float32 parity test allows; the bound it keeps is on decisions. Teacher-forced on HF's own greedy
path (every step feeds HF's previous token, so one early flip cannot cascade), our greedy token
must equal HF's at every step, except at steps where HF's top-2 logit margin is below
`BFLOAT16_NEAR_TIE` (a near tie that float32 itself only barely decides); at every step our
logits move that margin by less than that bound, and by less than `BFLOAT16_TYPICAL_MOVE` at
the median step (`tests.workers.paged_runner`). Ten prompts, 24 steps each.

Run four times: in groups of at most `Q4_MAX_ROWS[bfloat16]` through the whole native decoder
stack (every product on the 4-bit copy of the Q4_1 weights, exact in float32, where the CPU
kernel runs; `workers.decoder_stack`); all ten prompts decoding together (10 rows per step: the
packed bfloat16 weights, one operator at a time); groups of `Q4_MAX_ROWS[bfloat16]` with the
stack off (decode-sized calls on the 4-bit copy, one operator at a time;
`workers.dense_matmul`); and groups of `Q8_MAX_ROWS` through the stack, where the LM head
multiplies the 8-bit copy of its Q8_0 weights (`pagedserve_kernels.q8_cpu`).

The stack's own check: its decode steps give the per-operator path's logits bit for bit, and
steps it does not take (prefills, more decodes than it takes) keep that path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from pagedserve_kernels import decoder_stack_cpu, q4_cpu, q8_cpu
from tests.kernels.cpu_features import needs_vector_kernels
from tests.workers.conftest import SMOLLM2_CHATS, SMOLLM2_NEW_TOKENS, ChatReferences
from tests.workers.paged_runner import (
    TeacherForced,
    fast_mode_flips,
    greedy_generate,
    teacher_forced,
)
from workers import (
    WorkerConfig,
    WorkerGroup,
)
from workers.decoder_stack import NativeDecode
from workers.dense_matmul import Q4_MAX_ROWS, DenseMatmul
from workers.layers import Q8_MAX_ROWS

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def bf16_group() -> Iterator[WorkerGroup]:
    group = WorkerGroup(
        WorkerConfig(
            model="default",
            dtype="bfloat16",
            backend="local",
            block_size=16,
            num_device_blocks=128,
        )
    )
    yield group
    group.shutdown()


@contextlib.contextmanager
def native_decode(group: WorkerGroup, decode: NativeDecode | None) -> Iterator[None]:
    """The in-process model with `decode` as its native decoder stack (None: off) meanwhile."""
    model = group._local.model
    saved = model.native_decode
    model.native_decode = decode
    try:
        yield
    finally:
        model.native_decode = saved


@pytest.mark.parametrize(
    ("group_size", "stack"),
    [
        (Q4_MAX_ROWS[torch.bfloat16], True),
        (len(SMOLLM2_CHATS), False),
        (Q4_MAX_ROWS[torch.bfloat16], False),
        (Q8_MAX_ROWS, True),
    ],
    ids=["stack", "packed", "decode_rows", "q8_head"],
)
def test_bfloat16_greedy_matches_hf_float32_except_near_ties(
    bf16_group: WorkerGroup,
    smollm2_chat_references: ChatReferences,
    group_size: int,
    stack: bool,
) -> None:
    model = bf16_group._local.model
    assert (model.native_decode is not None) == decoder_stack_cpu.available()
    assert (model.lm_head.q8 is not None) == q8_cpu.available()  # the head is exactly Q8_0
    with native_decode(bf16_group, model.native_decode if stack else None):
        greedy_matches_hf_except_near_ties(bf16_group, smollm2_chat_references, group_size)


def greedy_matches_hf_except_near_ties(
    bf16_group: WorkerGroup, chats: ChatReferences, group_size: int
) -> None:
    matmuls = [m for m in bf16_group._local.model.modules() if hasattr(m, "matmul")]
    assert matmuls and all(isinstance(m.matmul, DenseMatmul) for m in matmuls)
    # every linear layer of the Q4_1 file keeps its 4-bit copy wherever the kernel runs
    assert all((m.matmul.q4 is not None) == q4_cpu.available() for m in matmuls)
    prompts, references = chats.prompts, chats.references
    forced = [tokens for tokens, _ in references]
    ours = TeacherForced()
    for start in range(0, len(prompts), group_size):
        stop = start + group_size
        ours += teacher_forced(bf16_group, prompts[start:stop], forced[start:stop])
    flips = fast_mode_flips(references, ours)
    # Near ties are rare: most steps must agree outright.
    assert len(flips) <= len(prompts) * SMOLLM2_NEW_TOKENS // 10, flips


@needs_vector_kernels  # a CPU with AVX2 and FMA runs the stack: a missing build fails
@pytest.mark.parametrize("prompts", [1, 3, 8])
def test_decode_steps_through_the_stack_equal_the_per_operator_path_bit_for_bit(
    bf16_group: WorkerGroup, monkeypatch: pytest.MonkeyPatch, prompts: int
) -> None:
    """Up to `Q4_MAX_ROWS` rows, where the per-operator path also multiplies on the 4-bit copy:
    the same logits bit for bit; every decode step, and no prefill, went through the stack."""
    decode = bf16_group._local.model.native_decode
    assert decode is not None
    calls: list[int] = []
    run = decode.stack.run
    monkeypatch.setattr(decode.stack, "run", lambda *a: calls.append(a[0].shape[0]) or run(*a))
    ids = [[100 + 7 * i + j for j in range(5 + 9 * i)] for i in range(prompts)]
    stacked = greedy_generate(bf16_group, ids, 12, seed=prompts)
    assert calls == [prompts] * 11  # the prefill step samples the first token
    with native_decode(bf16_group, None):
        per_operator = greedy_generate(bf16_group, ids, 12, seed=prompts)
    assert stacked.tokens == per_operator.tokens
    for ours, theirs in zip(stacked.logits, per_operator.logits, strict=True):
        assert torch.equal(ours, theirs)


@needs_vector_kernels  # a CPU with AVX2 and FMA runs the stack: a missing build fails
def test_steps_with_more_decodes_than_the_stack_takes_keep_the_per_operator_path(
    bf16_group: WorkerGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = bf16_group._local.model.native_decode
    assert decode is not None
    narrow = NativeDecode(decode.stack, max_rows=2)
    monkeypatch.setattr(decode.stack, "run", lambda *a: pytest.fail("3 decodes > max_rows 2"))
    ids = [[200 + i, 300 + i, 400 + i] for i in range(3)]
    with native_decode(bf16_group, narrow):
        narrowed = greedy_generate(bf16_group, ids, 6)
    with native_decode(bf16_group, None):
        per_operator = greedy_generate(bf16_group, ids, 6)
    for ours, theirs in zip(narrowed.logits, per_operator.logits, strict=True):
        assert torch.equal(ours, theirs)
