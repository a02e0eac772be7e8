"""The router's parts on their own, to the exact value: prefix index, engine picking, strategy
host (load, swap, failures, in-flight accounting), and the balanced P/D split. No engines
here: tests/test_router_live.py runs the same parts against real engine processes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import textwrap

import msgspec
import pytest

from microserve.backend import BackendError, BackendUnavailable, MicroservingError
from microserve.messages import (AbortResponse, EngineInfo, EngineStats, GenerateChunk, KVAddr,
                                 Liveness, PrepRecvResponse, RemoteSendResponse, SamplingParams,
                                 StatsResponse, Usage, call_of)
from microserve.metrics import Registry
from router.backend import RETRY_AFTER_S, RouterBackend
from router.engine_handle import EngineHandle
from router.engines import EnginePool, EngineSpec, UnknownEngine
from router.host import (MODULE_PREFIX, StrategyHost, StrategyLoadError, StrategySource,
                         SwapInProgress, builtin_names)
from router.prefix_index import PrefixIndex

# ---- prefix index ----------------------------------------------------------------------------


def test_prefix_index_matches_whole_pages_per_engine():
    index = PrefixIndex(page_size=4)
    a = list(range(10))  # two whole pages and a partial one
    assert index.insert(a, "e1") == 8
    assert len(index) == 2
    b = list(range(8)) + [50, 51, 52, 53, 54]
    assert index.insert(b, "e2") == 12
    assert len(index) == 3  # the two shared pages and e2's own third page
    assert index.match(b) == {"e1": 8, "e2": 12}
    assert index.match(a[:7]) == {"e1": 4, "e2": 4}
    assert index.match([9, 9, 9, 9]) == {}
    assert index.engines_of(list(range(8))) == {"e1", "e2"}
    assert index.engines_of(b) == {"e2"}


def test_prefix_index_forget_and_remove_engine_prune_empty_nodes():
    index = PrefixIndex(page_size=2)
    index.insert([1, 2, 3, 4, 5, 6], "e1")
    index.insert([1, 2, 3, 4, 7, 8], "e2")
    assert len(index) == 4
    index.forget([1, 2, 3, 4, 5, 6], "e1", held=2)  # e1 said it holds only [1, 2]
    assert index.match([1, 2, 3, 4, 5, 6]) == {"e1": 2, "e2": 4}
    assert len(index) == 3  # [5, 6] held by nobody now
    index.remove_engine("e2")
    assert index.match([1, 2, 3, 4, 7, 8]) == {"e1": 2}
    assert len(index) == 1


def test_prefix_index_evicts_least_recently_used_leaves():
    index = PrefixIndex(page_size=1, max_pages=10)
    for i in range(10):
        index.insert([100 + i], "e1")  # ten one-page contexts, oldest first
    index.match([100])  # touch the oldest
    index.insert([200], "e1")  # 11 nodes: evict down to 10 - 10 // 10 = 9
    assert len(index) == 9
    kept = {t for t in [100 + i for i in range(10)] + [200] if index.match([t])}
    assert kept == {100, 200, 104, 105, 106, 107, 108, 109, 103}


def test_prefix_index_handles_deep_contexts_without_recursion():
    index = PrefixIndex(page_size=1)
    long = list(range(5000))
    index.insert(long, "e1")
    index.remove_engine("e1")
    assert len(index) == 0


# ---- picking engines -------------------------------------------------------------------------


def engine_info(**facts) -> EngineInfo:
    return EngineInfo(**{"model_name": "m", "model_dir": "/m", "device": "cpu",
                         "dtype": "float32", "vocab_size": 256, "max_model_len": 100,
                         "eos_token_ids": [0], "page_size": 4, "num_pages": 64,
                         "kv_capacity_tokens": 256, "max_num_batched_tokens": 512,
                         "max_num_seqs": 256, "kv_transfer": "shm", **facts})


def engine_load(**counts) -> EngineStats:
    """An engine's polled stats: zero but for `counts`."""
    return EngineStats(**{f.name: counts.get(f.name, 0) for f in dataclasses.fields(EngineStats)
                          if f.type in ("int", "float")})


def make_pool(*specs: tuple[str, str]) -> EnginePool:
    pool = EnginePool()
    for name, role in specs:
        handle = EngineHandle(EngineSpec(name, f"http://127.0.0.1:1/{name}", role), None, pool)
        handle.info, handle.live, handle.up = engine_info(), True, True
        pool._engines[name] = handle
        pool._down[name] = asyncio.Event()
    return pool


def test_round_robin_and_least_loaded_respect_roles_and_state():
    pool = make_pool(("p", "prefill"), ("d1", "decode"), ("d2", "decode"), ("a", "any"))
    assert [pool.round_robin("decode").name for _ in range(6)] == ["d1", "d2", "a"] * 2
    pool["d1"].open_generations = 2
    pool["d2"].open_generations = 1
    pool["a"].open_sends = 1
    pool["a"].load = engine_load(running=3, waiting=1)
    pool["d2"].load = engine_load(running=0, waiting=0)
    assert pool.least_loaded("decode").name == "d2"  # ties on open calls: fewer queued wins
    assert pool.least_loaded("prefill").name == "p"
    assert pool.least_loaded("prefill", exclude=("p",)).name == "a"
    pool.drain("d2")
    pool.mark_down(pool["a"], "gone")
    assert [e.name for e in pool.routable("decode")] == ["d1"]
    pool.mark_down(pool["d1"], "gone")
    with pytest.raises(BackendUnavailable, match="no engine with role 'decode' is up"):
        pool.least_loaded("decode")
    with pytest.raises(UnknownEngine, match="no engine named 'x'"):
        pool["x"]


def fallbacks(pool: EnginePool) -> dict[str, float]:
    return {labels[0]: value for labels, value in pool._fallbacks._values.items()}


def test_prefill_decode_leaves_out_engines_that_cannot_move_kv():
    """A tensor-parallel engine without a KV transfer (it reports kv_transfer none and its
    rank count) is neither P nor D: picked as the decode engine it serves the request whole;
    as a prefill engine it is passed over for another that can send. With one it is both."""
    pool = make_pool(("p", "prefill"), ("tp", "prefill"), ("d", "decode"))
    pool["tp"].info = engine_info(kv_transfer="none", tensor_parallel_size=2)
    pool["p"].open_sends = 1  # busier: least_loaded would take tp
    assert [e and e.name for e in pool.prefill_decode()] == ["p", "d"]
    pool["d"].info = engine_info(kv_transfer="none", tensor_parallel_size=2)
    assert [e and e.name for e in pool.prefill_decode()] == [None, "d"]
    assert not pool["d"].receives_kv and not pool["d"].sends_kv and pool["p"].sends_kv
    pool["d"].info = engine_info(kv_transfer="cuda_ipc", tensor_parallel_size=2)
    assert pool["d"].receives_kv and pool["d"].sends_kv


