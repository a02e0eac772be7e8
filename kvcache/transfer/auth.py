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
4. A receiver signs the write grant of each kv_addr it answers (`grant_mac`): the window, the
   positions [begin, end), the slots they go to and the digest of the tokens the KV must be
   computed for (`kv_digest`). A sender checks it (`verify_grant`) before it opens anything,
   so a caller that edits the slots or sends another prompt's KV is refused before a byte
   moves; the sender leaves the digest of what it wrote in the window, and the receiver
   adopts the KV only if it is the one it asked for.

No torch here.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import secrets
import struct

KEY_ENV = "MICROSERVE_KV_TRANSFER_KEY"  # how the engine frontend hands the key to its core
_LABEL = b"microserve kv transfer v1"
MAC_FIELD = "mac"
NONCE_BYTES = 16
DIGEST_BYTES = 32  # kv_digest's length; the shm window table keeps one per window


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


def kv_digest(tokens: list[int], begin: int) -> bytes:
    """What the KV of positions [begin, len(tokens)) is computed from: a BLAKE2b digest of
    `begin` and *all* of `tokens`, since a position's KV depends on every token before it (KV
    of the right tokens after another prefix is another prompt's KV).

    Token ids must fit an int32 (the engine checked them against its vocabulary). Cost: the
    packing and the hash, ~10 ns a token (measured in docs/microserving.md, "Security").
    """
    packed = struct.pack(f"<q{len(tokens)}i", begin, *tokens)
    return hashlib.blake2b(packed, digest_size=DIGEST_BYTES).digest()


_GRANT = "kv_addr grant"  # keeps a grant's signature apart from a descriptor's


def grant_mac(grant: dict, key: bytes) -> str:
    """The receiver's signature over a kv_addr's write grant (`KVAddr.grant()`: begin, end,
    ranges, layout, window, digest and its transfer descriptor's signature). The ranges go in
    as a digest of their int64 packing: a long prompt's may be hundreds of pairs, which cost
    ~4x as much as JSON."""
    ranges = grant["ranges"]
    try:
        packed = struct.pack(f"<{2 * len(ranges)}q", *itertools.chain.from_iterable(ranges))
    except (struct.error, TypeError) as e:
        raise TransferAuthError(f"malformed kv_addr ranges: {e}") from None
    ranges_digest = hashlib.blake2b(packed, digest_size=DIGEST_BYTES).hexdigest()
    return _mac(key, {**grant, "signs": _GRANT, "ranges": ranges_digest})


def verify_grant(grant: dict, mac: object, key: bytes) -> bool:
    """Whether `mac` is this deployment's signature over `grant`."""
    try:
        return isinstance(mac, str) and hmac.compare_digest(mac, grant_mac(grant, key))
    except TransferAuthError:
        return False
