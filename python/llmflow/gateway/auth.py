"""Identity: API keys from the config map to a tenant and its tier; nothing else does.

A client never chooses its own tier: headers such as `X-User-Tier` are not read anywhere. With no
keys configured every caller is the one anonymous tenant of the default tier. Keys are compared in
constant time, and no message, log line or snapshot ever holds one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmflow.gateway.errors import GatewayError

if TYPE_CHECKING:
    from llmflow.config import Settings

__all__ = ["AdminGuard", "Identity", "KeyRing"]

_BEARER = "bearer "
_BASIC = "basic "


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request is from, as the config says."""

    tenant: str
    tier: str


class KeyRing:
    """Resolves `Authorization: Bearer KEY` to an `Identity`.

    A presented key is hashed (SHA-256) and its digest compared with every configured key's
    digest by `hmac.compare_digest`, all of them every time: how long a lookup takes depends on
    neither how much of a guessed key matches a real one nor which key matched.

    Args:
        settings: the validated config (tenants, their tiers and API keys).
    """

    def __init__(self, settings: Settings) -> None:
        self.enabled = settings.auth_enabled
        self._anonymous = Identity(settings.anonymous_tenant, settings.default_tier)
        self._max_bytes = settings.limits.max_api_key_bytes
        self._keys = [
            (_digest(key), Identity(t.name, t.tier)) for t in settings.tenants for key in t.api_keys
        ]
        self._tiers = {t.name: t.tier for t in settings.tenants}
        self._tiers.setdefault(settings.anonymous_tenant, settings.default_tier)

    def tier_of(self, tenant: str) -> str:
        """The tier the config gives a tenant."""
        return self._tiers[tenant]

    def authenticate(self, authorization: str | None) -> Identity:
        """Resolve an `Authorization` header value.

        Args:
            authorization: the raw header, or `None` when absent.

        Returns:
            The tenant and tier the key belongs to (the anonymous tenant when auth is off).

        Raises:
            GatewayError: 401 when keys are configured and the key is missing, too long or
                unknown.
        """
        if not self.enabled:
            return self._anonymous
        digest = _presented(authorization, self._max_bytes)
        found: Identity | None = None
        for known, identity in self._keys:  # no early exit: every key is compared every time
            if hmac.compare_digest(known, digest):
                found = identity
        if found is None:
            raise _unauthorized("invalid API key")
        return found


class AdminGuard:
    """Checks the admin key (`admin.api_key`) for `/api/state`, `/dashboard` and `/metrics`.

    Tools send `Authorization: Bearer KEY`; a browser opening the dashboard is asked for it
    (HTTP Basic, any user name, the key as password) and then sends it with every poll.

    Args:
        settings: the validated config.
    """

    def __init__(self, settings: Settings) -> None:
        key = settings.admin.api_key
        self._digest = _digest(key) if key is not None else None
        self._max_bytes = max(settings.limits.max_api_key_bytes, len(key or "") + 1)

    def check(self, authorization: str | None) -> None:
        """Let the request through, or refuse it.

        Raises:
            GatewayError: 401 when an admin key is configured and not presented.
        """
        if self._digest is None:
            return
        try:
            digest = _presented(_basic_to_bearer(authorization), self._max_bytes, "admin key")
        except GatewayError as exc:
            raise _admin_unauthorized(exc.message) from None
        if not hmac.compare_digest(self._digest, digest):
            raise _admin_unauthorized("invalid admin key")


def _presented(authorization: str | None, max_bytes: int, what: str = "API key") -> bytes:
    if not authorization or authorization[: len(_BEARER)].lower() != _BEARER:
        raise _unauthorized(f"missing {what}: send 'Authorization: Bearer KEY'")
    key = authorization[len(_BEARER) :].strip()
    if len(key) > max_bytes:  # checked before hashing: a megabyte key costs nothing
        raise _unauthorized(
            f"{what} is longer than {max_bytes} bytes, so it cannot be valid: "
            "check what is sent in 'Authorization: Bearer KEY'"
        )
    return _digest(key)


def _basic_to_bearer(authorization: str | None) -> str | None:
    if not authorization or authorization[: len(_BASIC)].lower() != _BASIC:
        return authorization
    try:
        decoded = base64.b64decode(authorization[len(_BASIC) :].strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _user, _, password = decoded.decode("latin-1").partition(":")
    return f"Bearer {password}"


def _digest(key: str) -> bytes:
    # Header values arrive as latin-1 text; surrogates cannot, but a key from a WebSocket
    # message can hold anything JSON can, so encode leniently rather than fail.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _admin_unauthorized(message: str) -> GatewayError:
    realm = 'Basic realm="llmflow admin", charset="UTF-8"'  # a browser asks for the key
    return GatewayError(401, message, "invalid_admin_key", headers={"WWW-Authenticate": realm})