def test_prefill_decode_degrades_instead_of_failing():
    pool = make_pool(("p", "prefill"), ("d", "decode"))
    assert [e and e.name for e in pool.prefill_decode()] == ["p", "d"]
    assert fallbacks(pool) == {}
    pool.mark_down(pool["p"], "gone")  # no prefill engine: D serves the whole request
    assert [e and e.name for e in pool.prefill_decode()] == [None, "d"]
    assert fallbacks(pool) == {"prefill": 1}
    pool.mark_down(pool["d"], "gone")
    with pytest.raises(BackendUnavailable, match="no engine is up"):
        pool.prefill_decode()
    pool["p"].up = True  # no decode engine: the prefill engine serves it whole
    assert [e and e.name for e in pool.prefill_decode()] == [None, "p"]
    assert fallbacks(pool) == {"prefill": 1, "decode": 1}
    # Engines of role "any" are both; one alone is a plain engine, not a degraded P/D.
    pool = make_pool(("a1", "any"), ("a2", "any"))
    pool["a1"].open_generations = 1
    assert [e and e.name for e in pool.prefill_decode()] == ["a1", "a2"]
    pool.mark_down(pool["a1"], "gone")
    assert [e and e.name for e in pool.prefill_decode()] == [None, "a2"]
    assert fallbacks(pool) == {"prefill": 1}
    assert [e and e.name for e in make_pool(("a", "any")).prefill_decode()] == [None, "a"]


async def test_a_call_is_given_up_when_an_engine_it_depends_on_goes_down():
    pool = make_pool(("p", "prefill"), ("d", "decode"))
    cancelled = asyncio.Event()

    async def endless_send():
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    assert await pool.unless_down(["d"], asyncio.sleep(0, "sent"), "while sending") == "sent"
    call = asyncio.create_task(pool.unless_down(["d"], endless_send(), "while p sent it KV"))
    await asyncio.sleep(0.01)
    pool.mark_down(pool["d"], "connection refused")
    with pytest.raises(BackendUnavailable, match="engine d went down while p sent it KV"):
        await asyncio.wait_for(call, 1)
    assert cancelled.is_set()
    # Its stats alone do not bring it back: it must prove itself alive first (and until it
    # has, nothing goes there with the engine key).
    pool["d"].client = _Answers({"stats": msgspec.to_builtins(engine_load()),
                                 "info": msgspec.to_builtins(engine_info())})
    await pool._poll(pool["d"])
    assert not pool["d"].up
    await pool._probe(pool["d"])
    await pool._poll(pool["d"])  # once it answers a poll again, calls watch it afresh
    assert pool["d"].up and not pool._down["d"].is_set()


class _Answers:
    base_url = "http://127.0.0.1:1/d"

    def __init__(self, stats: dict):
        self._stats = msgspec.convert(stats, StatsResponse)

    async def stats(self) -> StatsResponse:
        return self._stats

    async def live(self, challenge: str) -> Liveness:
        return Liveness(core_silent_s=0.1, steps=3, in_step_s=0.0)


def test_engine_spec_refuses_bad_fields():
    with pytest.raises(ValueError, match="role 'both' is not one of"):
        EngineSpec("e", "http://h:1", "both")
    with pytest.raises(ValueError, match="must start with http://"):
        EngineSpec("e", "h:1")


# ---- strategy host ---------------------------------------------------------------------------

COUNTING = """
from router.strategy import Strategy

STOPPED = []

class Counting(Strategy):
    def __init__(self, label="a"):
        if not label:
            raise ValueError("label must not be empty")
        self.label = label

    async def generate(self, request, engines):
        yield None

    async def stop(self):
        STOPPED.append(self.label)
"""


async def test_host_loads_builtins_files_and_uploads_into_fresh_modules(tmp_path):
    host = StrategyHost(make_pool(("e", "any")))
    assert builtin_names() == ["auto", "balanced_pd", "context_migration", "data_parallel",
                               "lora_affinity", "pd"]
    first = await host.load(StrategySource.builtin("pd"))
    assert (first.version, first.name, first.source.origin) == (1, "PrefillDecode", "builtin:pd")
    path = tmp_path / "mine.py"
    path.write_text(COUNTING)
    second = await host.load(StrategySource.parse(str(path)), {"label": "b"})
    assert host.active is second and second.version == 2 and second.instance.label == "b"
    second_module = sys.modules[second.module]
    third = await host.load(StrategySource.upload(COUNTING), {"label": "c"})
    # Two loads of the same code are two modules: no shared globals.
    assert type(third.instance) is not type(second.instance)
    assert sys.modules[third.module] is not second_module
    await asyncio.sleep(0)  # retired instances with nothing in flight stop at once
    assert second_module.STOPPED == ["b"]
    assert second.module not in sys.modules
    await host.close()
    assert not any(m.startswith(MODULE_PREFIX) for m in sys.modules)


@pytest.mark.parametrize("code, args, message", [
    ("def broken(:\n", {}, r"failed to load: SyntaxError: .* line 1"),
    ("raise RuntimeError('boom at import')\n", {}, r"RuntimeError: boom at import"),
    (COUNTING, {"label": ""}, r"Counting\(\*\*\{'label': ''\}\) failed: ValueError: label must"),
    (COUNTING, {"colour": "red"}, r"unexpected keyword argument 'colour'"),
    ("x = 1\n", {}, r"must define exactly one Strategy subclass.*found: none"),
    (COUNTING + "\nclass Other(Counting):\n    pass\n", {}, r"found: Counting, Other"),
])
async def test_a_strategy_that_fails_to_load_leaves_the_active_one(code, args, message):
    host = StrategyHost(make_pool(("e", "any")))
    active = await host.load(StrategySource.builtin("data_parallel"))
    with pytest.raises(StrategyLoadError, match=message):
        await host.load(StrategySource.upload(code), args)
    assert host.active is active and host.failed_loads == 1
    assert [m for m in sys.modules if m.startswith(MODULE_PREFIX)] == [active.module]
    await host.close()


async def test_a_failing_start_stops_the_instance_and_keeps_the_old_one():
    code = COUNTING + textwrap.dedent("""
        class Starting(Counting):
            async def start(self, engines):
                raise OSError("no such thing")
    """)
    host = StrategyHost(make_pool(("e", "any")))
    active = await host.load(StrategySource.builtin("data_parallel"))
    with pytest.raises(StrategyLoadError, match=r"Starting.start\(\) failed: OSError: no such"):
        await host.load(StrategySource.upload(code), {"label": "s"}, class_name="Starting")
    assert host.active is active
    await host.close()


