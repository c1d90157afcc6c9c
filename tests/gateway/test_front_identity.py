"""The native front's API keys and client signals (`rust/src/front/{auth,signals}.rs`) against
Python's `KeyRing.authenticate` and `read_signals`.

A key must open the same tenant on both paths, and fail on both: the Rust answer is Python's,
for well-formed, odd (any case of the scheme, whitespace Python strips, latin-1 bytes, keys at
and past the length bound) and wrong headers. The signals the front reads must be Python's;
where Python answers 400 the front must decline, and it may decline a timeout it is unsure
Python's `float()` reads the same way, but never the headers SDKs and proxies send.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmflow._core import FrontKeys, front_signals
from llmflow.gateway.auth import KeyRing
from llmflow.gateway.errors import GatewayError
from llmflow.gateway.signals import ClientSignals, read_signals

from .harness import settings_for
from .test_front_replies import SERVER, _reply_bytes

TENANTS = [
    {"name": "acme", "tier": "vip", "api_keys": ["sk-acme-0123456789"]},
    {"name": "bulk", "tier": "normal", "api_keys": ["sk-bulk-0123456789", "clé-bulk-0123"]},
]
MAX_KEY_BYTES = 20


def _rings(tenants: list[dict[str, object]]) -> tuple[KeyRing, FrontKeys]:
    s = settings_for({"b0": "http://127.0.0.1:9"}, tenants=tenants,
                     limits={"max_api_key_bytes": MAX_KEY_BYTES})
    keys = [(k.encode("utf-8", "surrogatepass"), t.name, t.tier)
            for t in s.tenants for k in t.api_keys]
    front = FrontKeys(s.auth_enabled, (s.anonymous_tenant, s.default_tier),
                      s.limits.max_api_key_bytes, keys)
    return KeyRing(s), front


def _python_identity(ring: KeyRing, header: bytes | None) -> tuple[str, str] | None:
    try:
        who = ring.authenticate(header.decode("latin-1") if header is not None else None)
    except GatewayError as exc:
        status = exc.status
    else:
        return who.tenant, who.tier
    assert status == 401
    return None


_KEYS = [
    b"sk-acme-0123456789", b"sk-bulk-0123456789", "clé-bulk-0123".encode("latin-1"),
    "clé-bulk-0123".encode(), b"sk-acme-012345678", b"sk-acme-01234567890", b"x" * 21, b"x" * 20,
]
_SPACE = st.sampled_from([b"", b" ", b"  ", b"\t", b"\x0b", b"\x1c", b"\x85", b"\xa0", b"\x00"])
_SCHEMES = [b"Bearer ", b"bearer ", b"BEARER ", b"bEaReR ", b"Bearer", b"Bearer\t", b"Basic ", b"",
            b"Token ", b"Bearerx"]


@st.composite
def headers(draw: st.DrawFn) -> bytes | None:
    """An `Authorization` value: mostly a scheme and a key with spaces around it (the known
    keys, near misses, a multi-byte key, random bytes), sometimes absent or random."""
    shape = draw(st.integers(0, 99))
    if shape >= 90:
        return draw(st.none() | st.binary(max_size=40))
    scheme = draw(st.sampled_from(_SCHEMES)) if shape >= 50 else b"Bearer "
    key = draw(st.sampled_from(_KEYS) | st.binary(max_size=24)) if shape >= 30 else _KEYS[shape % 3]
    return scheme + draw(_SPACE) + key + draw(_SPACE)


@pytest.mark.parametrize("tenants", [TENANTS, []], ids=["keys", "no-keys"])
@settings(max_examples=400, deadline=None)
@given(header=headers())
def test_a_key_opens_the_same_tenant_on_both_paths(
    tenants: list[dict[str, object]], header: bytes | None
) -> None:
    ring, front = _rings(tenants)
    python = _python_identity(ring, header)
    event(f"python: {python}")
    assert front.authenticate(header) == python
    # Where Python answers 401, the front answers it natively, with the same bytes.
    refused = None
    try:
        ring.authenticate(header.decode("latin-1") if header is not None else None)
    except GatewayError as exc:
        refused = _reply_bytes(exc, SERVER, keep_alive=True)
    assert front.refusal(header, SERVER, True) == refused


def test_each_key_opens_its_tenant() -> None:
    """The keys themselves, not only failures: each opens its own tenant in Rust."""
    _, front = _rings(TENANTS)
    assert front.authenticate(b"Bearer sk-acme-0123456789") == ("acme", "vip")
    assert front.authenticate(b"bearer  sk-bulk-0123456789 ") == ("bulk", "normal")
    assert front.authenticate("Bearer clé-bulk-0123".encode("latin-1")) == ("bulk", "normal")
    assert front.authenticate(b"Bearer sk-acme-0123456788") is None
    assert front.authenticate(None) is None


_NAMES = st.sampled_from([
    b"x-stainless-retry-count", b"x-envoy-attempt-count", b"x-stainless-timeout",
    b"x-stainless-read-timeout", b"x-llmflow-deadline-ms", b"x-other", b"X-Stainless-Timeout",
])
_VALUES = st.one_of(
    st.integers(-5, 10**9).map(lambda i: str(i).encode()),
    st.floats(-10, 1e6, allow_nan=False).map(lambda f: repr(f).encode()),
    st.floats(allow_nan=True).map(lambda f: repr(f).encode()),
    st.text(alphabet="0123456789.eE+-_ \t", max_size=10).map(str.encode),
    st.sampled_from([b" 5 ", b"600.0", b"1_0", b"inf", b"\x1c5", b"1e3", b".5", b"5.", b"\xa05",
                     b"86400000", b"86400001", b"0", b"0.0005", b"0.0015", b"1e-3", b"\xc3\xa9",
                     b"\x0b7\x0c", b"1000000", b"1000001", b"0001", b"\xd9\xa3", b"1e306"]),
    st.binary(max_size=10),
)
SIGNAL_HEADERS = st.lists(st.tuples(_NAMES, _VALUES), max_size=4)


@settings(max_examples=600, deadline=None)
@given(headers=SIGNAL_HEADERS)
def test_signals_are_pythons_or_declined(headers: list[tuple[bytes, bytes]]) -> None:
    rust = front_signals(headers)
    status = 200
    try:
        python: ClientSignals | None = read_signals(headers)
    except GatewayError as exc:
        python, status = None, exc.status
    assert status in (200, 400)
    event(f"rust {'reads' if rust else 'declines'}, python {'reads' if python else 'refuses'}")
    if python is None:
        assert rust is None
    elif rust is not None:
        assert ClientSignals(*rust) == python


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([], (None, None)),
        ([(b"x-stainless-retry-count", b"0"), (b"x-stainless-read-timeout", b"600.0")],
         (0, 600_000)),
        ([(b"x-stainless-retry-count", b"2"), (b"x-stainless-timeout", b"60")], (2, 60_000)),
        ([(b"x-envoy-attempt-count", b"3")], (2, None)),
        ([(b"x-llmflow-deadline-ms", b"1500"), (b"x-stainless-read-timeout", b"5.0")],
         (None, 1500)),
        ([(b"x-stainless-timeout", b"0.25")], (None, 250)),
    ],
)
def test_the_signals_clients_send_are_read(
    headers: list[tuple[bytes, bytes]], expected: tuple[int | None, int | None]
) -> None:
    assert front_signals(headers) == expected
    assert ClientSignals(*expected) == read_signals(headers)
