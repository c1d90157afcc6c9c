"""The native front's request checks (`rust/src/front/prepare.rs`) against Python's `prepare`.

The native path may serve a request only when Python would take it with the same values. So
whenever Rust accepts a body, `CompletionService.prepare` must accept it too and derive the
same values, the upstream body byte for byte as Python writes it (`json.dumps(body)`), also
with the core's priority and brownout bound (`upstream_body`). Bodies come from a strategy of
realistic and hostile fields (wrong types, nulls, numbers at and past every limit, unicode,
unknown fields of any shape) and of raw edits a dict cannot express (a key twice, `-0`,
integers past 64 bits, BOMs, bad UTF-8, lone surrogates, NaN, deep nesting). Declining
everything would not pass: Rust must be sure of every body, taking what Python takes and
refusing what Python refuses with its bytes. `test_plain_requests_are_served_natively` holds
the requests clients really send: all accepted, with Python's values.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmflow._core import FrontChecks, FrontPrepared
from llmflow.config import Limits
from llmflow.gateway.auth import Identity
from llmflow.gateway.errors import GatewayError
from llmflow.gateway.serving import CompletionService
from llmflow.gateway.session import _FINGERPRINT_KEY, BackendRoute, Prepared, upstream_body

from .reference.responses import prepare_response
from .test_front_replies import SERVER, _reply_bytes

IDENTITY = Identity("acme", "vip")
MODELS = {"m": 64, "alias": 64, "p": 2048, "wide": 4096}  # served name (and alias) -> context
ALIASES = {"alias": "m"}
PREFIX = frozenset({"p"})
MAX_INT = 2**31 - 1


def _pair(
    bytes_per_token: float = 4.0,
    streaming: bool = True,
    max_messages: int = 2048,
    max_n: int = 128,
    max_tokens: int | None = None,
    block_size: int = 4,
) -> tuple[CompletionService, FrontChecks]:
    limits = Limits(max_messages=max_messages, max_n=max_n, max_tokens=max_tokens)
    service = CompletionService(
        cast("Any", None), MODELS, bytes_per_token, streaming, limits,
        aliases=ALIASES, prefix_models=PREFIX, block_size=block_size,
    )
    checks = FrontChecks(
        MODELS, bytes_per_token, streaming, max_messages, max_n, max_tokens, _FINGERPRINT_KEY,
        aliases=ALIASES, prefix_models=set(PREFIX), block_size=block_size,
    )
    return service, checks


def _python(service: CompletionService, endpoint: str, raw: bytes) -> Prepared | None:
    try:
        return service.prepare(endpoint, IDENTITY, raw)  # type: ignore[arg-type]
    except GatewayError as exc:
        event(f"Python refuses: {exc.code} {exc.param}")
        return None


def _assert_same(endpoint: str, raw: bytes, rust: FrontPrepared, python: Prepared | None) -> None:
    assert python is not None, f"Rust accepts what Python refuses: {raw!r}"
    o, body = python.options, python.body
    bound = body.get("max_completion_tokens") or body.get("max_tokens")  # after the cap
    if endpoint == "completions":
        bound = body.get("max_tokens")
    assert (rust.endpoint, rust.path, rust.asked_model, rust.model) == (
        o.endpoint, python.path, o.model, python.model
    )
    assert (rust.stream, rust.choices, rust.include_usage, rust.continuous_usage) == (
        o.stream, o.n, o.include_usage, o.continuous_usage
    )
    assert (rust.prompt_tokens, rust.planned_tokens, rust.max_tokens) == (
        python.prompt_tokens, python.max_tokens, bound
    )
    assert (rust.prefix_hashes, rust.fingerprint, rust.unstreamed) == (
        python.prefix_hashes, python.fingerprint, python.unstreamed
    )
    assert rust.body == json.dumps(body).encode()
    start = SimpleNamespace(priority=-3, max_tokens=7)
    route = BackendRoute("http://vllm", priority_scheduling=True)
    edited = upstream_body(python, route, start)  # type: ignore[arg-type]
    assert rust.upstream_body(-3, 7) == json.dumps(edited).encode()


# ---- strategies -------------------------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
    st.floats(allow_nan=False, allow_infinity=False),
)
VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


class Field:
    """A known field: what a valid body holds, and what a hostile one may hold instead."""

    def __init__(self, valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> None:
        self.valid, self.any = valid, valid | hostile


COUNTS = st.one_of(
    st.integers(-2, 70),
    st.sampled_from([0, 1, 127, 128, 129, 256, MAX_INT, MAX_INT + 1, 2**63, 2**64, -1]),
    st.sampled_from([None, True, False, 1.0, 5.5, "5", [1]]),
)
FLOATS = st.one_of(
    st.floats(-1, 3, allow_nan=False), st.integers(-2, 3), st.sampled_from([None, True, "1"])
)
_TEXTS = st.lists(st.text(max_size=3), max_size=4)
STOP = Field(st.none() | st.text(max_size=4) | _TEXTS,
               st.lists(st.text(max_size=3), max_size=6) | st.lists(st.integers(0, 3), max_size=2))
_OPTION = st.sampled_from([True, False, None])
STREAM_OPTIONS = Field(
    st.none() | st.just({}) | st.fixed_dictionaries(
        {}, optional={"include_usage": _OPTION, "continuous_usage_stats": _OPTION}),
    st.lists(st.none(), max_size=1) | st.text(max_size=2) | st.fixed_dictionaries({}, optional={
        "include_usage": st.sampled_from([1, "yes", 0.0]), "other": VALUES}),
)
_PART = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["text", "image_url", "image", "input_audio", "imagery"]) | VALUES,
    "text": st.text(max_size=40) | VALUES,
    "image_url": st.fixed_dictionaries({"url": st.text(max_size=10)}),
    "detail": VALUES,
})
_CONTENT = Field(
    st.none() | st.text(max_size=100) | st.lists(_PART, max_size=3),
    st.lists(_PART | VALUES, max_size=2) | st.integers(),
)
_ROLE = st.sampled_from(["user", "system", "assistant", "tool", "é"])
_MESSAGE = Field(
    st.fixed_dictionaries({"role": _ROLE}, optional={
        "content": _CONTENT.valid, "name": st.text(max_size=4), "tool_calls": VALUES}),
    st.fixed_dictionaries({}, optional={"role": _ROLE | VALUES, "content": _CONTENT.any}) | VALUES,
)
_IDS = st.lists(st.integers(0, 60000), min_size=1, max_size=80)
_PROMPT = Field(
    st.text(max_size=200) | _IDS | st.lists(st.text(max_size=60), min_size=1, max_size=4)
    | st.lists(_IDS, min_size=1, max_size=3),
    st.lists(st.integers(-1, 3) | st.sampled_from([MAX_INT, MAX_INT + 1]) | st.text(max_size=2))
    | st.sampled_from([[], [[]], [True], [1, "a"], [[1], "a"], [[1], []]]) | VALUES,
)
_NONE = st.nothing()  # a field whose every value is valid
_COMMON = {
    "model": Field(st.sampled_from(["m", "alias", "p", "wide"]),
                     st.sampled_from(["unknown", "", "M"]) | VALUES),
    "stream": Field(_OPTION, st.sampled_from([1, "true"])),
    "stream_options": STREAM_OPTIONS,
    "max_tokens": Field(st.none() | st.integers(1, 300), COUNTS),
    "n": Field(st.none() | st.integers(1, 5), COUNTS),
    "temperature": Field(st.none() | st.floats(0, 2) | st.integers(0, 2), FLOATS),
    "top_p": Field(st.none() | st.floats(0.01, 1) | st.just(1), FLOATS),
    "stop": STOP,
    "seed": Field(st.none() | st.integers(-(2**63), 2**64 - 1),
                    st.integers(-(2**70), 2**70) | st.sampled_from([1.5, "1"])),
    "user": Field(st.sampled_from([None, "u"]), st.just(1)),
    "logprobs": Field(st.sampled_from([None, True, False, 0, 1, 5]), _NONE),
    "prompt_logprobs": Field(st.sampled_from([None, False, 0, 0.0, 1, True, "", "x", []]), _NONE),
    "echo": Field(_OPTION, st.sampled_from([0, 1, "", "x"])),
    "priority": Field(VALUES, _NONE),
    "kv_transfer_params": Field(VALUES, _NONE),
}
_FIELDS = {
    "chat": {
        **_COMMON,
        "messages": Field(
            st.lists(_MESSAGE.valid, min_size=1, max_size=4), st.lists(_MESSAGE.any) | VALUES
        ),
        "max_completion_tokens": Field(st.none() | st.integers(1, 300), COUNTS),
    },
    "completions": {**_COMMON, "prompt": _PROMPT},
}
_ITEM = st.fixed_dictionaries(
    {"role": _ROLE}, optional={"content": _CONTENT.valid, "type": st.just("message")}
)
_FIELDS["responses"] = {
    "model": _COMMON["model"],
    "input": Field(
        st.text(max_size=100) | st.lists(_ITEM, max_size=3),
        st.lists(_ITEM | VALUES, min_size=1, max_size=2) | VALUES,
    ),
    "instructions": Field(st.none() | st.text(max_size=40), VALUES),
    "max_output_tokens": Field(st.none() | st.integers(1, 300), COUNTS),
    "stream": Field(_OPTION, st.sampled_from([1, "true"])),
    "temperature": Field(VALUES, _NONE),  # passed through: vLLM checks it
    "priority": Field(VALUES, _NONE),
    "kv_transfer_params": Field(VALUES, _NONE),
    "background": Field(VALUES, _NONE),
}
_REQUIRED = {
    "chat": ("model", "messages"),
    "completions": ("model", "prompt"),
    "responses": ("model", "input"),
}


@st.composite
def bodies(draw: st.DrawFn, endpoint: str) -> dict[str, Any]:
    """A body of known fields (each present or not; the required ones mostly) and unknown ones,
    in any order."""
    hostile = draw(st.integers(0, 99)) >= 70  # else every known field holds a valid value
    items: list[tuple[str, Any]] = []
    for name, field in _FIELDS[endpoint].items():
        present = draw(st.integers(0, 99)) < (97 if name in _REQUIRED[endpoint] else 30)
        if present:
            items.append((name, draw(field.any if hostile else field.valid)))
    items += draw(st.lists(st.tuples(st.text(max_size=6), VALUES), max_size=3))
    return dict(draw(st.permutations(items)))


_EDITS = {  # raw edits a dict cannot express, each put first in the object
    b'"model":"m"': "a key twice (when the body names a model)",
    b'"x":-0': "-0, an int to Python, a float to serde",
    b'"seed":123456789012345678901234567890': "an integer past 64 bits",
    b'"seed":18446744073709551615': "the largest u64",
    b'"max_tokens":5.0': "a float where an int belongs",
    b'"max_tokens":1e1': "an exponent where an int belongs",
    b'"x":"\xff"': "invalid UTF-8",
    b'"x":"\\ud800"': "a lone surrogate",
    b'"x":"\\ud83d\\ude00\\u00e9"': "escapes that are fine",
    b'"temperature":NaN': "NaN",
    b'"x":1e400': "a float past the largest",
    b'"x":1e-400': "a float below the smallest",
    b'"x":' + b"[" * 127 + b"]" * 127: "nesting serde takes",
    b'"x":' + b"[" * 129 + b"]" * 129: "nesting past serde's limit",
    b'"x":' + b"[" * 201 + b"]" * 201: "nesting past the decoder's limit",
    b'"x":' + b"9" * 250 + b"e99": "a float past the largest, by its digits",
    b'"n":' + b"1" * 45: "an integer past 128 bits",
    b'"max_tokens":-' + b"7" * 45: "a negative integer past 128 bits",
    b'"temperature":' + b"9" * 320: "an integer past the largest float",
    b'"prompt":[]': "no prompt ids",
    rb'"stop":["\u00a0\u200b","\ud83d\ude00",1]': "text Python escapes in its repr",
}


@st.composite
def raws(draw: st.DrawFn, endpoint: str) -> bytes:
    """A body's bytes: as `json.dumps` writes it (ASCII or not, compact or not), sometimes
    edited (`_EDITS`), wrapped in whitespace, a BOM, or trailing bytes."""
    body = draw(bodies(endpoint))
    separators = draw(st.sampled_from([None, (",", ":")]))
    raw = json.dumps(body, ensure_ascii=draw(st.booleans()), separators=separators).encode()
    edit = draw(st.sampled_from(list(_EDITS))) if draw(st.integers(0, 99)) >= 85 else None
    if edit is not None:
        event(_EDITS[edit])
        raw = b"{" + edit + (b"," if body else b"") + raw[1:]
    wraps = [(b" \n", b"\r\n\t"), (b"\xef\xbb\xbf", b""), (b"", b"x"), (b"[", b"]")]
    wrap = draw(st.sampled_from(wraps)) if draw(st.integers(0, 99)) >= 95 else (b"", b"")
    return wrap[0] + raw + wrap[1]


CONFIGS = st.builds(
    _pair,
    bytes_per_token=st.sampled_from([4.0, 3.5, 0.75, 1.0]),
    streaming=st.booleans(),
    max_messages=st.sampled_from([3, 2048]),
    max_n=st.sampled_from([1, 4, 128]),
    max_tokens=st.sampled_from([None, 8, 50, 10_000]),
    block_size=st.sampled_from([1, 4, 16]),
)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rust_accepts_only_what_python_accepts_with_its_values(
    endpoint: str, data: st.DataObject
) -> None:
    service, checks = data.draw(CONFIGS)
    raw = data.draw(raws(endpoint))
    rust = checks.prepare(endpoint, raw)  # type: ignore[arg-type]
    python = _python(service, endpoint, raw)
    event(f"Rust {'accepts' if rust else 'refuses'}, Python {'accepts' if python else 'refuses'}")
    if rust is not None:
        _assert_same(endpoint, raw, rust, python)
    _assert_refused_alike(service, checks, endpoint, raw, rust)


def _assert_refused_alike(
    service: CompletionService,
    checks: FrontChecks,
    endpoint: str,
    raw: bytes,
    rust: FrontPrepared | None,
) -> None:
    """Rust takes the bodies Python takes and refuses the others, each with Python's response
    byte for byte (`GatewayError.response()` as uvicorn writes it): it is unsure of none."""
    keep_alive = len(raw) % 2 == 0  # either, as the body falls
    refused = checks.refusal(endpoint, raw, SERVER, keep_alive)  # type: ignore[arg-type]
    error: GatewayError | None = None
    try:
        service.prepare(endpoint, IDENTITY, raw)  # type: ignore[arg-type]
    except GatewayError as exc:
        error = exc
    if error is None:
        assert refused is None, f"Rust refuses what Python accepts: {raw!r}"
        assert rust is not None, f"Rust is unsure of what Python accepts: {raw!r}"
        return
    event(f"Rust answers Python's {error.code}")
    assert refused is not None, f"Rust is unsure of what Python refuses ({error}): {raw!r}"
    assert refused == _reply_bytes(error, SERVER, keep_alive), raw


_PIECES = st.sampled_from([  # bytes that steer a JSON reader, alone or as they come in bodies
    b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"\\u", b"\\ud800", b"\\udc00", b" ", b"\n",
    b"\t", b"\x00", b"\x1f", b"\x7f", b"\xff", b"\xc3", b"\xef\xbb\xbf", b"-", b"+", b".", b"e",
    b"E", b"0", b"9", b"1e400", b"-0", b"NaN", b"Infinity", b"-Infinity", b"nul", b"true",
    b"fals", b"1" * 310, b"e999", b"[" * 201, b"\r\n",
])


@st.composite
def mangled(draw: st.DrawFn, endpoint: str) -> bytes:
    """A body's bytes with one to three edits: cut short, a piece inserted, a span deleted, a
    byte replaced, or the whole thing swapped for a few pieces."""
    raw = draw(raws(endpoint))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(raw)))
        edit = draw(st.sampled_from(["cut", "insert", "delete", "replace", "pieces"]))
        event(f"edit: {edit}")
        if edit == "cut":
            raw = raw[:at]
        elif edit == "insert":
            raw = raw[:at] + draw(_PIECES) + raw[at:]
        elif edit == "delete":
            raw = raw[:at] + raw[at + draw(st.integers(1, 8)) :]
        elif edit == "replace":
            raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
        else:
            raw = b"".join(draw(st.lists(_PIECES, max_size=6)))
    return raw


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mangled_body_is_refused_as_python_refuses_it(
    endpoint: str, data: st.DataObject
) -> None:
    """Whatever the bytes, the front answers with Python's error, byte for byte, or serves
    what Python serves, with its values."""
    service, checks = data.draw(CONFIGS)
    raw = data.draw(mangled(endpoint))
    rust = checks.prepare(endpoint, raw)  # type: ignore[arg-type]
    if rust is not None:
        _assert_same(endpoint, raw, rust, _python(service, endpoint, raw))
    _assert_refused_alike(service, checks, endpoint, raw, rust)


# ---- what clients send: all accepted ----------------------------------------------------------

_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}}]
PLAIN_CHAT: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello"}], "model": "wide"},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Say hi in 3 languages: 日本語, français"}],
     "model": "wide", "stream": True, "stream_options": {"include_usage": True},
     "max_tokens": 64, "temperature": 0.7, "top_p": 0.95, "n": 2, "stop": ["\n\n", "END"],
     "seed": 42, "user": "user-1", "frequency_penalty": 0.1, "presence_penalty": -0.5,
     "logit_bias": {"50256": -100}, "logprobs": True, "top_logprobs": 3},
    {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=",
                                            "detail": "low"}}]}],
     "model": "p", "max_completion_tokens": 100, "stream": True},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}],
     "model": "alias", "tools": _TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
     "response_format": {"type": "json_object"}, "stream": False, "max_tokens": 20},
    {"messages": [{"role": "user", "content": "x" * 900}], "model": "p", "stream": True,
     "stream_options": {"include_usage": True, "continuous_usage_stats": False},
     "temperature": 0, "top_k": 20, "ignore_eos": False, "metadata": {"k": "v"}},
]
PLAIN_COMPLETIONS: list[dict[str, Any]] = [
    {"model": "wide", "prompt": "Once upon a time", "max_tokens": 16},
    {"model": "wide", "prompt": "def f(x):", "stream": True, "temperature": 0.2, "stop": "\n",
     "echo": False, "logprobs": 2, "suffix": None, "best_of": 1},
    {"model": "p", "prompt": list(range(100)), "max_tokens": 8, "n": 3},
    {"model": "alias", "prompt": ["a b c", "d e f"], "max_tokens": 4},
    {"model": "wide", "prompt": [[1, 2, 3], [4, 5]], "stream": True,
     "stream_options": {"include_usage": True}},
    {"model": "wide", "prompt": "Score me", "max_tokens": 0, "echo": True, "logprobs": 1},
    {"model": "wide", "prompt": "Prompt logprobs", "prompt_logprobs": 1, "max_tokens": 1},
]


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [("chat", b) for b in PLAIN_CHAT] + [("completions", b) for b in PLAIN_COMPLETIONS],
)
@pytest.mark.parametrize("separators", [None, (",", ":")])
def test_plain_requests_are_served_natively(
    endpoint: str, body: dict[str, Any], separators: tuple[str, str] | None
) -> None:
    for config in ({}, {"max_tokens": 512, "bytes_per_token": 3.5}):
        service, checks = _pair(**config)  # type: ignore[arg-type]
        raw = json.dumps(body, separators=separators, ensure_ascii=False).encode()
        rust = checks.prepare(endpoint, raw)  # type: ignore[arg-type]
        assert rust is not None, raw
        _assert_same(endpoint, raw, rust, _python(service, endpoint, raw))


def test_the_checks_read_what_they_are_given() -> None:
    """The values are the request's own, not constants: a prefix model hashes, a streamed
    request streams, and the fingerprint follows the bytes."""
    _, checks = _pair()
    one = checks.prepare("completions", b'{"model":"p","prompt":"' + b"a" * 64 + b'"}')
    two = checks.prepare("completions", b'{"model":"p","prompt":"' + b"a" * 63 + b'b"}')
    assert one is not None
    assert two is not None
    assert one.prefix_hashes is not None
    assert two.prefix_hashes is not None
    assert one.prefix_hashes[:3] == two.prefix_hashes[:3] != []
    assert one.prefix_hashes[3] != two.prefix_hashes[3]
    assert one.fingerprint != two.fingerprint
    assert checks.prepare("chat", b'{"model":"m","messages":[]}') is None


def test_text_in_a_refusal_is_shown_as_python_repr_shows_it() -> None:
    """Every character Python's `repr` prints as it is, or escapes, the front's 400 shows the
    same way (its table of printable characters is Python's own: `printable.rs`)."""
    _, checks = _pair()
    step = 6  # six characters escape to at most 66, inside the message's 80
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for at in range(0, len(points), step):
        text = "".join(map(chr, points[at : at + step]))
        raw = json.dumps({"model": "m", "prompt": "p", "user": [text]}).encode()
        answer = checks.refusal("completions", raw, SERVER, True)  # type: ignore[arg-type]
        assert answer is not None, text
        message = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert message == f"user: Input should be a valid string (got {[text]!r})", text


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    bytes_per_token=st.sampled_from([4.0, 0.75]),
    streaming=st.booleans(),
    cap=st.sampled_from([None, 8, 10_000]),
)
def test_a_responses_body_is_taken_or_refused_as_python_does(
    data: st.DataObject, bytes_per_token: float, streaming: bool, cap: int | None
) -> None:
    """`prepare_response` and the front agree on every body: the same values where Python
    takes it, Python's response byte for byte where it refuses it."""
    _, checks = _pair(bytes_per_token=bytes_per_token, streaming=streaming, max_tokens=cap)
    raw = data.draw(raws("responses") | mangled("responses"))
    rust = checks.prepare("responses", raw)
    refused = checks.refusal("responses", raw, SERVER, True)
    python: Prepared | GatewayError
    try:
        python = prepare_response(
            IDENTITY, raw, MODELS, bytes_per_token, cap, streaming, aliases=ALIASES
        )
    except GatewayError as exc:
        python = exc
    if isinstance(python, GatewayError):
        event(f"refused: {python.code}")
        assert rust is None, f"Rust accepts what Python refuses: {raw!r}"
        assert refused == _reply_bytes(python, SERVER, True), raw
        return
    event("taken")
    assert refused is None, f"Rust refuses what Python accepts: {raw!r}"
    assert rust is not None, f"Rust is unsure of what Python accepts: {raw!r}"
    assert (rust.asked_model, rust.model, rust.stream) == (
        python.options.model, python.model, python.options.stream
    )
    assert (rust.prompt_tokens, rust.planned_tokens, rust.fingerprint) == (
        python.prompt_tokens, python.max_tokens, python.fingerprint
    )
    assert rust.body == json.dumps(python.body).encode()
