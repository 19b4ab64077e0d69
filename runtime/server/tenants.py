"""Whom a request is served for (its *tenant*, see sched/policies.py), decided at the HTTP edge.

With `--api-key-file`, the tenant is the identity that the file gives the request's API key: one
`KEY TENANT` pair per line, blank lines and `#` comments ignored. A request must then carry one of
those keys (or the `--api-key`, whose tenant is the shared default); the OpenAI `user` field is
ignored, so a client cannot claim another key's tenant. Without a key file the tenant is the `user`
field, else the shared default tenant.

Keys are never logged nor kept: only their SHA-256 digests are, and errors name lines, not keys.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field

from kvpilot.runtime.sched.sequence import DEFAULT_TENANT

# Tenants are metric label values and appear in logs: keep them plain. "other" is the metrics'
# label for the tenants beyond the ones shown by name.
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,63}")
RESERVED_TENANTS = ("other",)


class APIKeyFileError(ValueError):
    """The key file is missing or malformed; the message names the file and the line."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class APIKeys:
    """The key file's key -> tenant map, held as SHA-256 digests of the keys."""

    path: str
    tenant_by_digest: dict[bytes, str] = field(repr=False)

    @property
    def tenants(self) -> list[str]:
        return sorted(set(self.tenant_by_digest.values()))

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of `key`, or None when it is not in the file."""
        return None if key is None else self.tenant_by_digest.get(_digest(key))

    @classmethod
    def load(cls, path: str) -> APIKeys:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise APIKeyFileError(f"api_key_file: cannot read {path}: {e.__class__.__name__}: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
        by_digest: dict[bytes, str] = {}
        first_line: dict[bytes, int] = {}
        for number, line in enumerate(lines, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            parts = text.split()
            where = f"api_key_file: {path}, line {number}"
            if len(parts) != 2:
                raise APIKeyFileError(f"{where}: expected 'KEY TENANT' (two fields separated by spaces), "
                                      f"found {len(parts)} field(s)")
            key, tenant = parts
            if not _TENANT.fullmatch(tenant) or tenant in RESERVED_TENANTS:
                raise APIKeyFileError(f"{where}: tenant {tenant!r} must be 1-64 characters of letters, digits "
                                      f"and . _ : @ / -, starting with a letter or digit, and not "
                                      f"{' or '.join(RESERVED_TENANTS)}")
            digest = _digest(key)
            if digest in by_digest:
                raise APIKeyFileError(f"{where}: the key repeats the key of line {first_line[digest]}")
            by_digest[digest] = tenant
            first_line[digest] = number
        if not by_digest:
            raise APIKeyFileError(f"api_key_file: {path} lists no 'KEY TENANT' line")
        return cls(path, by_digest)


def resolve_tenant(keys: APIKeys | None, api_key: str | None, token: str | None,
                   user: str | None) -> str | None:
    """The request's tenant, or None when its bearer `token` is not accepted.

    `api_key` is `--api-key` (None: not set); `keys` the key file (None: not given)."""
    if keys is not None:
        tenant = keys.tenant_of(token)
        if tenant is not None:
            return tenant
        if api_key is not None and token is not None and _same(token, api_key):
            return DEFAULT_TENANT
        return None
    if api_key is not None and (token is None or not _same(token, api_key)):
        return None
    return user or DEFAULT_TENANT


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
