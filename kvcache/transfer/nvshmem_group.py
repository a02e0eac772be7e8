"""The NVSHMEM group of a deployment: who is in it, and how its members meet (docs/microserving.md,
"NVSHMEM: a fixed group").

An NVSHMEM group is fixed when it starts: every member calls one collective init with the
group's unique id, its rank and the group's size, then allocates its KV pool in the symmetric
heap at the same time as the others, in the same size. `microserve up` makes the group of the
engines whose args say `--kv-transfer nvshmem`: each gets its rank, the group's size and a
rendezvous directory private to this run of the deployment, through the environment
(GROUP_ENV, `RANK/SIZE@DIR`). In that directory the members meet:

    up: mkdtemp (0700)      engine of rank 0                   engine of rank r > 0
    ──────────────────      ────────────────                   ────────────────────
                            joined-0 must not exist            joined-r must not exist
                            pool-0 <- its pool's pages         pool-r <- its pool's pages
                            uid <- nvshmemx_get_uniqueid()     wait for uid (FORM_TIMEOUT_S)
                            init(uid, 0, size)  <── bootstrap: every rank phones rank 0 ──>
                            joined-0                           joined-r
                            pages = min(pool-*)                the same min
                            symmetric allocation (collective)  the same allocation

Why rank 0 makes the unique id, not `up`: the id is the address of a socket that a bootstrap
root thread listens on, in the process that made it (NVSHMEM's UID bootstrap, like NCCL's),
until every rank has phoned in. So the launcher needs no NVSHMEM, CUDA or GPU library.

Why the pools meet at the smallest: a symmetric allocation must be the same size on every PE,
and each engine sizes its pool from its own memory share; the members agree before allocating.

`joined-r` is what makes an engine that restarts (or a second engine handed the same rank)
fail at once with a clear error instead of waiting for a bootstrap that ended long ago: a PE
cannot join a running group (NVIDIA/nvshmem#68).

Plain Python, no torch: the launcher imports it.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

GROUP_ENV = "MICROSERVE_NVSHMEM_GROUP"  # RANK/SIZE@DIR, set by `microserve up`
FORM_TIMEOUT_S = 600.0  # how long a member waits for the others (they may load weights slowly)
HEAP_MARGIN_BYTES = 256 << 20  # NVSHMEM's own symmetric allocations, beyond the KV pool

_SPEC = re.compile(r"(\d+)/(\d+)@(/.+)")

CANNOT_JOIN = ("a PE cannot join a running NVSHMEM group: an engine started alone, added to a "
               "running deployment or restarted must receive KV with --kv-transfer cuda_ipc "
               "(GPUs of one host) or tcp")


class GroupError(RuntimeError):
    """This engine cannot take its place in its NVSHMEM group."""


@dataclass(frozen=True)
class GroupSpec:
    """One member's place: `rank` of `size` members meeting in the directory `rendezvous`."""

    rank: int
    size: int
    rendezvous: str

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"NVSHMEM group rank {self.rank} out of range for a group of "
                             f"{self.size}")
        if not os.path.isabs(self.rendezvous):
            raise ValueError(f"NVSHMEM group rendezvous {self.rendezvous!r} is not an absolute "
                             f"path")

    def __str__(self) -> str:
        return f"{self.rank}/{self.size}@{self.rendezvous}"

    @classmethod
    def parse(cls, text: str) -> GroupSpec:
        """`RANK/SIZE@DIR` (what GROUP_ENV holds) -> GroupSpec; ValueError if malformed."""
        m = _SPEC.fullmatch(text)
        if m is None:
            raise ValueError(f"{GROUP_ENV} {text!r} is not RANK/SIZE@DIR (e.g. 0/2@/tmp/group)")
        return cls(int(m[1]), int(m[2]), m[3])


def check_member(device: str, group: str | None) -> GroupSpec:
    """An engine's `--kv-transfer nvshmem` with its `device` and `group` (GROUP_ENV's value, or
    None) -> its place in the group; ValueError saying what is missing. No I/O."""
    if not device.startswith("cuda"):
        raise ValueError(f"--kv-transfer nvshmem needs the KV pool on a CUDA device, not "
                         f"{device}; CPU engines receive KV with shm or tcp")
    if group is None:
        raise ValueError(f"--kv-transfer nvshmem needs this engine's place in the NVSHMEM group "
                         f"of its deployment ({GROUP_ENV}=RANK/SIZE@DIR), which `microserve up` "
                         f"hands to every engine whose args say --kv-transfer nvshmem, all "
                         f"started together; {CANNOT_JOIN}")
    return GroupSpec.parse(group)


def group_specs(count: int, rendezvous: str) -> list[GroupSpec]:
    """The places of a group of `count` members, rank i for the i-th."""
    return [GroupSpec(rank, count, rendezvous) for rank in range(count)]


def group_id(uid: bytes) -> str:
    """A short name for the group made from `uid`: what a receiver's descriptor carries, so a
    sender can tell whether it belongs to the same group."""
    return hashlib.sha256(uid).hexdigest()[:16]