async def test_swap_waits_for_in_flight_requests_before_stopping_the_old_instance():
    host = StrategyHost(make_pool(("e", "any")))
    old = await host.load(StrategySource.upload(COUNTING), {"label": "old"})
    held = [host.acquire(), host.acquire()]
    new = await host.load(StrategySource.upload(COUNTING), {"label": "new"})
    assert host.acquire() is new
    assert host.retired == [old] and old.inflight == 2
    stopped = sys.modules[old.module].STOPPED  # the list the old instance's stop() appends to
    host.release(held[0], finished=True)
    await asyncio.sleep(0)
    assert stopped == [] and old.inflight == 1
    host.release(held[1], finished=False)
    await asyncio.sleep(0)
    assert stopped == ["old"] and host.retired == []
    assert (old.started, old.finished, old.failed) == (2, 1, 1)
    await host.close()


async def test_a_second_load_while_one_is_loading_is_refused():
    release = asyncio.Event()
    code = COUNTING + textwrap.dedent("""
        class Slow(Counting):
            async def start(self, engines):
                await engines.release.wait()
    """)
    pool = make_pool(("e", "any"))
    pool.release = release  # what the slow start waits for
    host = StrategyHost(pool)
    loading = asyncio.create_task(host.load(StrategySource.upload(code), class_name="Slow"))
    await asyncio.sleep(0.01)
    with pytest.raises(SwapInProgress):
        await host.load(StrategySource.builtin("pd"))
    release.set()
    loaded = await loading
    assert host.active is loaded and loaded.name == "Slow"
    await host.close()


async def test_watch_reloads_a_changed_file_with_the_same_args(tmp_path):
    path = tmp_path / "watched.py"
    path.write_text(COUNTING)
    host = StrategyHost(make_pool(("e", "any")))
    first = await host.load(StrategySource.file(path), {"label": "w"})
    host.watch(interval_s=0.05)
    path.write_text(COUNTING.replace("STOPPED = []", "STOPPED = []\nEDITED = True"))
    import os
    os.utime(path, (first.mtime + 5, first.mtime + 5))
    for _ in range(100):
        await asyncio.sleep(0.02)
        if host.active is not first:
            break
    assert host.active.version == 2 and host.active.instance.label == "w"
    assert sys.modules[host.active.module].EDITED is True
    await host.close()


# ---- balanced P/D split ----------------------------------------------------------------------


def test_balanced_split_fixed_and_adaptive():
    from strategies.balanced_pd import BalancedPD

    pool = make_pool(("p", "prefill"), ("d", "decode"))
    p, d = pool["p"], pool["d"]
    fixed = BalancedPD(ratio=0.2)
    assert fixed.split(1000, p, d) == 800  # D prefills the last 200 tokens
    assert fixed.split(3, p, d) == 2  # at least the last token is D's
    adaptive = BalancedPD(adaptive="queues", min_ratio=0.1, max_ratio=0.4, decode_cost=10)
    assert adaptive.split(1000, p, d) == 600  # idle engines: half each, capped at 40% on D
    p.pending_prefill_tokens = 3000  # P is backed up: D takes its maximum
    assert adaptive.split(1000, p, d) == 600
    p.pending_prefill_tokens = 0
    d.pending_prefill_tokens, d.open_generations = 500, 30  # D is busy: 500 + 300 queued
    assert adaptive.split(1000, p, d) == 900  # (1000 + 800) / 2 = 900: 10%, the minimum
    d.pending_prefill_tokens, d.open_generations = 100, 30  # D's work 400: s = 1400 / 2
    assert adaptive.split(1000, p, d) == 700
    p.pending_prefill_tokens = 200  # s = (1000 + 400 - 200) / 2
    assert adaptive.split(1000, p, d) == 600
    d.open_generations, d.open_receives = 20, 10  # requests on their way to D count
    assert adaptive.split(1000, p, d) == 600
    d.open_receives = 30  # D's work 100 + 500: s = (1000 + 600 - 200) / 2
    assert adaptive.split(1000, p, d) == 700
    d.open_receives = 0
    with pytest.raises(ValueError, match="min_ratio 0.5, max_ratio 0.2"):
        BalancedPD(min_ratio=0.5, max_ratio=0.2)
    with pytest.raises(ValueError, match="adaptive must be false, true or \"queues\", got 'x'"):
        BalancedPD(adaptive="x")
    modelled = BalancedPD(ratio=0.3, adaptive=True)  # no stats yet: the fixed ratio
    assert modelled.split(1000, p, d) == 700
    with pytest.raises(ValueError, match=r"pick_step 0 must be within \(0, 1\]"):
        BalancedPD(adaptive=True, pick_step=0)


def test_the_adaptive_share_moves_pick_step_of_the_way_to_each_poll_s_pick():
    """Each poll (new engine stats) re-picks; with pick_step 0.5 the share used moves half way
    from the last one to the model's pick, and each is kept in describe()'s `picks`."""
    from router.balance_model import Prediction
    from strategies.balanced_pd import BalancedPD

    pool = make_pool(("p", "prefill"), ("d", "decode"))
    p, d = pool["p"], pool["d"]
    s = BalancedPD(ratio=0.3, adaptive=True, pick_step=0.5)
    picks = iter([0.2, 0.4, 0.4])
    s.model.observe = lambda *a, **k: None
    s.model.best = lambda *a: Prediction(next(picks), 1.0, 0.8, 0.01)
    s.model.rate = lambda: (18.0, 3000.0, 100.0)
    shares = []
    for poll in range(3):
        p.load = d.load = object()  # new stats: a poll
        shares.append(1000 - s.split(1000, p, d))
        assert 1000 - s.split(1000, p, d) == shares[-1]  # no new poll: the same share
    assert shares == [200, 300, 350]  # 0.2 at once, then half way to 0.4 twice
    assert [q[1:] for q in s.describe()["picks"]] == [
        [0.2, 0.2, 18.0, 0.8], [0.3, 0.4, 18.0, 0.8], [0.35, 0.4, 18.0, 0.8]]


def test_the_router_imports_no_torch():
    """A router host may have no GPU stack (docs/architecture.md, "Packages"): nothing of the
    engine, and of kvcache only the transfer package's torch-free modules (the launcher gives
    engines their NVSHMEM group and the deployment key)."""
    import subprocess

    code = ("import sys, router.server, router.admin, launcher.up, strategies.pd, "
            "strategies.balanced_pd, strategies.context_migration, strategies.data_parallel; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', "
            "'triton', 'engine', 'kvcache'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert set(out.stdout.split()) <= {"kvcache", "kvcache.transfer", "kvcache.transfer.auth",
                                       "kvcache.transfer.nvshmem_group"}, out.stdout


