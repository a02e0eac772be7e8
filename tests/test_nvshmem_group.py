"""The nvshmem transfer backend without a GPU: the group `microserve up` hands out, how its
members meet in the rendezvous directory, the NVSHMEM environment, and the clear errors (a CPU
engine, an engine outside a group, a restarted member, a sender of another group, no
nvshmem4py). What needs NVSHMEM itself is in tests/test_gpu_nvshmem.py."""

from __future__ import annotations

import dataclasses

import sys
import threading
import time

import pytest
import torch

from engine.config import EngineConfig
from kvcache.transfer import KVLayout, TransferError, make_backend, open_peer
from kvcache.transfer import nvshmem as nvshmem_backend
from kvcache.transfer.nvshmem import Member, check_same_group
from kvcache.transfer.nvshmem_group import (
    CANNOT_JOIN,
    GROUP_ENV,
    HEAP_MARGIN_BYTES,
    GroupError,
    GroupSpec,
    Rendezvous,
    check_member,
    group_id,
    nvshmem_env,
    parse_size,
)
from kvcache.transfer.auth import grant_mac, sign, transfer_key
from launcher.deployment import load_deployment, with_nvshmem_group

KEY = transfer_key("test-engine-key")
LAYOUT = KVLayout("test-model", "bfloat16", page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


# ---- the group's place in the environment ------------------------------------------------------


def test_group_spec_round_trips_and_names_what_is_wrong():
    spec = GroupSpec.parse("1/3@/tmp/microserve-nvshmem-x")
    assert (spec.rank, spec.size, spec.rendezvous) == (1, 3, "/tmp/microserve-nvshmem-x")
    assert str(spec) == "1/3@/tmp/microserve-nvshmem-x"
    for bad in ("1/3", "a/2@/tmp/x", "0/2@relative", "", "0/2@"):
        with pytest.raises(ValueError, match="is not RANK/SIZE@DIR"):
            GroupSpec.parse(bad)
    with pytest.raises(ValueError, match="rank 2 out of range for a group of 2"):
        GroupSpec.parse("2/2@/tmp/x")


def test_an_engine_asking_for_nvshmem_needs_a_gpu_and_its_place_in_a_group():
    with pytest.raises(ValueError, match="needs the KV pool on a CUDA device, not cpu"):
        EngineConfig(model="m", kv_transfer="nvshmem", nvshmem_group="0/2@/tmp/g")
    with pytest.raises(ValueError) as e:  # started alone: the config fails before any loading
        EngineConfig(model="m", device="cuda", kv_transfer="nvshmem")
    assert f"({GROUP_ENV}=RANK/SIZE@DIR)" in str(e.value)
    assert "a PE cannot join a running NVSHMEM group" in str(e.value)
    assert "--kv-transfer cuda_ipc" in str(e.value) and "tcp" in str(e.value)
    config = EngineConfig(model="m", device="cuda:1", kv_transfer="nvshmem",
                          nvshmem_group="1/2@/tmp/g")
    assert config.resolved_kv_transfer() == "nvshmem"
    assert check_member("cuda:1", "1/2@/tmp/g") == GroupSpec(1, 2, "/tmp/g")


def test_make_backend_refuses_nvshmem_on_cpu_outside_a_group_or_without_a_key():
    with pytest.raises(ValueError, match="CPU engines receive KV with shm or tcp"):
        make_backend("nvshmem", LAYOUT, 2, "cpu", key=KEY, nvshmem_group="0/2@/tmp/g")
    with pytest.raises(ValueError, match="a PE cannot join a running NVSHMEM group"):
        make_backend("nvshmem", LAYOUT, 2, "cuda", key=KEY)
    with pytest.raises(ValueError, match="--kv-transfer nvshmem needs an engine key"):
        make_backend("nvshmem", LAYOUT, 2, "cuda", nvshmem_group="0/2@/tmp/g")


def test_a_gpu_engine_without_nvshmem4py_is_told_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "nvshmem", None)  # import nvshmem raises ImportError
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(ValueError, match="needs nvshmem4py .*pip install nvshmem4py-cu13.*"
                                         "--kv-transfer cuda_ipc"):
        make_backend("nvshmem", LAYOUT, 2, "cuda", key=KEY, nvshmem_group=f"0/2@{tmp_path}")
    assert not list(tmp_path.iterdir())  # nothing offered to the group


