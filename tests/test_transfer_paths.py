"""launcher/transfer_paths.py: the KV transfer `microserve up` says each pair uses."""

from __future__ import annotations

from types import SimpleNamespace

from launcher.transfer_paths import transfer_lines


def engine(name, role, device, kind, tp=1):
    return SimpleNamespace(name=name, role=role, info=SimpleNamespace(
        device=device, kv_transfer=kind, tensor_parallel_size=tp))


def test_one_line_per_pair_a_strategy_may_send_over():
    engines = [engine("prefill-0", "prefill", "cuda:0", "cuda_ipc"),
               engine("decode-0", "decode", "cuda:1", "cuda_ipc"),
               engine("any-0", "any", "cuda:1", "nvshmem")]
    assert transfer_lines(engines) == [
        "KV transfer: prefill-0 (cuda:0) -> decode-0 (cuda:1): cuda_ipc, across GPUs (the "
        "sender's copy kernel stores into the receiver's pool, mapped into its GPU through "
        "CUDA IPC)",
        "KV transfer: prefill-0 (cuda:0) -> any-0 (cuda:1): nvshmem, across GPUs (the sender's "
        "copy kernel stores into the receiver's pool, mapped into its GPU through the group's "
        "peer view)",
        "KV transfer: any-0 (cuda:1) -> decode-0 (cuda:1): cuda_ipc, on one GPU (one copy "
        "kernel between the pools, through CUDA IPC)",
    ]


def test_cpu_pairs_and_mismatches_say_what_happens():
    cpu = [engine("p", "prefill", "cpu", "shm"), engine("d", "decode", "cpu", "shm")]
    assert transfer_lines(cpu) == ["KV transfer: p (cpu) -> d (cpu): shm (the sender writes "
                                   "the receiver's pool in shared memory)"]
    odd = [engine("p", "prefill", "cpu", "tcp"), engine("d", "decode", "cuda:0", "cuda_ipc")]
    assert transfer_lines(odd) == ["KV transfer: p (cpu) -> d (cuda:0): cuda_ipc, but the "
                                   "sender is on cpu: its sends fail (use tcp)"]


def test_pairs_of_tensor_parallel_engines_say_their_sizes():
    engines = [engine("prefill-tp2", "prefill", "cuda:0", "cuda_ipc", tp=2),
               engine("decode-0", "decode", "cuda:2", "cuda_ipc")]
    assert transfer_lines(engines) == [
        "KV transfer: prefill-tp2 (cuda:0, TP 2) -> decode-0 (cuda:2): cuda_ipc, across GPUs "
        "(the sender's copy kernel stores into the receiver's pool, mapped into its GPU through "
        "CUDA IPC); heads from 2 rank(s) to 1, rank 0's process copying for all of them"]
    across_hosts = [engine("p", "prefill", "cuda:0", "tcp"),
                    engine("d-tp2", "decode", "cuda:0", "tcp", tp=2)]
    assert transfer_lines(across_hosts) == [
        "KV transfer: p (cuda:0) -> d-tp2 (cuda:0, TP 2): tcp (bytes through the receiver's "
        "listener; any two hosts); every head in each frame, gathered from 1 rank(s) and split "
        "into 2 by each side's rank 0"]
