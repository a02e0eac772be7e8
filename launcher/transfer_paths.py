"""Which KV transfer each sender-receiver pair of a deployment uses, said at start-up.

A receiver names its transfer (`--kv-transfer`, `auto` resolved by the engine: shm on CPU,
cuda_ipc on a GPU); the sender writes that way. `microserve up` prints one line per pair that
a strategy may send over (a prefill or "any" engine to a decode or "any" one):

    KV transfer: prefill-0 (cuda:0) -> decode-0 (cuda:1): cuda_ipc, across GPUs (the sender's
    copy kernel stores into the receiver's pool, peer-mapped into its GPU)

docs/microserving.md says when to pick which.
"""

from __future__ import annotations


def _path(sender: str, receiver: str, kind: str) -> str:
    if kind == "none":
        return "none (the receiver takes no KV: P/D to it fails)"
    if kind == "tcp":
        return "tcp (bytes through the receiver's listener; any two hosts)"
    if kind == "shm":
        if sender != "cpu":
            return "shm (the receiver's pool in CPU memory; a GPU sender copies through it)"
        return "shm (the sender writes the receiver's pool in shared memory)"
    if kind in ("cuda_ipc", "nvshmem"):
        if not sender.startswith("cuda"):
            return f"{kind}, but the sender is on {sender}: its sends fail (use tcp)"
        how = "the group's peer view" if kind == "nvshmem" else "CUDA IPC"
        if sender == receiver:
            return f"{kind}, on one GPU (one copy kernel between the pools, through {how})"
        return (f"{kind}, across GPUs (the sender's copy kernel stores into the receiver's pool, "
                f"mapped into its GPU through {how})")
    return kind


def transfer_lines(engines) -> list[str]:
    """One line per pair (sender, receiver) of `engines` (EngineHandles with `info`) that a
    P/D strategy may send over."""
    lines = []
    for s in engines:
        for r in engines:
            if s is r or s.info is None or r.info is None:
                continue
            if s.role not in ("prefill", "any") or r.role not in ("decode", "any"):
                continue
            path = _path(s.info.device, r.info.device, r.info.kv_transfer)
            sizes = (s.info.tensor_parallel_size, r.info.tensor_parallel_size)
            if sizes != (1, 1) and r.info.kv_transfer == "tcp":
                path += (f"; every head in each frame, gathered from {sizes[0]} rank(s) and "
                         f"split into {sizes[1]} by each side's rank 0")
            elif sizes != (1, 1) and r.info.kv_transfer != "none":
                path += (f"; heads from {sizes[0]} rank(s) to {sizes[1]}, rank 0's process "
                         f"copying for all of them")
            lines.append(f"KV transfer: {s.name} ({_where(s.info)}) -> {r.name} "
                         f"({_where(r.info)}): {path}")
    return lines


def _where(info) -> str:
    n = info.tensor_parallel_size
    return info.device if n == 1 else f"{info.device}, TP {n}"
