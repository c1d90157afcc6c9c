"""Identity: API keys from the config map to a tenant and its tier; nothing else does.

A client never chooses its own tier: headers such as `X-User-Tier` are not read anywhere. With no
keys configured every caller is the one anonymous tenant of the default tier.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmflow.gateway.errors import GatewayError

if TYPE_CHECKING:
    from llmflow.config import Settings

__all__ = ["Identity", "KeyRing"]

_BEARER = "bearer "


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request is from, as the config says."""

    tenant: str
    tier: str


class KeyRing:
    """Resolves `Authorization: Bearer KEY` to an `Identity`.

    Keys are looked up by their SHA-256 digest, so the lookup time does not depend on how much of
    a guessed key matches a real one.

    Args:
        settings: the validated config (tenants, their tiers and API keys).
    """

    def __init__(self, settings: Settings) -> None:
        self.enabled = settings.auth_enabled
        self._anonymous = Identity(settings.anonymous_tenant, settings.default_tier)
        self._by_digest = {
            _digest(key): Identity(t.name, t.tier) for t in settings.tenants for key in t.api_keys
        }
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
            GatewayError: 401 when keys are configured and the key is missing or unknown.
        """
        if not self.enabled:
            return self._anonymous
        if not authorization or not authorization[: len(_BEARER)].lower() == _BEARER:
            raise _unauthorized("missing API key: send 'Authorization: Bearer KEY'")
        identity = self._by_digest.get(_digest(authorization[len(_BEARER) :].strip()))
        if identity is None:
            raise _unauthorized("invalid API key")
        return identity


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