# ---- strategy files: only from the strategies directory, only regular files ------------------


async def test_strategy_paths_stay_inside_the_strategies_directory(tmp_path):
    root = tmp_path / "strategies"
    root.mkdir()
    (root / "mine.py").write_text(COUNTING)
    marker = tmp_path / "ran"
    outside = tmp_path / "outside.py"  # top-level code that must never run
    outside.write_text(f"open({str(marker)!r}, 'w').write('x')\n" + COUNTING)
    (root / "link.py").symlink_to(outside)
    refused = {
        str(outside): f"strategy path {str(outside)!r} is outside the strategies directory",
        "../outside.py": "strategy path '../outside.py' is outside the strategies directory",
        "link.py": "strategy path 'link.py' is outside the strategies directory",
        # An absent file outside gets the very same answer as a present one.
        str(tmp_path / "absent.py"): "is outside the strategies directory",
        "/etc/passwd": "strategy path '/etc/passwd' is outside the strategies directory",
        "notes.txt": "strategy path 'notes.txt' does not name a .py file",
    }
    for path, message in refused.items():
        with pytest.raises(StrategyLoadError, match=message.replace("(", r"\(")) as e:
            StrategySource.file(path, root=root)
        assert str(root) in str(e.value) or "does not name" in str(e.value)
    assert not marker.exists()
    host = StrategyHost(make_pool(("e", "any")))
    loaded = await host.load(StrategySource.file("mine.py", root=root), {"label": "m"})
    assert loaded.source.origin == f"file:{root.resolve() / 'mine.py'}"
    await host.close()


async def test_a_strategy_path_with_a_nul_is_a_400_naming_it(tmp_path):
    from fastapi import FastAPI
    from httpx import ASGITransport, AsyncClient

    from microserve.errors import install_error_handlers
    from router.admin import AdminAPI, add_admin_routes

    app = FastAPI()
    install_error_handlers(app)
    host = StrategyHost(make_pool(("e", "any")))
    add_admin_routes(app, AdminAPI(make_pool(("e", "any")), host, None, strategies_dir=tmp_path))
    async with AsyncClient(transport=ASGITransport(app), base_url="http://t") as http:
        r = await http.put("/admin/strategy", json={"path": "x\x00.py"})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "strategy path 'x\\x00.py' contains a NUL character",
                                  "type": "invalid_request_error", "param": "path", "code": None}}
    assert host.active is None
    await host.close()


async def test_strategy_files_that_are_not_regular_files_are_refused_without_blocking(
        tmp_path):
    root = tmp_path / "strategies"
    root.mkdir()
    fifo = root / "fifo.py"
    os.mkfifo(fifo)  # opened for reading, it would block until a writer came
    big = root / "big.py"
    big.write_text("x = 1\n" * 200_000)  # 1.2 MB
    binary = root / "binary.py"
    binary.write_bytes(b"\xff\xfe secret bytes")
    host = StrategyHost(make_pool(("e", "any")))
    cases = {
        "fifo.py": f"strategy file {fifo.resolve()} is not a regular file",
        "big.py": f"strategy file {big.resolve()} has 1200000 bytes, more than the 1048576",
        "binary.py": f"strategy file {binary.resolve()} is not UTF-8 text",
        "absent.py": f"cannot read strategy file {(root / 'absent.py').resolve()}: No such file",
    }
    for name, message in cases.items():
        with pytest.raises(StrategyLoadError) as e:
            await asyncio.wait_for(host.load(StrategySource.file(name, root=root)), 5)
        assert str(e.value).startswith(message), str(e.value)
        assert "secret" not in str(e.value)
    assert host.active is None and host.failed_loads == 4
    await host.close()


# ---- the admin API's guard -------------------------------------------------------------------


