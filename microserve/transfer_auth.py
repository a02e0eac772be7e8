"""Who may move KV: the deployment's engines, and nobody else (docs/microserving.md, "Security").

Every engine of a deployment shares one engine key (the engines' `--api-key`, which `microserve
up` generates when none is given). From it each engine derives the *transfer key* (HMAC-SHA256
of the engine key under a fixed label, so the bearer token itself never signs anything) and
uses it three ways:

1. A receiver signs its transfer descriptor (`sign`): the pool's pid/fd/inode for shm, host and
   port for tcp. A sender opens a peer only from a descriptor whose signature verifies
   (`verify`), so a caller cannot point it at a file, a host or a port of their choosing.
2. A tcp listener and its sender prove to each other that they hold the key before any frame
   is read (`proof`, a challenge-response over fresh nonces from both sides).
3. A write names its window by an unguessable 63-bit tag (`new_window_tag`) that only the
   prep_recv answer carries: a peer that holds the key still cannot write into a window it
   was not given.

No torch here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

KEY_ENV = "MICROSERVE_KV_TRANSFER_KEY"  # how the engine frontend hands the key to its core
_LABEL = b"microserve kv transfer v1"
MAC_FIELD = "mac"
NONCE_BYTES = 16


class TransferAuthError(Exception):
    """A descriptor or a handshake that does not prove it comes from an engine holding the
    deployment's key."""


def transfer_key(engine_key: str) -> bytes:
    """The key engines sign descriptors and handshakes with, derived from the engine key."""
    if not engine_key:
        raise ValueError("the engine key must not be empty")
    return hmac.new(engine_key.encode(), _LABEL, hashlib.sha256).digest()


def _canonical(descriptor: dict) -> bytes:
    try:
        return json.dumps(descriptor, sort_keys=True, separators=(",", ":"),
                          allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TransferAuthError(f"malformed transfer descriptor: {e}") from None


def _mac(key: bytes, body: dict) -> str:
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def sign(descriptor: dict, key: bytes) -> dict:
    """The descriptor with its signature added."""
    return {**descriptor, MAC_FIELD: _mac(key, descriptor)}


def verify(descriptor: object, key: bytes | None) -> dict:
    """The descriptor without its signature, if the signature is this deployment's.

    Raises TransferAuthError (saying why, never echoing the descriptor) otherwise, or when this
    engine has no key to check with.
    """
    if key is None:
        raise TransferAuthError("this engine has no engine key (--api-key) to verify the "
                                "receiver's transfer descriptor with; KV transfer needs one")
    if not isinstance(descriptor, dict) or not isinstance(descriptor.get(MAC_FIELD), str):
        raise TransferAuthError("the transfer descriptor is not signed")
    body = {k: v for k, v in descriptor.items() if k != MAC_FIELD}
    if not hmac.compare_digest(descriptor[MAC_FIELD], _mac(key, body)):
        raise TransferAuthError("the transfer descriptor is not signed by an engine of this "
                                "deployment (a different or no engine key)")
    return body


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, role: bytes, mine: bytes, theirs: bytes) -> bytes:
    """What `role` (b"sender" or b"receiver") answers to the other side's nonce `theirs`."""
    return hmac.new(key, role + b"|" + theirs + b"|" + mine, hashlib.sha256).digest()


def new_window_tag() -> int:
    """A window's tag: never 0 (a free entry in the shm table), unguessable, fits an int64."""
    return secrets.randbits(63) | 1