class Rendezvous:
    """One member's side of the rendezvous directory (see the module docstring)."""

    def __init__(self, spec: GroupSpec):
        self.spec = spec
        self.dir = Path(spec.rendezvous)

    def check_first_join(self) -> None:
        """Raise GroupError if this rank joined the group before (the engine restarted), or
        the rendezvous directory is gone (the deployment that made it stopped)."""
        if not self.dir.is_dir():
            raise GroupError(f"the NVSHMEM group's rendezvous directory {self.dir} does not "
                             f"exist (its deployment stopped?); {CANNOT_JOIN}")
        if (self.dir / f"joined-{self.spec.rank}").exists():
            raise GroupError(f"PE {self.spec.rank} of the NVSHMEM group in {self.dir} joined it "
                             f"before (this engine restarted?): {CANNOT_JOIN}; restart the "
                             f"whole deployment to form the group again")

    def offer_pool(self, pages: int, page_bytes: int) -> None:
        """Tell the others how many pages (of how many bytes, all layers) this member's pool
        would hold."""
        _write_once(self.dir / f"pool-{self.spec.rank}", f"{pages} {page_bytes}".encode(),
                    self.spec)

    def publish_uid(self, uid: bytes) -> None:
        """Rank 0: hand the group's unique id to the others."""
        assert self.spec.rank == 0, "only rank 0 makes the unique id"
        _write_once(self.dir / "uid", uid, self.spec)

    def wait_uid(self, timeout_s: float = FORM_TIMEOUT_S, poll_s: float = 0.05) -> bytes:
        """The unique id rank 0 published; GroupError if it has not within `timeout_s`."""
        path = self.dir / "uid"
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise GroupError(f"PE {self.spec.rank}: rank 0 of the NVSHMEM group in {self.dir} "
                                 f"did not publish the group's unique id within {timeout_s:g} s "
                                 f"(its engine failed to start?)")
            time.sleep(poll_s)
        return path.read_bytes()

    def mark_joined(self) -> None:
        (self.dir / f"joined-{self.spec.rank}").touch()

    def agreed_pages(self) -> int:
        """The fewest pages any member offered. Call after the group formed (every member
        offered its pool before it joined). GroupError, on every member alike, if their pages
        differ in size: the symmetric allocation would differ between PEs."""
        offers = []
        for rank in range(self.spec.size):
            path = self.dir / f"pool-{rank}"
            if not path.exists():
                raise GroupError(f"PE {rank} of the NVSHMEM group in {self.dir} joined without "
                                 f"offering its pool size")
            pages, page_bytes = map(int, path.read_text().split())
            offers.append((pages, page_bytes))
        if len({page_bytes for _, page_bytes in offers}) > 1:
            sizes = ", ".join(f"PE {rank}: {b}" for rank, (_, b) in enumerate(offers))
            raise GroupError(f"the engines of one NVSHMEM group must share their KV layout "
                             f"(model, dtype, page size): their KV pages differ in bytes ({sizes})")
        return min(pages for pages, _ in offers)


def _write_once(path: Path, data: bytes, spec: GroupSpec) -> None:
    """Write `path` whole, or fail with GroupError if it exists: another engine holds this
    place, or this one held it before."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)  # atomic, and refuses to replace an existing file
    except FileExistsError:
        raise GroupError(f"{path} exists: PE {spec.rank} of this NVSHMEM group started "
                         f"before; {CANNOT_JOIN}") from None
    finally:
        tmp.unlink()


_SIZE = re.compile(r"(\d+)\s*([kmgt]?)b?", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """NVSHMEM's size syntax (`1073741824`, `512M`, `2g`) in bytes; None if it is not one."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        return None
    return int(m[1]) << (10 * "kmgt".find(m[2].lower()) + 10 if m[2] else 0)


def nvshmem_env(environ: dict[str, str], pool_bytes: int) -> dict[str, str]:
    """The NVSHMEM variables a member sets before it makes or uses a unique id, given the
    environment it has: NVLink multicast off (it can take shared GPUs down), a symmetric heap
    sized to the pool plus NVSHMEM's own needs, the bootstrap on the loopback interface, no
    remote transport and no proxy thread (one host). Values the environment already holds are kept; ValueError if its heap is too small
    for the pool."""
    heap = pool_bytes + HEAP_MARGIN_BYTES
    out = {}
    if "NVSHMEM_DISABLE_NVLS" not in environ:
        out["NVSHMEM_DISABLE_NVLS"] = "1"
    if "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" not in environ:
        out["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = "lo"
    # One host, writes by our own kernel through peer views: no network transport, and no
    # proxy thread (it serves device-side NVSHMEM calls we never make, and spins on a core).
    if "NVSHMEM_REMOTE_TRANSPORT" not in environ:
        out["NVSHMEM_REMOTE_TRANSPORT"] = "none"
    if "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY" not in environ:
        out["NVSHMEM_DISABLE_LOCAL_ONLY_PROXY"] = "1"
    given = environ.get("NVSHMEM_SYMMETRIC_SIZE")
    if given is None:
        out["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
    elif (size := parse_size(given)) is not None and size < heap:
        raise ValueError(f"NVSHMEM_SYMMETRIC_SIZE={given} ({size} bytes) cannot hold this "
                         f"engine's KV pool of {pool_bytes} bytes plus {HEAP_MARGIN_BYTES} for "
                         f"NVSHMEM itself; unset it (the engine sizes the heap) or raise it")
    return out