async def test_a_prefix_without_a_token_is_closed_and_one_with_a_token_needs_it():
    from fastapi import FastAPI
    from httpx import ASGITransport, AsyncClient

    from microserve.auth import RequireBearer

    app = FastAPI()
    app.add_api_route("/admin/engines", lambda: {"ok": True}, methods=["GET"])
    app.add_api_route("/v1/models", lambda: {"ok": True}, methods=["GET"])
    closed = RequireBearer(app, guards=[("/admin/", None)])
    async with AsyncClient(transport=ASGITransport(closed), base_url="http://t") as http:
        for headers in ({}, {"Authorization": "Bearer anything"}):
            r = await http.get("/admin/engines", headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "closed"
        assert (await http.get("/v1/models")).status_code == 200
    guarded = RequireBearer(app, guards=[("/admin/", "t0ken")])
    async with AsyncClient(transport=ASGITransport(guarded), base_url="http://t") as http:
        assert (await http.get("/admin/engines")).status_code == 401
        r = await http.get("/admin/engines", headers={"Authorization": "Bearer t0ken"})
        assert r.status_code == 200 and r.json() == {"ok": True}


def test_a_pool_of_one_deployment_refuses_another_deployments_engine():
    pool = EnginePool(deployment="m@8000-ab12")
    pool._check_same_model("e1", engine_info(deployment="m@8000-ab12", model_name="m"))
    for theirs in ("m@8000-ffff", None):
        with pytest.raises(ValueError) as e:
            pool._check_same_model("e1", engine_info(deployment=theirs, model_name="m"))
        assert str(e.value) == (f"engine 'e1' belongs to deployment {theirs!r}, not to this one "
                                "('m@8000-ab12'): another deployment's engine answers on its port")
    EnginePool()._check_same_model("e1", engine_info(deployment="anything"))  # a plain router: any


# ---- cleanup: abort once per engine a request touched and did not finish on -------------------


class FakeEngine:
    """EngineClient's generic `call`, made by the method of the call's name (its request's
    fields as its arguments)."""

    async def call(self, body):
        fields = {f.name: getattr(body, f.name) for f in dataclasses.fields(body)}
        return await getattr(self, call_of(body).name)(**fields)


class CountingClient(FakeEngine):
    """An engine client that answers pd's calls at once and counts aborts (a unit test of the
    router's cleanup; the live suites run real engines)."""

    def __init__(self, fail: bool = False, hang_send: bool = False):
        self.aborts, self.fail, self.hang_send = 0, fail, hang_send
        self.addressed = asyncio.Event()  # a remote_send without kv_addr waits for send_to

    async def prep_recv(self, request_id, prompt, end, lease_s=None, wait_s=None,
                        lora_name=None, own=None):
        n = range(len(prompt) + 1)[end]
        return PrepRecvResponse(matched=0, kv_addr=KVAddr(
            begin=0, end=n, ranges=[(0, n)], layout={}, transfer={}, window=(0, 1)))

    async def remote_send(self, request_id, prompt, begin, end, kv_addr, sampling=None,
                          queue_s=None, priority=0, lora_name=None):
        if self.hang_send:
            await asyncio.sleep(3600)
        if kv_addr is None:
            await self.addressed.wait()
        return RemoteSendResponse(sent=end - begin, computed=end - begin, reused=0,
                                  first_token=None if sampling is None else 1)

    async def send_to(self, request_id, begin, kv_addr):
        self.addressed.set()

    async def start_generate(self, request_id, prompt, begin, sampling, first_token=None,
                             queue_s=None, priority=0, first_token_delivered=False):
        yield GenerateChunk(token_ids=[1], cached_tokens=len(prompt) - 1)
        if self.fail:
            raise MicroservingError(500, "internal error in the engine step: ValueError")
        yield GenerateChunk(token_ids=[2], finish_reason="length", usage=Usage(
            prompt_tokens=len(prompt), completion_tokens=2, cached_tokens=len(prompt) - 1))

    async def abort(self, request_id, early_send=False):
        self.aborts += 1
        return AbortResponse(aborted=True)


RAISES_AFTER_SEND = """
from router.strategy import Strategy

class RaisesAfterSend(Strategy):
    async def generate(self, request, engines):
        recv = await engines["d"].prep_recv(request, end=-1)
        await engines["p"].remote_send(request, 0, -1, recv.kv_addr)
        raise ZeroDivisionError("a bug")
        yield
"""


async def aborts_when(end: str) -> dict[str, int]:
    """Run one P/D request through the router's backend, ended the way `end` says; the abort
    calls each engine got."""
    pool = make_pool(("p", "prefill"), ("d", "decode"))
    clients = {"p": CountingClient(hang_send=end == "disconnect during send"),
               "d": CountingClient(fail=end == "engine error")}
    for name, client in clients.items():
        pool[name].client = client
    host = StrategyHost(pool)
    if end == "strategy exception":
        await host.load(StrategySource.upload(RAISES_AFTER_SEND))
    else:
        await host.load(StrategySource.builtin("pd"))
    backend = RouterBackend(pool, host, "m", Registry(), max_retries=0)
    outputs = backend.generate("r1", list(range(20)), SamplingParams(max_tokens=2))
    try:
        if end == "disconnect during send":
            task = asyncio.ensure_future(anext(outputs))
            await asyncio.sleep(0.01)
            task.cancel()  # the client went away while P was sending
            await asyncio.gather(task, return_exceptions=True)
        elif end in ("normal", "engine error", "strategy exception"):
            async for _ in outputs:
                pass
        else:  # a stop string matched, or the client left: after the first token
            await anext(outputs)  # then the frontend closes the stream (finally)
    except (MicroservingError, BackendError):
        pass
    finally:
        await outputs.aclose()
    return {name: c.aborts for name, c in clients.items()}


@pytest.mark.parametrize("end, want", [
    ("normal", {"p": 0, "d": 0}),
    ("stop string", {"p": 0, "d": 1}),
    ("client disconnect", {"p": 0, "d": 1}),
    ("disconnect during send", {"p": 1, "d": 1}),
    ("engine error", {"p": 0, "d": 1}),
    ("strategy exception", {"p": 0, "d": 1}),
])
async def test_abort_goes_once_to_each_engine_still_holding_the_request(end, want):
    assert await aborts_when(end) == want


class PlacesGenerations(CountingClient):
    """Records the generations started on its engine, and ends each when `go` is set."""

    def __init__(self, started: list):
        super().__init__()
        self.started, self.go = started, asyncio.Event()

    async def start_generate(self, request_id, prompt, begin, sampling, first_token=None,
                             queue_s=None, priority=0, first_token_delivered=False):
        self.started.append(request_id)
        await self.go.wait()
        yield GenerateChunk(token_ids=[2], finish_reason="length")


async def test_the_choices_of_a_scored_prompt_go_to_the_engine_scoring_it():
    """Echo with logprobs is served whole on one engine: the n choices of a prompt all go to
    the engine its first choice went to (it scores the prompt once for all), whatever the
    load; another prompt, or the same one scored with another number of top tokens, goes to
    the least loaded; nothing is remembered once they end."""
    pool = make_pool(("a", "any"), ("b", "any"))
    started = {"a": [], "b": []}
    for name in started:
        pool[name].client = PlacesGenerations(started[name])
    host = StrategyHost(pool)
    await host.load(StrategySource.builtin("data_parallel"))
    backend = RouterBackend(pool, host, "m", Registry(), max_retries=0)
    scored, other = list(range(40)), list(range(1, 41))
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    runs = [("c0", scored, params), ("c1", scored, params), ("c2", scored, params),
            ("x", other, params), ("top2", scored, dataclasses.replace(params, prompt_logprobs=2))]
    gens = [backend.generate(rid, prompt, p) for rid, prompt, p in runs]
    tasks = []
    for gen in gens:
        tasks.append(asyncio.ensure_future(anext(gen)))
        await asyncio.sleep(0)  # started in this order
    await asyncio.sleep(0.01)
    # c0-c2 on a however loaded it is; x and top2 (other places) on the least loaded, b
    assert started == {"a": ["c0", "c1", "c2"], "b": ["x", "top2"]}
    assert len(backend._scoring._places) == 3
    for name in started:
        pool[name].client.go.set()
    assert all(chunk.finish_reason == "length" for chunk in await asyncio.gather(*tasks))
    for gen in gens:
        await gen.aclose()
    assert backend._scoring._places == {}


class QueuedInVain(CountingClient):
    """An engine that held the generation past its queue time: the engine's 503."""

    def __init__(self):
        super().__init__()
        self.queue_s = []

    async def start_generate(self, request_id, prompt, begin, sampling, first_token=None,
                             queue_s=None, priority=0, first_token_delivered=False):
        self.queue_s.append(queue_s)
        raise MicroservingError(503, f"waited {queue_s:g} s for this engine to start computing "
                                f"request {request_id!r} (its queue_s): it is busy; retry "
                                "later", code="queue_timeout")
        yield


async def test_a_data_parallel_request_queued_past_the_queue_timeout_is_a_503_to_retry_later():
    """A data-parallel generation carries the router's queue timeout to its engine (as a
    remote_send does); the engine's 503 queue_timeout is not tried again (another engine's
    queue would only be waited in again) and tells the client when to come back."""
    pool = make_pool(("a", "any"), ("b", "any"))
    pool.queue_timeout_s = 0.4
    for name in ("a", "b"):
        pool[name].client = QueuedInVain()
    host = StrategyHost(pool)
    await host.load(StrategySource.builtin("data_parallel"))
    backend = RouterBackend(pool, host, "m", Registry(), max_retries=2)
    outputs = backend.generate("r1", list(range(20)), SamplingParams(max_tokens=2))
    with pytest.raises(MicroservingError) as error:
        await anext(outputs)
    await outputs.aclose()
    assert (error.value.status, error.value.code, error.value.retry_after) == (
        503, "queue_timeout", RETRY_AFTER_S)
    assert pool["a"].client.queue_s + pool["b"].client.queue_s == [0.4]  # one try


class Prioritized(CountingClient):
    """An engine that records the scheduling priority of each generation."""

    def __init__(self):
        super().__init__()
        self.priorities = []

    async def start_generate(self, request_id, prompt, begin, sampling, first_token=None,
                             queue_s=None, priority=0, first_token_delivered=False):
        self.priorities.append(priority)
        yield GenerateChunk(token_ids=[1], finish_reason="length")


async def test_the_clients_priority_reaches_the_engine():
    pool = make_pool(("a", "any"))
    pool["a"].client = Prioritized()
    host = StrategyHost(pool)
    await host.load(StrategySource.builtin("data_parallel"))
    backend = RouterBackend(pool, host, "m", Registry())
    for priority in (3, 0, -2):
        [chunk async for chunk in backend.generate(f"r{priority}", [5, 6], SamplingParams(),
                                                   priority)]
    assert pool["a"].client.priorities == [3, 0, -2]


# ---- an engine marked down ends its streams; DNS names ---------------------------------------


class _SlowStream:
    """An engine client whose start_generate yields one chunk, then one more when `go` is set
    (an engine cut off never sets it), then the finishing chunk."""

    def __init__(self):
        self.go = asyncio.Event()

    async def start_generate(self, request_id, prompt, begin, sampling, first_token=None,
                             queue_s=None, priority=0, first_token_delivered=False):
        yield GenerateChunk(token_ids=[1])
        await self.go.wait()
        yield GenerateChunk(token_ids=[2])
        yield GenerateChunk(token_ids=[3], finish_reason="length")

    def retire(self):
        pass


def _streaming_engine() -> tuple[EnginePool, EngineHandle, _SlowStream]:
    from router.strategy import Request

    pool = make_pool(("d", "decode"))
    client = pool["d"].client = _SlowStream()
    request = Request("r1", [5, 6, 7], SamplingParams())
    return pool, pool["d"].start_generate(request, begin=0), client


async def test_a_stream_from_an_engine_marked_down_fails_at_once():
    pool, chunks, _ = _streaming_engine()
    assert (await anext(chunks)).token_ids == [1]
    reading = asyncio.ensure_future(anext(chunks))  # waits for a chunk that never comes
    await asyncio.sleep(0.01)
    assert not reading.done()
    pool.mark_down(pool["d"], "no stats within 3 s")
    with pytest.raises(BackendUnavailable, match="engine d went down while generating r1"):
        await asyncio.wait_for(reading, 1)
    assert pool["d"].open_generations == 0


async def test_a_stream_from_an_engine_taken_out_of_the_pool_goes_on():
    pool, chunks, client = _streaming_engine()
    assert (await anext(chunks)).token_ids == [1]
    reading = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0.01)
    handle = pool.remove("d")  # DELETE /admin/engines/d, or discovery after a drain
    await asyncio.sleep(0.01)
    client.go.set()
    assert (await asyncio.wait_for(reading, 1)).token_ids == [2]
    assert [c.token_ids async for c in chunks] == [[3]]
    assert handle.open_generations == 0


