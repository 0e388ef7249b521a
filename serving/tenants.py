"""Tenants: the API keys a server accepts, stored as hashes, each naming the client that holds it.

A tenant is a name and the SHA-256 of its key. Keys come from three settings, together:

* ``api_key``: one plain key (tenant ``default``), as before;
* ``api_keys``: ``NAME=sha256:HEX`` entries separated by commas (``EDGESPEC_API_KEYS`` in the unit's env file);
* ``api_keys_file``: a file of ``NAME sha256:HEX`` lines (``#`` comments).

Only hashes are read from ``api_keys`` and the file, so neither holds a usable secret at rest; keys are long random
strings (``python -m edgespec.serving.tenants NAME`` makes one and prints its entry), so a plain SHA-256 is enough
(no password stretching needed). The tenant is the namespace of the prefix cache (:func:`serving.protocol.client_key`):
one tenant never resumes from, nor times, another's prompt.

Without any key configured (loopback, no auth) the tenant is derived from whatever bearer token a client sends, so
clients that send different tokens are still kept apart.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import re
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_DIGEST = re.compile(r"^sha256:([0-9a-fA-F]{64})$")


@dataclass(frozen=True)
class Tenant:
    """One accepted key: the client's name and the SHA-256 of the key."""

    name: str
    digest: bytes


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def entry_for(name: str, key: str) -> str:
    """The ``api_keys_file`` line for ``key``."""
    return f"{name} sha256:{key_digest(key).hex()}"


def _parse(name: str, digest: str, where: str) -> Tenant:
    if not _NAME.match(name):
        raise ConfigError(f"{where}: tenant name {name[:40]!r} must be 1-64 letters, digits, '.', '_' or '-'")
    m = _DIGEST.match(digest.strip())
    if m is None:
        raise ConfigError(f"{where}: the key of tenant {name!r} must be given as sha256:<64 hex digits> (only hashes "
                          "are stored; `python -m edgespec.serving.tenants NAME` makes a key and its entry)")
    return Tenant(name, bytes.fromhex(m.group(1)))


def parse_env(text: str) -> list[Tenant]:
    """``NAME=sha256:HEX,NAME=sha256:HEX`` (the ``api_keys`` setting)."""
    out = []
    for i, item in enumerate(p for p in text.split(",") if p.strip()):
        name, sep, digest = item.strip().partition("=")
        if not sep:
            raise ConfigError(f"api_keys entry {i + 1}: expected NAME=sha256:HEX")
        out.append(_parse(name.strip(), digest, f"api_keys entry {i + 1}"))
    return out


def parse_file(path: str | Path) -> list[Tenant]:
    """``NAME sha256:HEX`` lines (the ``api_keys_file`` setting); errors name the file and line."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"api_keys_file {p}: cannot be read: {exc}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"api_keys_file {p} line {n}: expected `NAME sha256:HEX`")
        out.append(_parse(parts[0], parts[1], f"api_keys_file {p} line {n}"))
    return out


class TenantTable:
    """The accepted keys; :meth:`identify` maps a presented key to its tenant's name."""

    def __init__(self, tenants: list[Tenant]) -> None:
        names = [t.name for t in tenants]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ConfigError(f"tenant {dup!r} is declared twice (api_key is tenant 'default')")
        digests = [t.digest for t in tenants]
        if len(set(digests)) != len(digests):
            raise ConfigError("two tenants share one API key")
        self.tenants = list(tenants)

    @classmethod
    def from_settings(cls, api_key: str | None, api_keys: str | None, api_keys_file: str | None) -> TenantTable:
        tenants = [Tenant("default", key_digest(api_key))] if api_key else []
        if api_keys:
            tenants += parse_env(api_keys)
        if api_keys_file:
            tenants += parse_file(api_keys_file)
        return cls(tenants)

    @property
    def required(self) -> bool:
        """True when keys are configured (``/v1`` then needs one)."""
        return bool(self.tenants)

    def identify(self, key: str) -> str | None:
        """The tenant holding ``key``, or None. Every entry is compared (constant time each), so the time does not
        say which entry came close."""
        digest, found = key_digest(key), None
        for t in self.tenants:
            if hmac.compare_digest(digest, t.digest):
                found = t.name
        return found

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of a request presenting ``key`` (None: refuse it). Without configured keys every request
        is let in, as a tenant derived from its token (clients sending different tokens stay apart)."""
        if not self.required:
            return "anonymous:" + key_digest(key or "").hex()[:32]
        return self.identify(key) if key else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec.serving.tenants",
                                 description="Make an API key for a tenant and print its api_keys_file entry.")
    ap.add_argument("name", help="tenant name (letters, digits, . _ -)")
    ap.add_argument("--stdin", action="store_true", help="hash the key read from stdin instead of making one")
    args = ap.parse_args(argv)
    key = sys.stdin.readline().strip() if args.stdin else secrets.token_urlsafe(32)
    try:
        line = entry_for(args.name, key)
        _parse(args.name, line.split()[1], "name")
    except ConfigError as exc:
        print(f"edgespec: error: {exc}", file=sys.stderr)
        return 2
    if not args.stdin:
        print(f"key (give it to the client; it is not stored anywhere): {key}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
