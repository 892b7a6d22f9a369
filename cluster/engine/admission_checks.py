"""The checks a rendered request passes before the engine queues it.

Two kinds of refusal, kept apart because clients answer them differently:
- `check_queue`: EngineOverloaded (retry later) when the waiting queue is at its bound (its
  Retry-After: when the measured drain rate, `QueueWait`, predicts a place in it frees, 1 s while
  there is no rate), or when requests already wait and a new one would wait longer than
  `max_queue_wait_s` by that rate; its Retry-After is then how much longer, i.e. when the queue
  will have drained enough to start it in time.
- `check_fits`: RequestRejected (never servable as asked) when the prompt leaves no room to
  generate, `n` exceeds the running-sequence bound or the layout cannot fork, or the prompt's
  blocks exceed what the device pool can ever give.
Both only read their arguments: no state changes, so a refused request leaves no trace.
"""

from __future__ import annotations

from block_manager import KVManager
from cluster.engine.config import SchedulerSettings
from cluster.engine.errors import EngineOverloaded, RequestRejected
from cluster.engine.queue_wait import QueueWait
from cluster.engine.sampling_params import SamplingParams
from kv_layouts import KVLayout


def check_queue(
    num_waiting: int,
    settings: SchedulerSettings,
    queue_wait: QueueWait,
    num_ahead: int | None = None,
) -> None:
    """EngineOverloaded when a new request should not join `num_waiting` queued ones, of which
    `num_ahead` would start before it (None: all; fewer under priority scheduling, so a request
    that passes the queue is not refused for a wait it will not have)."""
    if num_waiting >= settings.max_waiting_requests:
        room = queue_wait.predict(num_waiting - settings.max_waiting_requests)
        raise EngineOverloaded(
            f"{num_waiting} requests are waiting "
            f"(scheduler.max_waiting_requests = {settings.max_waiting_requests})",
            retry_after_s=1.0 if room is None else room,
        )
    limit = settings.max_queue_wait_s
    ahead = num_waiting if num_ahead is None else num_ahead
    if limit is None or ahead == 0:
        return
    predicted = queue_wait.predict(ahead)
    if predicted is not None and predicted > limit:
        raise EngineOverloaded(
            f"{ahead} requests are waiting ahead of it; a new one would start in about "
            f"{predicted:.0f} s (scheduler.max_queue_wait_s = {limit:g})",
            retry_after_s=predicted - limit,
        )


def check_fits(
    ids: list[int],
    params: SamplingParams,
    *,
    max_model_len: int,
    settings: SchedulerSettings,
    block_size: int,
    block_manager: KVManager,
    layout: KVLayout,
    vocab_size: int,
) -> None:
    """RequestRejected when the prompt and its `n` branches can never be served here, or a
    token id its parameters name is outside the vocabulary."""
    for name, tokens in (
        ("logit_bias", params.logit_bias or {}),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        outside = sorted(t for t in tokens if t >= vocab_size)
        if outside:
            raise RequestRejected(
                f"{name} names token id {outside[0]}, outside the vocabulary [0, {vocab_size})"
            )
    if len(ids) >= max_model_len:
        raise RequestRejected(
            f"the prompt has {len(ids)} tokens; the model's context is {max_model_len} "
            "tokens and at least one must be left to generate"
        )
    if params.n > settings.max_num_seqs:
        raise RequestRejected(
            f"n={params.n} branches exceed scheduler.max_num_seqs ({settings.max_num_seqs})"
        )
    if params.n > 1 and not layout.can_fork:
        raise RequestRejected(
            f"n={params.n}: cache.kv_layout {layout.name!r} gives every sequence "
            "its own range and cannot fork one; parallel sampling needs the 'paged' layout"
        )
    needed = -(-len(ids) // block_size) + params.n
    usable = block_manager.num_device_blocks - block_manager.watermark_blocks
    if needed > usable:
        raise RequestRejected(
            f"the prompt needs {needed} KV blocks ({len(ids)} tokens in blocks of {block_size}"
            f" plus one per branch, n={params.n}) but the device pool has {usable} to give "
            f"({block_manager.num_device_blocks} minus a watermark of "
            f"{block_manager.watermark_blocks})"
        )