def test_dns_names_parse_with_port_and_role():
    from router.discovery import DnsName

    assert DnsName.parse("microserve-decode") == DnsName("microserve-decode", 8000, "any")
    assert DnsName.parse("d.test:9000,decode") == DnsName("d.test", 9000, "decode")
    assert DnsName.parse("p,prefill").spec("10.0.0.7") == EngineSpec(
        "p@10.0.0.7", "http://10.0.0.7:8000", "prefill")
    assert DnsName.parse("p").spec("fd00::7").url == "http://[fd00::7]:8000"
    for bad, why in [("p:x", "port 'x' is not a number"), ("p:0", "port 0 not in 1..65535"),
                     ("p,gpu", "role 'gpu' is not one of"), (":80", "must be non-empty")]:
        with pytest.raises(ValueError, match=why):
            DnsName.parse(bad)


# ---- a handed-over first token goes to the client before the generating engine is called ----


class _HandOver:
    """start_generate of an engine that got the first token with the KV: emits it (unless told
    it was delivered: then `chunks` are what follows it), decodes."""

    def __init__(self, chunks: list[GenerateChunk]):
        self.chunks, self.called, self.delivered = chunks, asyncio.Event(), None

    async def start_generate(self, request_id, prompt, begin, sampling, first_token=None,
                             queue_s=None, priority=0, first_token_delivered=False):
        self.called.set()
        self.delivered = first_token_delivered
        for chunk in self.chunks:
            yield chunk

    def retire(self):
        pass


def _handing_over(chunks, **sampling):
    from router.strategy import Request

    pool = make_pool(("d", "decode"))
    client = pool["d"].client = _HandOver(chunks)
    request = Request("r1", [5, 6, 7], SamplingParams(**sampling))
    return pool["d"], client, request


@pytest.mark.parametrize(("sampling", "travels"), [
    ({"temperature": 0}, True), ({"temperature": 1.0}, True),
    ({"temperature": 1.0, "seed": 3}, False), ({"logprobs": 0}, False),
    ({"grammar": '{"grammars": []}'}, False), ({"repetition_penalty": 1.1}, False),
    ({"frequency_penalty": 0.5}, False), ({"presence_penalty": -0.5}, False),
    ({"logit_bias": ((5, 1.0),)}, False), ({"min_tokens": 1}, False),
])
def test_the_first_token_travels_only_without_state_kept_by_the_generating_engine(sampling,
                                                                                  travels):
    from router.strategy import Request

    assert Request("r1", [5, 6, 7], SamplingParams(**sampling)).first_token_travels is travels


async def test_a_handed_over_first_token_is_yielded_before_the_engine_is_called():
    usage = Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=3)
    d, client, request = _handing_over([  # the engine's stream after the delivered 9
        GenerateChunk([10]), GenerateChunk([11], finish_reason="length", usage=usage)])
    chunks = d.start_generate(request, begin=3, first_token=9)
    assert await anext(chunks) == GenerateChunk([9], cached_tokens=3)
    assert not client.called.is_set()
    assert [c async for c in chunks] == [GenerateChunk([10]), GenerateChunk(
        [11], finish_reason="length", usage=usage)]
    assert client.delivered is True  # the engine was told: 9 went to the client once
    assert d.open_generations == 0


