"""One map from errors to answers: each kind gets its HTTP status and OpenAI body and its gRPC
code from the same row, subclasses before their bases, and an error no row names (a ValueError,
say) is never passed off as the client's fault."""

from __future__ import annotations

import grpc
import pytest

from cluster.engine.errors import (
    AdapterNotFound,
    EngineDead,
    EngineOverloaded,
    InvalidAdapter,
    RequestFailed,
    RequestRejected,
)
from cluster.serving.drain import ServerDraining
from cluster.serving.error_map import ANSWERED, grpc_abort, http_error
from cluster.serving.frontend import ContextOverflow
from cluster.serving.tenancy import Forbidden, Unauthenticated

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "status", "code", "body_code"),
    [
        (Unauthenticated("no key"), 401, S.UNAUTHENTICATED, "invalid_api_key"),
        (Forbidden("not admin"), 403, S.PERMISSION_DENIED, "forbidden"),
        (AdapterNotFound("no sql"), 404, S.NOT_FOUND, "model_not_found"),
        (ContextOverflow("too long"), 400, S.INVALID_ARGUMENT, "context_length_exceeded"),
        (InvalidAdapter("bad rank"), 400, S.INVALID_ARGUMENT, None),
        (RequestRejected("bad id"), 400, S.INVALID_ARGUMENT, None),
        (EngineOverloaded("full", retry_after_s=2.5), 503, S.RESOURCE_EXHAUSTED, "engine_overloaded"),  # noqa: E501
        (ServerDraining("draining"), 503, S.RESOURCE_EXHAUSTED, "engine_overloaded"),
        (RequestFailed("step failed"), 503, S.UNAVAILABLE, "engine_unavailable"),
        (EngineDead("stopped"), 503, S.UNAVAILABLE, "engine_unavailable"),
        (EngineDead("replaced", retry_after_s=13.2), 503, S.UNAVAILABLE, "engine_unavailable"),
    ],
)  # fmt: skip
def test_each_kind_is_answered_alike_over_http_and_grpc(
    error: Exception, status: int, code: grpc.StatusCode, body_code: str | None
) -> None:
    assert isinstance(error, ANSWERED)
    http = http_error(error, param="prompt")
    assert (http.status, http.code, http.message) == (status, body_code, str(error))
    assert http.param == {400: "prompt", 404: "model"}.get(status)
    abort = grpc_abort(error)
    assert abort.code == code and str(error) in abort.details
    if status == 503:  # every 503 has its retry hint, whole seconds and at least one
        wait = error.retry_after_s  # type: ignore[attr-defined]
        assert http.headers == {"Retry-After": str(max(1, -int(-wait // 1)))}
        assert f"retry after {wait:g} s" in abort.details
    else:
        assert not http.headers


def test_an_error_no_row_names_is_not_a_clients_answer() -> None:
    assert not isinstance(ValueError("a bug"), ANSWERED)
    with pytest.raises(TypeError, match="ValueError"):
        http_error(ValueError("a bug"))
    with pytest.raises(TypeError, match="ValueError"):
        grpc_abort(ValueError("a bug"))


@pytest.mark.parametrize("error", [EngineDead("gone", retry_after_s=3.0), RequestFailed("x")])
def test_a_dead_engine_keeps_its_class_and_retry_hint_across_processes(error: EngineDead) -> None:
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.retry_after_s == error.retry_after_s
