"""Assemble llmflow's config file from the chart's ConfigMap and the keys its Secret mounts.

The pod's init container runs this with the llmflow image's Python. The ConfigMap holds the
whole config but its secrets; each Secret key is a file: `tenant.<name>` (that tenant's API
keys, one a line), `admin-api-key`, `redis-url`. The assembled file goes to a memory-backed
volume, readable by the pod's user alone, and is validated with llmflow's own loader first, so
a bad config stops the pod in its init step with llmflow's message (which never quotes a key)
rather than crash-looping `llmflow serve`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from llmflow.config import ConfigFileError, load_settings

TENANT_PREFIX = "tenant."  # Secret key of a tenant's API keys: tenant.<name>
ADMIN_KEY = "admin-api-key"
REDIS_URL = "redis-url"


class AssemblyError(ValueError):
    """The Secret and the ConfigMap do not fit together; the message says which key to fix."""


def assemble(config: dict[str, Any], secrets: dict[str, str]) -> dict[str, Any]:
    """Return `config` with the keys from `secrets` (Secret key -> file text) put in place."""
    tenants = {t["name"]: t for t in config.get("tenants") or []}
    for name, text in sorted(secrets.items()):
        if not name.startswith(TENANT_PREFIX):
            continue
        tenant = name.removeprefix(TENANT_PREFIX)
        if tenant not in tenants:
            raise AssemblyError(
                f"Secret key {name!r}: no tenant {tenant!r} in config.tenants "
                f"(tenants: {sorted(tenants)})"
            )
        tenants[tenant]["api_keys"] = [k.strip() for k in text.splitlines() if k.strip()]
    if ADMIN_KEY in secrets:
        config.setdefault("admin", {})["api_key"] = secrets[ADMIN_KEY].strip()
    if REDIS_URL in secrets:
        config.setdefault("state", {})["url"] = secrets[REDIS_URL].strip()
    elif (config.get("state") or {}).get("backend") == "redis":
        raise AssemblyError(f"state.backend is redis but the Secret has no {REDIS_URL!r} key")
    return config


def read_secrets(directory: Path) -> dict[str, str]:
    """Each file of a mounted Secret (its `..data` bookkeeping entries left out)."""
    return {
        p.name: p.read_text(encoding="utf-8")
        for p in sorted(directory.iterdir())
        if not p.name.startswith("..") and p.is_file()
    }


def main(argv: list[str] | None = None) -> int:
    """Assemble, validate, and write the config; 2 with the reason when it does not fit."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, required=True, help="the ConfigMap's config.yaml")
    p.add_argument("--secrets", type=Path, required=True, help="where the Secret is mounted")
    p.add_argument("--out", type=Path, required=True, help="the assembled config file")
    args = p.parse_args(argv)
    config = yaml.safe_load(args.config.read_text(encoding="utf-8")) or {}
    try:
        config = assemble(config, read_secrets(args.secrets))
        load_settings(data=config)
    except (AssemblyError, ConfigFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        yaml.safe_dump(config, out, sort_keys=False)
    print(f"llmflow config assembled: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
