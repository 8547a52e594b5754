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
    ttft_slo_ms = 800               # the key's time-to-first-token objective; 0 = the model's
    tpot_slo_ms = 60                # its time per output token objective; 0 = the model's

Keys are random 32-byte tokens (``gpm_`` + URL-safe base64), so an unsalted SHA-256 is the
right storage (as for other high-entropy API tokens): the file does not reveal them. The file
is checked for changes at most once a second (a stat); a file that fails to parse keeps the
previous keys and logs the error.

A key's objectives apply to its requests that set none of their own, and replace the model's
(the router's ``slo_ttft_ms`` / ``slo_tpot_ms``); each is in [0, 3,600,000] ms
(``router.dispatch.slo`` resolves and acts on them).
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import math
import os
import secrets
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ROLES = ("client", "operator")
CHECK_EVERY_S = 1.0
MAX_SLO_MS = 3_600_000   # an objective of more than an hour is a mistake, not an objective

# The calling key's objectives, (ttft_slo_ms, tpot_slo_ms); (0, 0) without keys. Set by the
# key check (router.auth.interceptor) in the call's context, read by router.dispatch.slo.
current_key_slo: contextvars.ContextVar[tuple[float, float]] = contextvars.ContextVar(
    "gpumesh_key_slo", default=(0.0, 0.0))


@dataclass(frozen=True)
class ApiKey:
    name: str
    role: str = "client"
    models: frozenset[str] = frozenset()
    requests_per_s: float = 0.0
    burst: float = 0.0
    max_concurrency: int = 0
    tokens_per_s: float = 0.0
    ttft_slo_ms: float = 0.0   # 0 = none (the model's applies)
    tpot_slo_ms: float = 0.0


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
        slos = (float(k.get("ttft_slo_ms", 0.0)), float(k.get("tpot_slo_ms", 0.0)))
        if not all(math.isfinite(v) and 0 <= v <= MAX_SLO_MS for v in slos):
            raise ValueError(f"key {name!r}: ttft_slo_ms and tpot_slo_ms must be in "
                             f"[0, {MAX_SLO_MS}]")
        names.add(name)
        out[digest] = ApiKey(name, role, frozenset(str(m) for m in k.get("models", [])), rate,
                             burst, conc, tokens, *slos)
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