async def test_a_delivered_first_token_that_reaches_max_tokens_ends_with_the_engines_finish():
    usage = Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=3)
    d, client, request = _handing_over([GenerateChunk([], finish_reason="length", usage=usage)],
                                       max_tokens=1)
    assert [c async for c in d.start_generate(request, begin=3, first_token=9)] == [
        GenerateChunk([9], cached_tokens=3),
        GenerateChunk([], finish_reason="length", usage=usage)]
    assert client.delivered is True


@pytest.mark.parametrize("first, sampling", [(0, {}), (4, {"stop_token_ids": (4,)})])
async def test_a_handed_over_stop_token_comes_from_the_engine_with_its_finish(first, sampling):
    last = GenerateChunk([first], finish_reason="stop", cached_tokens=3)  # eos of engine_info: 0
    d, client, request = _handing_over([last], **sampling)
    assert [c async for c in d.start_generate(request, begin=3, first_token=first)] == [last]
    assert client.delivered is False  # the engine emits it, with its finish
    d, client, request = _handing_over([GenerateChunk([], finish_reason="stop")], **sampling,
                                       ignore_eos=True)
    if not sampling:  # eos with ignore_eos does not stop: it goes first, as any token
        assert [c async for c in d.start_generate(request, begin=3, first_token=first)] == [
            GenerateChunk([first], cached_tokens=3), GenerateChunk([], finish_reason="stop")]
        assert client.delivered is True


async def test_emit_first_false_leaves_the_first_token_to_the_engine():
    d, client, request = _handing_over([GenerateChunk([9], cached_tokens=3),
                                        GenerateChunk([10], finish_reason="length")])
    chunks = [c async for c in d.start_generate(request, begin=3, first_token=9,
                                                emit_first=False)]
    assert client.called.is_set() and [c.token_ids for c in chunks] == [[9], [10]]
    assert client.delivered is False


# ---- send_prompt: P starts computing beside D's prep_recv ------------------------------------


class _Sender(FakeEngine):
    """P: a remote_send without kv_addr runs until send_to (or an abort, answered 409);
    an abort that comes before the send is in the engine finds nothing, and if it says it is
    for an early send, that send is refused when it comes (the race `_drop` relies on), as on
    a real engine."""

    def __init__(self, log: list):
        self.log, self.job, self.early, self.refused = log, None, None, False

    async def remote_send(self, request_id, prompt, begin, end, kv_addr, sampling=None,
                          queue_s=None, priority=0, lora_name=None):
        await asyncio.sleep(0.005)  # on its way: an abort may overtake it
        self.log.append(("p.remote_send", begin, end, kv_addr is None))
        if kv_addr is None and self.refused:
            self.refused = False
            raise MicroservingError(409, f"request {request_id!r} was aborted")
        self.job = asyncio.get_running_loop().create_future()
        if kv_addr is None:  # a send_to that overtook it was kept for it
            begin = self.early if self.early is not None else await self.job
        return RemoteSendResponse(sent=end - begin, computed=end, reused=0,
                                  first_token=None if sampling is None else 7)

    async def send_to(self, request_id, begin, kv_addr):
        self.log.append(("p.send_to", begin))
        if self.job is None:
            self.early = begin
        else:
            self.job.set_result(begin)

    async def abort(self, request_id, early_send=False):
        found = self.job is not None and not self.job.done()
        self.log.append(("p.abort", found, early_send))
        if found:
            self.job.set_exception(MicroservingError(409, f"request {request_id!r} was aborted"))
        else:
            self.refused = early_send
        return AbortResponse(aborted=found or early_send)


class _Receiver(FakeEngine):
    def __init__(self, log: list, matched: int = 8, full: bool = False):
        self.log, self.matched, self.full = log, matched, full

    async def prep_recv(self, request_id, prompt, end, lease_s=None, wait_s=None,
                        lora_name=None, own=None):
        self.log.append(("d.prep_recv", end, wait_s))
        if self.full and wait_s == 0:
            raise MicroservingError(503, "no KV pages free to receive 20 tokens")
        n = range(len(prompt) + 1)[end]
        matched = min(self.matched, n)
        return PrepRecvResponse(matched=matched, kv_addr=KVAddr(
            begin=matched, end=n, ranges=[(0, n - matched)] if n > matched else [],
            layout={}, transfer={}, window=(0, 1)))


async def _send_prompt(receiver: _Receiver, log: list, early: bool = True,
                       d_load: EngineStats | None = None, end: int | None = None):
    from router.strategy import Request

    pool = make_pool(("p", "prefill"), ("d", "decode"))
    pool["p"].client, pool["d"].client = _Sender(log), receiver
    pool["d"].load = d_load
    request = Request("r1", list(range(20)), SamplingParams(temperature=0))
    sent = await pool["p"].send_prompt(request, pool["d"], early=early, end=end)
    return sent, request


async def test_a_balanced_head_starts_on_p_beside_ds_prep_recv_and_samples_nothing():
    """Balanced P/D sends prompt[:14] (D computes the rest): P computes from the start while
    D reserves, and sends [8, 14) once told (D holds 8 tokens already)."""
    log = []
    (begin, first), request = await _send_prompt(_Receiver(log), log, end=14)
    assert (begin, first) == (14, None)
    assert log == [("d.prep_recv", 14, 0), ("p.send_to", 8), ("p.remote_send", 0, 14, True)]
    assert request.received_tokens == 6


async def test_a_receiver_holding_the_whole_head_computes_from_its_end():
    log = []
    assert (await _send_prompt(_Receiver(log, matched=20), log, end=14))[0] == (14, None)
    assert log == [("d.prep_recv", 14, 0), ("p.abort", False, True),
                   ("p.remote_send", 0, 14, True)]
    log.clear()  # one call after the other (no room now on D): the same answer
    assert (await _send_prompt(_Receiver(log, matched=20), log, early=False,
                               end=14))[0] == (14, None)
    assert log == [("d.prep_recv", 14, 60.0)]


@pytest.mark.parametrize("end", [0, 20, 25])
async def test_a_head_outside_the_prompt_is_refused(end):
    with pytest.raises(ValueError, match=f"head of {end} tokens"):
        await _send_prompt(_Receiver([]), [], end=end)