def test_up_hands_every_nvshmem_engine_its_rank_and_the_groups_size(tmp_path):
    config = tmp_path / "deploy.toml"
    config.write_text('''
[[engines]]
name = "p"
args = ["--device", "cuda", "--kv-transfer", "nvshmem", "--gpu-memory-utilization", "0.3"]
[[engines]]
name = "d-ipc"
args = ["--device", "cuda", "--kv-transfer", "cuda_ipc", "--gpu-memory-utilization", "0.3"]
[[engines]]
name = "d"
args = ["--device", "cuda:0", "--kv-transfer=nvshmem", "--gpu-memory-utilization", "0.3"]
''')
    launches = with_nvshmem_group(list(load_deployment(config).engines), "/tmp/rv")
    assert [launch.env.get(GROUP_ENV) for launch in launches] == ["0/2@/tmp/rv", None,
                                                                   "1/2@/tmp/rv"]


@pytest.mark.parametrize(("engines", "message"), [
    ([["--device", "cuda", "--kv-transfer", "nvshmem"], ["--device", "cuda"]],
     "only engines\\[0\\] has --kv-transfer nvshmem"),
    ([["--kv-transfer", "nvshmem"], ["--device", "cuda", "--kv-transfer", "nvshmem"]],
     "engines\\[0\\]: --kv-transfer nvshmem needs a GPU"),
])
def test_up_refuses_an_nvshmem_group_that_cannot_work(tmp_path, engines, message):
    config = tmp_path / "deploy.toml"
    config.write_text("\n".join(f'[[engines]]\nname = "e{i}"\nargs = {args!r}'.replace("'", '"')
                                for i, args in enumerate(engines)))
    with pytest.raises(ValueError, match=message):
        load_deployment(config)


@pytest.mark.parametrize("path", ["deploy/gpu-1p1d-shared-nvshmem.toml",
                                  "deploy/gpu-1p1d-nvshmem.toml"])
def test_the_shipped_nvshmem_deployments_form_a_group_of_two(path):
    deployment = load_deployment(path)
    launches = with_nvshmem_group(list(deployment.engines), "/tmp/rv")
    assert [(launch.role, launch.env[GROUP_ENV]) for launch in launches] == [
        ("prefill", "0/2@/tmp/rv"), ("decode", "1/2@/tmp/rv")]


def test_the_four_gpu_nvshmem_deployment_forms_one_group_of_four_in_file_order():
    deployment = load_deployment("deploy/gpu-2p2d-nvshmem.toml")
    launches = with_nvshmem_group(list(deployment.engines), "/tmp/rv")
    assert [(launch.name, launch.role, launch.config.device, launch.env[GROUP_ENV])
            for launch in launches] == [
        ("prefill-0", "prefill", "cuda:0", "0/4@/tmp/rv"),
        ("prefill-1", "prefill", "cuda:1", "1/4@/tmp/rv"),
        ("decode-0", "decode", "cuda:2", "2/4@/tmp/rv"),
        ("decode-1", "decode", "cuda:3", "3/4@/tmp/rv")]


# ---- the rendezvous ----------------------------------------------------------------------------


def test_members_meet_agree_on_the_smallest_pool_and_a_restart_cannot_rejoin(tmp_path):
    rank0, rank1 = (Rendezvous(GroupSpec(r, 2, str(tmp_path))) for r in (0, 1))
    for r in (rank0, rank1):
        r.check_first_join()
    got = {}
    waiter = threading.Thread(target=lambda: got.update(uid=rank1.wait_uid(timeout_s=10)))
    waiter.start()
    rank1.offer_pool(1000, 4096)
    rank0.offer_pool(900, 4096)
    time.sleep(0.1)
    rank0.publish_uid(b"\x01" * 128)
    waiter.join(10)
    assert got["uid"] == b"\x01" * 128
    for r in (rank0, rank1):
        r.mark_joined()
        assert r.agreed_pages() == 900
    with pytest.raises(GroupError, match="joined it before .this engine restarted") as e:
        rank1.check_first_join()
    assert CANNOT_JOIN in str(e.value)
    with pytest.raises(GroupError, match="PE 0 of this NVSHMEM group started before"):
        rank0.publish_uid(b"\x02" * 128)  # a second rank 0: the first one's id stays
    assert (tmp_path / "uid").read_bytes() == b"\x01" * 128
    assert group_id(b"\x01" * 128) != group_id(b"\x02" * 128)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "joined-0", "joined-1", "pool-0", "pool-1", "uid"]  # no temporary file left


def test_a_member_waits_for_rank_0_only_so_long(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="rank 0 of the NVSHMEM group .* did not publish the "
                                         "group's unique id within 0.2 s"):
        Rendezvous(GroupSpec(1, 2, str(tmp_path))).wait_uid(timeout_s=0.2)
    assert time.monotonic() - t0 < 2


def test_members_must_share_their_kv_layout(tmp_path):
    rank0, rank1 = (Rendezvous(GroupSpec(r, 2, str(tmp_path))) for r in (0, 1))
    rank0.offer_pool(100, 4096)
    rank1.offer_pool(100, 8192)
    for r in (rank0, rank1):  # every member fails alike, none allocates
        with pytest.raises(GroupError, match=r"differ in bytes \(PE 0: 4096, PE 1: 8192\)"):
            r.agreed_pages()


