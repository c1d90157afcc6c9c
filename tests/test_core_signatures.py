"""The methods whose arguments the core binds by hand (rust/src/python/signature.rs) look and
answer like any PyO3 method: the signature Python shows, and CPython's words for a call of the
wrong shape, a value of the wrong type, or a keyword it does not take."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from llmflow import InvalidArgumentError
from llmflow._core import Governor, Relay, Runtime

CONFIG: dict[str, Any] = {
    "backends": [{"name": "b0", "gpus": 1, "kv_blocks": 1000}],
    "max_concurrency_per_gpu": 2,
    "max_waiting": 4,
    "tiers": [{"name": "t"}],
    "tenants": [{"name": "a", "tier": "t"}],
}
METRICS = "*, kv_usage=None, running=None, waiting=None, preemptions_total=None, kv_blocks=None"


def runtime() -> Runtime:
    return Runtime({"policy": CONFIG, "lifecycle": {}})


@pytest.mark.parametrize(
    ("method", "shown"),
    [
        (Runtime.arrive, "(self, /, request_id, tenant, prompt_tokens, max_tokens, stream, now_us, "
                         "*, model=None, prefix_hashes=None, fingerprint=0, retries=None, "
                         "deadline_ms=None)"),
        (Runtime.refusal, "(self, /, tenant, prompt_tokens, max_tokens, now_us, *, model=None, "
                          "fingerprint=0, retries=None, deadline_ms=None)"),
        (Runtime.scrape_ok, f"(self, /, backend, began_us, now_us, {METRICS})"),
        (Governor.submit, "(self, /, request_id, tenant, prompt_tokens, max_tokens, now_us, *, "
                          "model=None, prefix_hashes=None)"),
        (Governor.observe_backend, f"(self, /, backend, now_us, {METRICS})"),
    ],
)
def test_signature_as_python_shows_it(method: Any, shown: str) -> None:
    assert str(inspect.signature(method)) == shown


def test_relay_signature_names_its_defaults() -> None:
    assert str(inspect.signature(Relay)).endswith("max_event_bytes=16777216)")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: r.arrive(1, "a", 10, 10, True, 0, None),
         "Runtime.arrive() takes 6 positional arguments but 7 were given"),
        (lambda r: r.arrive(1, "a", 10),
         "Runtime.arrive() missing 3 required positional arguments: 'max_tokens', 'stream', "
         "and 'now_us'"),
        (lambda r: r.arrive(1, "a", 10, 10, True),
         "Runtime.arrive() missing 1 required positional argument: 'now_us'"),
        (lambda r: r.arrive(1, "a", 10, 10, True, 0, tenant="a"),
         "Runtime.arrive() got multiple values for argument 'tenant'"),
        (lambda r: r.arrive(1, "a", 10, foo=1),
         "Runtime.arrive() got an unexpected keyword argument 'foo'"),
        (lambda r: r.arrive(1, 7, 10, 10, True, 0),
         "argument 'tenant': 'int' object is not an instance of 'str'"),
        (lambda r: r.arrive(1, "a", 10.0, 10, True, 0),
         "argument 'prompt_tokens': 'float' object cannot be interpreted as an integer"),
        (lambda r: r.arrive(1, "a", 10, 10, True, 0, model=3),
         "argument 'model': 'int' object is not an instance of 'str'"),
        (lambda r: r.arrive(1, "a", 10, 10, True, 0, retries="1"),
         "argument 'retries': 'str' object cannot be interpreted as an integer"),
        (lambda r: r.arrive(1, "a", 10, 10, True, 0, deadline_ms=1.5),
         "argument 'deadline_ms': 'float' object cannot be interpreted as an integer"),
        (lambda r: r.refusal("a", 10, 10, 0, None),
         "Runtime.refusal() takes 4 positional arguments but 5 were given"),
        (lambda r: r.refusal("a", 10, retries=1),
         "Runtime.refusal() missing 2 required positional arguments: 'max_tokens' and 'now_us'"),
        (lambda r: r.refusal("a", 10, 10, 0, stream=True),
         "Runtime.refusal() got an unexpected keyword argument 'stream'"),
        (lambda r: r.refusal("a", 10, 10, 0, fingerprint="x"),
         "argument 'fingerprint': 'str' object cannot be interpreted as an integer"),
        (lambda r: r.scrape_ok("b0", 0, 1, 0.5),
         "Runtime.scrape_ok() takes 3 positional arguments but 4 were given"),
        (lambda r: r.scrape_ok("b0", 0, 1, kv=0.5),
         "Runtime.scrape_ok() got an unexpected keyword argument 'kv'"),
        (lambda r: r.scrape_ok("b0", 0, 1, running="x"),
         "argument 'running': 'str' object cannot be interpreted as an integer"),
    ],
)
def test_runtime_calls_of_the_wrong_shape(call: Any, message: str) -> None:
    with pytest.raises(TypeError) as raised:
        call(runtime())
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda g: g.submit(1, "a"),
         "Governor.submit() missing 3 required positional arguments: 'prompt_tokens', "
         "'max_tokens', and 'now_us'"),
        (lambda g: g.submit(1, "a", foo=1),
         "Governor.submit() got an unexpected keyword argument 'foo'"),
        (lambda g: g.submit(1, "a", 10, 10, 0, fingerprint=1),
         "Governor.submit() got an unexpected keyword argument 'fingerprint'"),
        (lambda g: g.observe_backend("b0", 1, 0.3),
         "Governor.observe_backend() takes 2 positional arguments but 3 were given"),
        (lambda g: g.observe_backend("b0", 1, waiting=1.5),
         "argument 'waiting': 'float' object cannot be interpreted as an integer"),
    ],
)
def test_governor_calls_of_the_wrong_shape(call: Any, message: str) -> None:
    with pytest.raises(TypeError) as raised:
        call(Governor(CONFIG))
    assert str(raised.value) == message


def test_calls_by_keyword_and_in_any_order_are_taken() -> None:
    r = runtime()
    started = r.arrive(now_us=0, stream=True, max_tokens=10, prompt_tokens=10, tenant="a",
                       request_id=1, prefix_hashes=[1, 2], fingerprint=5)
    assert type(started[0]).__name__ == "Start"
    assert r.scrape_ok(now_us=1, began_us=0, backend="b0", kv_usage=0.1, kv_blocks=900) == []
    assert r.refusal(now_us=2, max_tokens=10, prompt_tokens=10, tenant="a", retries=1) is None
    g = Governor(CONFIG)
    assert type(g.submit(now_us=0, max_tokens=1, prompt_tokens=1, tenant="a",
                         request_id=9)).__name__ == "Admitted"
    g.observe_backend(now_us=2, backend="b0", running=1)
    # Non-type errors pass as they are: a negative id does not fit an unsigned integer.
    with pytest.raises(OverflowError):
        g.submit(-1, "a", 1, 1, 0)


def test_negative_signals_are_refused_with_their_name() -> None:
    for name in ("retries", "deadline_ms"):
        with pytest.raises(InvalidArgumentError, match=name):
            runtime().arrive(1, "a", 10, 10, True, 0, **{name: -1})
        with pytest.raises(InvalidArgumentError, match=name):
            runtime().refusal("a", 10, 10, 0, **{name: -1})


def test_relay_calls_of_the_wrong_shape() -> None:
    with pytest.raises(TypeError, match=r"^Relay\.__new__\(\) got an unexpected keyword "
                                        r"argument 'thread'$"):
        Relay(thread=1)  # type: ignore[call-arg]
