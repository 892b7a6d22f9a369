"""Reading an executed step's output back into the block tables: what `Scheduler.on_step_done`
does after the plan ran, beside the scheduling it planned.

`take_samples` walks the step's works in plan order. For each it marks the KV the plan
computed (for a speculative work, only up to the last accepted draft: the block manager drops
the rest), forks a parallel request's branches after its prompt's last chunk, writes a token a
step planned ahead holds a placeholder for (`cluster.engine.lookahead.Placeholders`), and
returns every sampled token with its branch, in order, for the engine to append.

Invariants: a work whose branch ended while the step ran (a stop string found late, an abort,
EOS sampled by the step before a step planned ahead) or whose request left the device meanwhile
(a refused step before it) has its blocks freed already: it touches no table and gives nothing.
A work that samples gets exactly `num_samples + len(drafts)` tokens from the output, or the
output is malformed and RuntimeError names the sequence; nothing else raises.
"""

from __future__ import annotations

from block_manager import KVManager
from cluster.engine.lookahead import Placeholders
from cluster.engine.request import Branch, Request, RequestStatus
from cluster.engine.scheduler_step import ScheduledWork, SchedulerStep
from cluster.engine.speculation import NgramSpeculator
from workers.plan import SampledToken, StepOutput


def take_samples(
    step: SchedulerStep,
    output: StepOutput,
    bm: KVManager,
    placeholders: Placeholders,
    speculator: NgramSpeculator | None,
) -> list[tuple[Request, Branch, SampledToken]]:
    """Every token the step sampled, with its request and branch, its KV marked computed (see
    the module doc)."""
    sampled: list[tuple[Request, Branch, SampledToken]] = []
    samples = output.samples
    prompt_logprobs = output.prompt_logprobs
    mark_computed = bm.mark_computed
    fill = placeholders.fill if placeholders else None
    running = RequestStatus.RUNNING
    for work in step.works:
        branch, request = work.branch, work.request
        if branch.finish_reason is not None or request.status is not running:
            continue  # ended, or left the device, while the step ran
        seq_id = branch.seq_id
        if prompt_logprobs and seq_id in prompt_logprobs:
            request.record_prompt_logprobs(work.start + 1, prompt_logprobs[seq_id])
        tokens = samples.get(seq_id)
        num_samples, drafts = work.num_samples, work.drafts
        if num_samples and (tokens is None or len(tokens) != num_samples + len(drafts)):
            raise RuntimeError(
                f"step {step.plan.step_id}: sequence {seq_id} expected "
                f"{num_samples + len(drafts)} sampled tokens, got {tokens!r}"
            )
        if drafts:
            assert tokens is not None and speculator is not None
            tokens = _keep_accepted(bm, speculator, work, tokens)
        else:
            mark_computed(seq_id, work.start + work.num_tokens)
        if num_samples == 0:
            continue
        assert tokens is not None
        if fill is not None:
            fill(seq_id, work.start + work.num_tokens, tokens[-1])
        if drafts:  # one branch, several tokens in order
            sampled.extend((request, branch, t) for t in tokens)
            continue
        if request.forked:  # a decode: one branch, one token
            sampled.append((request, branch, tokens[0]))
            continue
        _fork(bm, request)
        branches = request.branches
        sampled.extend((request, b, t) for b, t in zip(branches, tokens, strict=True))
    return sampled


def _keep_accepted(
    bm: KVManager, speculator: NgramSpeculator, work: ScheduledWork, tokens: list[SampledToken]
) -> list[SampledToken]:
    """A speculative work's rows drew `tokens` (one per row): the ones up to and including
    the first that differs from its draft (see `NgramSpeculator.keep_accepted`)."""
    drawn = [token.token_id for token in tokens]
    kept = speculator.keep_accepted(bm, work.branch.seq_id, work.start, work.drafts, drawn)
    return tokens[:kept]


def _fork(bm: KVManager, request: Request) -> None:
    """The request's prompt is computed: every other branch shares branch 0's blocks."""
    parent = request.branches[0]
    for child in request.branches[1:]:
        bm.fork(parent.seq_id, child.seq_id)
        child.token_ids = list(request.prompt_token_ids)
    request.forked = True