def test_a_deployment_that_stopped_leaves_no_group_to_join(tmp_path):
    with pytest.raises(GroupError, match="does not exist .its deployment stopped"):
        Rendezvous(GroupSpec(0, 2, str(tmp_path / "gone"))).check_first_join()


# ---- NVSHMEM's environment ---------------------------------------------------------------------


def test_nvshmem_env_turns_multicast_off_and_sizes_the_heap_to_the_pool():
    assert nvshmem_env({}, 1 << 30) == {
        "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
        "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1",
        "NVSHMEM_SYMMETRIC_SIZE": str((1 << 30) + HEAP_MARGIN_BYTES)}
    given = {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth0",
             "NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "0",
             "NVSHMEM_SYMMETRIC_SIZE": "4G"}
    assert nvshmem_env(given, 1 << 30) == {}  # what the operator set stays
    with pytest.raises(ValueError, match=r"NVSHMEM_SYMMETRIC_SIZE=1G \(1073741824 bytes\) cannot "
                                         r"hold this engine's KV pool of 1073741824 bytes"):
        nvshmem_env({"NVSHMEM_SYMMETRIC_SIZE": "1G"}, 1 << 30)
    assert [parse_size(s) for s in ("1024", "512M", "2g", "3k", "1 GB", "x")] == [
        1024, 512 << 20, 2 << 30, 3 << 10, 1 << 30, None]


# ---- senders: only members of the receiver's group ---------------------------------------------


def nvshmem_descriptor(group: str, pe: int = 1, npes: int = 2) -> dict:
    return sign({"kind": "nvshmem", "group": group, "pe": pe, "npes": npes, "pid": 1, "fd": 3,
                 "num_pages": 8, "num_windows": 4}, KEY)


def test_a_sender_outside_the_receivers_group_is_refused_before_opening_anything():
    local = torch.zeros(LAYOUT.pool_shape(8), dtype=torch.bfloat16)
    with pytest.raises(TransferError) as e:
        open_peer(nvshmem_descriptor("ab12"), local, LAYOUT, KEY)
    assert str(e.value).startswith("the receiver is PE 1 of NVSHMEM group ab12 and this engine "
                                   "is in no NVSHMEM group")
    assert "--kv-transfer cuda_ipc or tcp" in str(e.value)
    other = Member("cd34", 0, 2, local)
    with pytest.raises(TransferError, match="this engine is PE 0 of group cd34: a sender in "
                                            "another NVSHMEM group cannot write its pool"):
        check_same_group(nvshmem_descriptor("ab12"), other)
    with pytest.raises(TransferError, match="another NVSHMEM group"):  # same id, other size
        check_same_group(nvshmem_descriptor("cd34", npes=3), other)
    with pytest.raises(TransferError, match="names PE 5 of a group of 2"):
        check_same_group(nvshmem_descriptor("cd34", pe=5), other)
    check_same_group(nvshmem_descriptor("cd34"), other)  # a member: no error
    assert nvshmem_backend.member() is None  # nothing joined on this CPU


def test_remote_send_to_an_nvshmem_receiver_of_another_group_is_a_clear_502(tiny_model_dir):
    from engine.core import EngineCore
    from microserve.backend import MicroservingError

    p = EngineCore(EngineConfig(model=tiny_model_dir, kv_transfer="shm", page_size=4,
                                num_pages=32), transfer_key=KEY)
    d = EngineCore(EngineConfig(model=tiny_model_dir, kv_transfer="shm", page_size=4,
                                num_pages=32), transfer_key=KEY)
    try:
        prompt = list(range(3, 40))
        addr = d.exchange.prep_recv("x", prompt, -1, None).kv_addr
        real = {k: v for k, v in addr.transfer.items() if k != "mac"}
        addr = dataclasses.replace(addr, transfer=sign(
            {**real, "kind": "nvshmem", "group": "ab12", "pe": 1, "npes": 2}, KEY))
        # signed again as a whole, as the receiver signs it: only the group check is left
        addr = dataclasses.replace(addr, mac=grant_mac(addr.grant(), KEY))
        with pytest.raises(MicroservingError) as e:
            p.remote_send("x", prompt, 0, -1, addr)
        assert e.value.status == 502
        assert "the receiver is PE 1 of NVSHMEM group ab12 and this engine is in no NVSHMEM " \
               "group" in str(e.value)
        assert p.stats().kv_send_jobs == 0 and p.kv.pool.num_free == p.kv.pool.num_pages
        d.exchange.abort("x")
    finally:
        p.close()
        d.close()
