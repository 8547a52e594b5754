"""API keys: a TOML file of named keys, stored as SHA-256 hashes, re-read when it changes.

File format (``gpumesh apikey NAME`` prints a new key and its entry)::

    [[key]]
    name = "team-a"                 # shows on trace spans and in metrics (never the key)
    sha256 = "9f86d0..."            # hex SHA-256 of the key
    role = "client"                 # "client" (Inference) or "operator" (also GetFleet, Pick)
    models = ["tiny"]               # allowed models (names or aliases); empty = all
    requests_per_s = 10.0           # sustained request rate; 0 = unlimited
    burst = 20                      # requests above the rate allowed at once (default 2 s' worth)
    max_concurrency = 8             # requests in flight at once; 0 = unlimited
    tokens_per_s = 5000.0           # prompt estimate + max_tokens per second; 0 = unlimited

Keys are random 32-byte tokens (``gpm_`` + URL-safe base64), so an unsalted SHA-256 is the
right storage (as for other high-entropy API tokens): the file does not reveal them. The file
is checked for changes at most once a second (a stat); a file that fails to parse keeps the
previous keys and logs the error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ROLES = ("client", "operator")
CHECK_EVERY_S = 1.0


@dataclass(frozen=True)
class ApiKey:
    name: str
    role: str = "client"
    models: frozenset[str] = frozenset()
    requests_per_s: float = 0.0
    burst: float = 0.0
    max_concurrency: int = 0
    tokens_per_s: float = 0.0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "gpm_" + secrets.token_urlsafe(32)


def entry_toml(name: str, key: str, role: str = "client", models: tuple[str, ...] = ()) -> str:
    """The ``[[key]]`` entry for ``key`` (what ``gpumesh apikey`` prints)."""
    ms = ", ".join(f'"{m}"' for m in models)
    return (f'[[key]]\nname = "{name}"\nsha256 = "{hash_key(key)}"\nrole = "{role}"\n'
            f"models = [{ms}]\nrequests_per_s = 0.0\nmax_concurrency = 0\ntokens_per_s = 0.0\n")


def parse_keys(text: str) -> dict[str, ApiKey]:
    """sha256 hex -> ApiKey; ValueError naming what is wrong."""
    data = tomllib.loads(text)
    out: dict[str, ApiKey] = {}
    names: set[str] = set()
    for i, k in enumerate(data.get("key", [])):
        name, digest = str(k.get("name", "")), str(k.get("sha256", "")).lower()
        if not name or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"key #{i + 1}: name and a 64-hex sha256 are required")
        if name in names:
            raise ValueError(f"key name {name!r} appears twice")
        role = str(k.get("role", "client"))
        if role not in ROLES:
            raise ValueError(f"key {name!r}: role must be one of {ROLES}")
        rate = float(k.get("requests_per_s", 0.0))
        tokens = float(k.get("tokens_per_s", 0.0))
        conc = int(k.get("max_concurrency", 0))
        burst = float(k.get("burst", 0.0)) or max(1.0, 2 * rate)
        if rate < 0 or tokens < 0 or conc < 0 or burst < 1:
            raise ValueError(f"key {name!r}: limits must be >= 0 (burst >= 1)")
        names.add(name)
        out[digest] = ApiKey(name, role, frozenset(str(m) for m in k.get("models", [])), rate,
                             burst, conc, tokens)
    return out


class KeyStore:
    """The keys of ``path``; ``lookup(bearer)`` is the request path's one call."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._keys: dict[str, ApiKey] = {}
        self._mtime = -1
        self._checked = -1e9
        if not self._reload():
            raise ValueError(f"api_keys_file {path}: could not be loaded (see the log)")

    def _reload(self) -> bool:
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime == self._mtime:
                return True
            with open(self.path, encoding="utf-8") as fh:   # small; only when it changed
                keys = parse_keys(fh.read())
        except (OSError, ValueError) as exc:
            log.error("api keys file %s not (re)loaded, keeping %d keys: %s", self.path,
                      len(self._keys), exc)
            return False
        if self._mtime != -1:
            log.info("api keys file %s reloaded: %d keys", self.path, len(keys))
        self._keys, self._mtime = keys, mtime
        return True

    def lookup(self, bearer: str) -> ApiKey | None:
        now = self.clock()
        if now - self._checked >= CHECK_EVERY_S:
            self._checked = now
            self._reload()
        return self._keys.get(hash_key(bearer)) if bearer else None

    def __len__(self) -> int:
        return len(self._keys)