async def test_p_computes_beside_ds_prep_recv_and_is_told_where_to_send():
    log = []
    (begin, first), request = await _send_prompt(_Receiver(log), log)
    assert (begin, first) == (20, 7)
    # D's prep_recv went out first and did not wait; P's send, started without an address,
    # was overtaken on the way by its send_to (the engine keeps it for the send)
    assert log == [("d.prep_recv", 20, 0), ("p.send_to", 8), ("p.remote_send", 0, 20, True)]
    assert request.received_tokens == 12 and request.touched == {"p", "d"}


async def test_a_receiver_without_room_now_makes_the_send_wait_for_it_in_line():
    log = []
    (begin, first), _ = await _send_prompt(_Receiver(log, full=True), log)
    assert (begin, first) == (20, 7)
    assert log[0] == ("d.prep_recv", 20, 0)
    # one abort, which overtook the send on the way: the send is refused when it comes, and
    # the calls go one after the other then, under the same id
    assert log == [("d.prep_recv", 20, 0), ("p.abort", False, True),
                   ("p.remote_send", 0, 20, True), ("d.prep_recv", 20, 60.0),
                   ("p.remote_send", 8, 20, False)]


class _SlowReceiver(_Receiver):
    """D whose prep_recv answers when `go` is set."""

    def __init__(self, log: list):
        super().__init__(log)
        self.go = asyncio.Event()

    async def prep_recv(self, *args, **kwargs):
        await self.go.wait()
        return await super().prep_recv(*args, **kwargs)


async def test_a_d_that_kv_is_on_its_way_to_counts_as_loaded_until_its_generation_opens():
    """2P2D: while P computes a request for d1, d1 has a call coming, so the next pair goes
    to d2 (before, d1 looked idle until the generation opened and took every request of
    that second); the count is gone once the send ends, failed or not."""
    from router.strategy import Request

    log = []
    pool = make_pool(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"))
    receiver = _SlowReceiver(log)
    pool["p1"].client, pool["d1"].client = _Sender(log), receiver
    prefill, decode = pool.prefill_decode()
    assert (prefill.name, decode.name) == ("p1", "d1")
    request = Request("r1", list(range(20)), SamplingParams(temperature=0))
    sending = asyncio.ensure_future(prefill.send_prompt(request, decode, end=14))
    await asyncio.sleep(0.01)
    assert (pool["d1"].open_receives, pool["d1"].open_calls) == (1, 1)
    assert [(p.name, d.name) for p, d in [pool.prefill_decode()]] == [("p2", "d2")]
    assert next(e for e in pool.describe() if e["name"] == "d1")["open_receives"] == 1
    assert "microserve_router_engine_open_receives{engine=\"d1\"} 1" in pool.metrics_text()
    receiver.go.set()
    assert await sending == (14, None)
    assert pool["d1"].open_receives == 0
    # a send that fails leaves no count behind
    receiver.go.clear()
    sending = asyncio.ensure_future(prefill.send_prompt(
        Request("r2", list(range(20)), SamplingParams(temperature=0)), decode, end=14))
    await asyncio.sleep(0.01)
    sending.cancel()
    await asyncio.gather(sending, return_exceptions=True)
    assert pool["d1"].open_receives == 0 and pool["d1"].open_calls == 0


def test_auto_and_role_steering_count_requests_on_their_way_to_a_d_as_decoding():
    """`auto` prices D's TPOT from the sequences it decodes: those whose KV P is sending count
    (they decode there within the second), as in the pool's pick."""
    from router.prefix_index import PrefixIndex
    from router.strategy import Request
    from strategies.auto import Auto

    pool = make_pool(("p", "prefill"), ("d", "decode"))
    pool.prefix_index = PrefixIndex(page_size=4)
    pool["d"].open_generations, pool["d"].open_receives = 3, 2
    auto = Auto()
    loads = auto.loads(Request("r", list(range(8)), SamplingParams(temperature=0)), pool)
    assert [(e.name, e.decoding) for e in loads] == [("p", 0), ("d", 5)]
    assert auto.tpot_s(pool["d"]) == auto.model.tpot_s(loads[1])


async def test_a_receiver_holding_the_whole_prompt_computes_the_last_token_itself():
    log = []
    (begin, first), _ = await _send_prompt(_Receiver(log, matched=20), log)
    assert (begin, first) == (19, None)
    # the early send dropped with one abort (it overtook the send, which is then refused)
    assert log == [("d.prep_recv", 20, 0), ("p.abort", False, True),
                   ("p.remote_send", 0, 20, True)]


async def test_send_prompt_not_early_goes_one_call_after_the_other():
    log = []
    assert (await _send_prompt(_Receiver(log), log, early=False))[0] == (20, 7)
    assert log == [("d.prep_recv", 20, 60.0), ("p.remote_send", 8, 20, False)]


@pytest.mark.parametrize("d_load", [engine_load(kv_recv_waiting=1),  # a line: it would queue
                                    engine_load(kv_pages_free=3, kv_pages_cached=1)])  # 16 < 20
async def test_a_receiver_polled_without_room_gets_the_calls_in_order(d_load):
    log = []
    assert (await _send_prompt(_Receiver(log), log, d_load=d_load))[0] == (20, 7)
    assert log == [("d.prep_recv", 20, 60.0), ("p.remote_send", 8, 20, False)]


async def test_a_receiver_polled_with_room_gets_the_early_start():
    log = []
    d_load = engine_load(kv_pages_free=4, kv_pages_cached=1)  # 20 tokens of 4-token pages
    assert (await _send_prompt(_Receiver(log), log, d_load=d_load))[0] == (20, 7)
    assert log[0] == ("d.prep_recv", 20, 0)


def test_an_engine_handle_knows_its_seats_and_the_rate_its_calls_end(monkeypatch):
    """`seats` is the engine's --max-num-seqs once its info came; `ends_per_s` counts the
    sends and generations that ended there over the last ENDS_WINDOW_S (5 s), and forgets
    older ones as new ones end, whether or not anyone asks for the rate."""
    from router.engine_handle import ENDS_WINDOW_S
    d = make_pool(("d", "decode"))["d"]
    d.info = engine_info(max_num_seqs=8)
    assert d.seats == 8
    d.info = None
    assert d.seats is None
    clock = [100.0]
    monkeypatch.setattr("router.engine_handle.time.monotonic", lambda: clock[0])
    for t in (100.0, 101.0, 102.0, 103.0, 104.5):
        clock[0] = t
        d._ended()
    clock[0] = 105.0
    assert d.ends_per_s() == 5 / ENDS_WINDOW_S
    clock[0] = 106.2  # 100.0 and 101.0 are past the window
    assert d.ends_per_s() == 3 / ENDS_WINDOW_S
    for k in range(1000):  # ends nobody asks about do not pile up
        clock[0] = 200.0 + k
        d._ended()
    assert len(d._ends) == 6
