"""The batch API's parts on their own: the ordering (router/batches/order.py) to the exact
order, the SQLite store's states and owners, the input-line checks, and the API's 4xx answers
in-process (no engine)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from microserve.errors import install_error_handlers
from router.batches.api import MAX_LINES, BatchAPI, add_batch_routes
from router.batches.lines import parse_lines
from router.batches.order import (alternate, blend_order, build_tree, request_memory,
                                  shared_tokens, sharing_ratio)
from router.batches.store import SCHEMA_VERSION, Store

A, B, C = [1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5]

# -- ordering ------------------------------------------------------------------------------------


def test_tree_branches_where_prompts_part():
    root = build_tree([A + [10], A + [11], B, A])
    (a, b) = root.children
    assert (a.depth, a.items, [c.depth for c in a.children]) == (4, [3], [5, 5])
    assert [c.items for c in a.children] == [[0], [1]]
    assert (b.depth, b.items, b.children) == (4, [2], [])


def test_identical_prompts_share_a_node():
    root = build_tree([A, A, A])
    assert [(c.depth, c.items) for c in root.children] == [(4, [0, 1, 2])]


def test_dual_scanner_blends_short_and_long_outputs_and_keeps_each_side_a_dfs():
    # Two templates: A's questions want 16 tokens (compute-heavy), B's 900 (memory-heavy).
    prompts = [A + [10], B + [20], A + [11], B + [21], A + [12], B + [22]]
    outputs = [16, 900, 16, 900, 16, 900]
    ordering = blend_order(prompts, outputs)
    assert ordering.dfs == [0, 2, 4, 1, 3, 5]  # A's subtree (denser) first, each contiguous
    # Left (A, in DFS order) until the blend is compute-heavy, then right (B, backwards).
    assert ordering.order == [0, 5, 2, 3, 4, 1]
    assert ordering.shareable_tokens == 16  # 4 shared by each of A's and B's last two
    assert sharing_ratio(prompts, ordering) == 1.0  # two paths in use: a cache of 4 keeps both
    assert shared_tokens(prompts, ordering.order, window=1) == 0  # one path: none survives
    assert shared_tokens(prompts, range(6), window=1) == 0  # file order alternates templates
    assert shared_tokens(prompts, ordering.dfs, window=1) == 16  # DFS is the optimum
    # `alternate`: one from each end of the DFS in turn, each side still in DFS order
    assert alternate(ordering.dfs) == [0, 5, 2, 3, 4, 1]
    assert alternate(ordering.dfs[:5]) == [0, 3, 2, 1, 4]


def test_children_sorted_by_density_within_their_parent():
    # Under one shared prefix: a long-output leaf and a short one. The short one is denser.
    prompts = [A + [7, 7], A + [8, 8], C]
    outputs = [2000, 4, 4]
    ordering = blend_order(prompts, outputs)
    assert ordering.dfs == [2, 1, 0]  # C alone is densest; in A's subtree 1 before 0
    assert request_memory(6, 2000) > request_memory(6, 4)


def test_uniform_batch_keeps_the_dfs_optimum():
    prompts = [[t, *range(40, 50), i] for t in (1, 2, 3) for i in range(4)]
    ordering = blend_order(prompts, [32] * len(prompts))
    assert sorted(ordering.order) == list(range(12))
    assert ordering.shareable_tokens == 3 * 3 * 11
    assert sharing_ratio(prompts, ordering) == 1.0


def test_empty_and_mismatched():
    assert blend_order([], []).order == []
    with pytest.raises(ValueError, match="2 prompts but 1 output"):
        blend_order([A, B], [1])


# -- input lines -----------------------------------------------------------------------------


def test_each_bad_line_says_why():
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    rows = [b"{not json", json.dumps([1]).encode(), json.dumps({**good, "custom_id": ""}).encode(),
            json.dumps(good).encode(), json.dumps(good).encode(),
            json.dumps({**good, "custom_id": "b", "url": "/v1/chat/completions"}).encode(),
            json.dumps({**good, "custom_id": "c", "method": "GET"}).encode(),
            json.dumps({**good, "custom_id": "d", "body": {"stream": True}}).encode(), b"  "]
    parsed = parse_lines(b"\n".join(rows), "/v1/completions")
    assert [p.error["code"] if p.error else None for p in parsed] == [
        "invalid_json", "invalid_json", "missing_custom_id", None, "duplicate_custom_id",
        "invalid_url", "invalid_method", "invalid_body"]
    assert parsed[5].error["message"] == ("line 6: 'url' '/v1/chat/completions' is not the "
                                          "batch's endpoint '/v1/completions'")
    assert (parsed[3].body, parsed[3].raw_body) == ({"prompt": "x"}, b'{"prompt": "x"}')


# -- store -----------------------------------------------------------------------------------


def test_store_lines_move_once_and_survive_a_reopen(tmp_path):
    store = Store(tmp_path)
    batch = {"id": "batch-1", "status": "validating"}
    store.add_batch("k", batch)
    store.add_lines({**batch, "status": "in_progress"}, [
        (0, 1, "a", "pending", '{"prompt": "x"}', None), (1, 0, "b", "pending",
                                                            '{"prompt": "y"}', None),
        (2, -1, None, "failed", None, {"error": "bad"})])
    assert [r.custom_id for r in store.pending("batch-1")] == ["b", "a"]  # dispatch order
    store.finish_line("batch-1", 1, True, {"out": "y"})
    with pytest.raises(AssertionError, match="not pending"):
        store.finish_line("batch-1", 1, True, {"out": "again"})
    with pytest.raises(RuntimeError, match="in use by another router"):
        Store(tmp_path)
    store.close()
    store = Store(tmp_path)
    assert store.counts("batch-1") == {"pending": 1, "done": 1, "failed": 1}
    assert [r.idx for r in store.pending("batch-1")] == [0]
    assert store.results("batch-1", "done") == ['{"out": "y"}']
    assert store.batch("k", "batch-1")["status"] == "in_progress"
    assert store.batch("other", "batch-1") is None
    store.close()
    db = sqlite3.connect(tmp_path / "batches.sqlite3")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_newer_schema_is_refused(tmp_path):
    Store(tmp_path).close()
    sqlite3.connect(tmp_path / "batches.sqlite3").execute(
        f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match=f"schema {SCHEMA_VERSION + 1}, newer"):
        Store(tmp_path)


# -- the API in-process: owners, limits, a router without a data directory --------------------


class _Runner:
    def wake(self):
        pass

    def cancel(self, batch_id):
        pass


def _client(store: Store | None, key: str | None) -> httpx.AsyncClient:
    app = FastAPI()
    install_error_handlers(app)
    add_batch_routes(app, store and BatchAPI(store, _Runner(), key))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _upload(text: str) -> dict:
    return {"files": {"file": ("in.jsonl", text.encode())}, "data": {"purpose": "batch"}}


LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                   "body": {"prompt": "x"}})


async def test_files_and_batches_of_one_key_are_not_found_with_another(tmp_path):
    store = Store(tmp_path)
    async with _client(store, "key-a") as a, _client(store, "key-b") as b:
        made = (await a.post("/v1/files", **_upload(LINE))).json()
        assert made["bytes"] == len(LINE) and made["purpose"] == "batch"
        assert (await a.get(f"/v1/files/{made['id']}")).status_code == 200
        for path in (f"/v1/files/{made['id']}", f"/v1/files/{made['id']}/content"):
            r = await b.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert (await b.get("/v1/files")).json()["data"] == []
        r = await b.post("/v1/batches", json={"input_file_id": made["id"],
                                              "endpoint": "/v1/completions",
                                              "completion_window": "24h"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
        batch = (await a.post("/v1/batches", json={
            "input_file_id": made["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"})).json()
        assert (await b.get(f"/v1/batches/{batch['id']}")).status_code == 404
        assert (await b.delete(f"/v1/files/{made['id']}")).status_code == 404
        assert (await a.delete(f"/v1/files/{made['id']}")).json()["deleted"] is True
    store.close()


async def test_limits_and_bad_fields_get_4xx_naming_the_numbers(tmp_path):
    store = Store(tmp_path)
    async with _client(store, None) as c:
        r = await c.post("/v1/files", **_upload("\n".join([LINE] * (MAX_LINES + 1))))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (f"The file has {MAX_LINES + 1} lines; a batch "
                                                f"input file may have at most {MAX_LINES}")
        r = await c.post("/v1/files", files={"file": ("x", b"{}")}, data={"purpose": "tuning"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
        made = (await c.post("/v1/files", **_upload(LINE))).json()
        for body, param in (({"endpoint": "/v1/embeddings"}, "endpoint"),
                            ({"completion_window": "1h"}, "completion_window"),
                            ({"input_file_id": "file-nope"}, "input_file_id")):
            r = await c.post("/v1/batches", json={
                "input_file_id": made["id"], "endpoint": "/v1/completions",
                "completion_window": "24h", **body})
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
        r = await c.get("/v1/batches", params={"limit": 101})
        assert r.status_code == 400 and "[1, 100], got 101" in r.json()["error"]["message"]
    store.close()


async def test_without_a_data_dir_the_api_says_how_to_turn_it_on():
    async with _client(None, None) as c:
        for method, path in (("POST", "/v1/files"), ("GET", "/v1/batches/x")):
            r = await c.request(method, path)
            assert r.status_code == 501
            assert "--data-dir" in r.json()["error"]["message"]


# -- where the data directory comes from ----------------------------------------------------


def test_the_data_dir_comes_from_the_file_the_command_line_or_ups_default(tmp_path,
                                                                         monkeypatch):
    from launcher.cli import parser
    from launcher.deployment import load_deployment
    from launcher.options import router_settings
    from launcher.up import default_data_dir

    config = tmp_path / "deploy.toml"
    config.write_text('[[engines]]\nname = "e"\n[router]\ndata_dir = "/srv/batches"\n')
    assert load_deployment(config).router.data_dir == "/srv/batches"
    args = parser().parse_args(["up", str(config), "--data-dir", "/elsewhere"])
    assert load_deployment(config, data_dir=args.data_dir).router.data_dir == "/elsewhere"
    args = parser().parse_args(["router", "--engine", "e=http://h:1", "--data-dir", "/d",
                                "--batch-lines-per-engine", "3"])
    assert (router_settings(args).data_dir, router_settings(args).batch_lines_per_engine) == (
        "/d", 3)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir(8000) == tmp_path / "microserve" / "router-8000"


# -- admission: live requests take batch slots ---------------------------------------------------


async def test_each_live_request_in_flight_takes_a_batch_slot():
    import asyncio

    from router.batches.admission import Admission, LiveRequests

    admission = Admission(per_engine=3, engines=lambda: 2)
    release = asyncio.Event()
    app = FastAPI()

    async def slow():
        await release.wait()
        return {}

    app.add_api_route("/v1/completions", slow, methods=["POST"])
    app.add_middleware(LiveRequests, admission=admission)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        assert admission.cap() == 6 and admission.may_start(5) and not admission.may_start(6)
        live = [asyncio.create_task(c.post("/v1/completions")) for _ in range(2)]
        line = asyncio.create_task(c.post("/v1/completions",
                                          headers={Admission.HEADER: admission.secret}))
        forged = asyncio.create_task(c.post("/v1/completions",
                                            headers={Admission.HEADER: "guess"}))
        for _ in range(500):
            if admission.live == 3:
                break
            await asyncio.sleep(0.01)
        assert admission.cap() == 3  # two live requests and a forged batch header
        release.set()
        await asyncio.gather(*live, line, forged)
        assert (admission.live, admission.cap()) == (0, 6)
    crowded = Admission(per_engine=1, engines=lambda: 1)
    crowded.live = 10
    assert crowded.cap() == 1  # a batch always moves
    with pytest.raises(ValueError, match="batch_lines_per_engine 0 must be at least 1"):
        Admission(0, lambda: 1)


# -- a subtree's engine: data_parallel's prefix policy ------------------------------------------


def test_the_prefix_policy_sends_a_prefix_to_the_engine_holding_it_unless_it_is_crowded():
    from types import SimpleNamespace

    from test_router_units import make_pool

    from router.prefix_index import PrefixIndex
    from strategies.data_parallel import DataParallel

    pool = make_pool(("e1", "any"), ("e2", "any"))
    pool.prefix_index = PrefixIndex(page_size=4)
    template = [5, 6, 7, 8, 9, 10, 11, 12]
    pool.prefix_index.insert(template, "e2")
    strategy = DataParallel("prefix", imbalance=2)
    request = SimpleNamespace(prompt=template + [40], adapter=None)
    assert strategy._holder(request, pool).name == "e2"
    pool["e2"].open_generations = 2  # within the imbalance: still the holder
    assert strategy._holder(request, pool).name == "e2"
    pool["e2"].open_generations = 3  # crowded: the least loaded takes it
    assert strategy._holder(request, pool).name == "e1"
    pool["e2"].open_generations = 0
    pool["e1"].open_generations = 1
    assert strategy._holder(SimpleNamespace(prompt=[99, 98, 97, 96], adapter=None),
                            pool).name == "e2"
    assert strategy.describe() == {"policy": "prefix", "imbalance": 2}
    assert DataParallel().describe() == {"policy": "round_robin"}


# -- the runner over a stand-in app: resume, retry, expiry ---------------------------------------


def _runner_with(tmp_path, calls: list, priorities: list | None = None):
    from microserve.metrics import Registry
    from router.batches.admission import Admission
    from router.batches.runner import BatchRunner

    app = FastAPI()
    install_error_handlers(app)
    priorities = [] if priorities is None else priorities

    async def completions(raw: dict):
        calls.append(raw["prompt"])
        priorities.append(raw.get("priority"))
        if raw["prompt"] == [777]:
            raise RuntimeError("a bug in the app")
        if raw["prompt"] == [666] and calls.count([666]) == 1:
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        return {"id": f"cmpl-{len(calls)}", "choices": [{"text": str(raw["prompt"])}]}

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    store = Store(tmp_path)
    runner = BatchRunner(store, lambda: app, None, Registry(), Admission(2, lambda: 1), None)
    runner.retry_backoff_s = 0.0
    return store, runner


def _batch(store: Store, prompts: list[list[int]], expires_in: float = 3600) -> dict:
    data = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": p, "max_tokens": 4}}) + "\n"
                   for i, p in enumerate(prompts)).encode()
    made = store.add_file("", "in.jsonl", "batch", data)
    batch = {"id": "batch-t", "endpoint": "/v1/completions", "input_file_id": made["id"],
             "status": "validating", "expires_at": time.time() + expires_in}
    store.add_batch("", batch)
    return batch


async def test_the_runner_resumes_only_pending_lines_and_retries_a_5xx(tmp_path):
    calls = []
    store, runner = _runner_with(tmp_path, calls)
    prompts = [[1, 2], [666], [1, 3]]
    batch = _batch(store, prompts)
    await runner._validate(batch)
    first = store.pending("batch-t")[0]  # as if a router had finished one line and died
    store.finish_line("batch-t", first.idx, True, {"custom_id": first.custom_id})
    await runner._run(store.batch(None, "batch-t"))
    done = store.batch(None, "batch-t")
    assert done["status"] == "completed" and done["ordering"]["order"] == "blend"
    assert first.idx == 0  # the blend order here: [0, 1, 2] (one density: DFS, then [666])
    assert sorted(calls) == [[1, 3], [666], [666]]  # a 503 retried; line 0 never ran again
    out = [json.loads(x) for x in store.file_path(done["output_file_id"]).read_text().splitlines()]
    assert [row["custom_id"] for row in out] == ["c0", "c1", "c2"]
    assert out[1]["response"]["status_code"] == 200  # after one 503
    store.close()


async def test_each_order_the_router_offers_is_the_dispatch_order_it_stores(tmp_path):
    """`--batch-order`: the lines wait in the order's positions (what `pending` reads back),
    with the order named in the batch's `ordering`."""
    prompts = [A + [10], B + [20], A + [11], B + [21], A + [12]]
    outputs = [4] * 5  # each line's max_tokens (_batch's)
    ordering = blend_order(prompts, outputs)
    expected = {"blend": ordering.order, "alternate": alternate(ordering.dfs),
                "dfs": ordering.dfs, "file": [0, 1, 2, 3, 4]}
    for order, want in expected.items():
        calls = []
        store, runner = _runner_with(tmp_path / order, calls)
        runner.order = order
        batch = _batch(store, prompts)
        await runner._validate(batch)
        assert [row.idx for row in store.pending("batch-t")] == want, order
        assert store.batch(None, "batch-t")["ordering"]["order"] == order
        store.close()
    assert expected["alternate"] != expected["dfs"]


async def test_an_exception_in_the_app_is_the_lines_500_not_a_lost_line(tmp_path):
    calls = []
    store, runner = _runner_with(tmp_path, calls)
    await runner._run(_batch(store, [[777], [1]]))
    done = store.batch(None, "batch-t")
    assert done["status"] == "completed"
    assert sorted(calls) == [[1]] + [[777]] * 5  # tried once and retried four times
    [error] = [json.loads(x) for x in
               store.file_path(done["error_file_id"]).read_text().splitlines()]
    assert (error["custom_id"], error["response"]["status_code"]) == ("c0", 500)
    assert store.counts("batch-t") == {"pending": 0, "done": 1, "failed": 1}
    store.close()


async def test_an_expired_batch_reports_its_unrun_lines(tmp_path):
    calls = []
    store, runner = _runner_with(tmp_path, calls)
    await runner._run(_batch(store, [[1], [2]], expires_in=-1))
    done = store.batch(None, "batch-t")
    assert done["status"] == "expired" and calls == [] and done.get("output_file_id") is None
    errors = [json.loads(x) for x in
              store.file_path(done["error_file_id"]).read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("c0", "batch_expired"),
                                                                      ("c1", "batch_expired")]
    store.close()


def test_a_chain_of_turns_thousands_deep_orders_without_recursion():
    turns = [list(range(k)) for k in range(1, 3001)]  # each prompt extends the one before
    ordering = blend_order(turns, [8] * 3000)
    assert sorted(ordering.order) == sorted(ordering.dfs) == list(range(3000))
    assert ordering.dfs[:3] == [0, 1, 2]  # short turns are dense: the chain's top first


async def test_batch_lines_go_at_the_batch_priority_unless_they_chose_one(tmp_path):
    from router.batches.runner import BATCH_PRIORITY

    calls, priorities = [], []
    store, runner = _runner_with(tmp_path, calls, priorities)
    bodies = [{"prompt": [1], "max_tokens": 4}, {"prompt": [2], "max_tokens": 4, "priority": -5}]
    data = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                               "body": body}) + "\n" for i, body in enumerate(bodies))
    made = store.add_file("", "in.jsonl", "batch", data.encode())
    batch = {"id": "batch-t", "endpoint": "/v1/completions", "input_file_id": made["id"],
             "status": "validating", "expires_at": time.time() + 3600}
    store.add_batch("", batch)
    await runner._run(batch)
    assert store.batch(None, "batch-t")["status"] == "completed"
    # the first line goes behind live requests (priority 0); the second asked to go first
    assert dict(zip([c[0] for c in calls], priorities)) == {1: BATCH_PRIORITY, 2: -5}
    store.close()


async def test_the_runners_line_calls_run_off_the_event_loops_thread(tmp_path, monkeypatch):
    """Inserting a batch's lines, reading the pending ones, each line's committed result and
    the output files: none on the thread that serves live requests (a 10,000-line batch's
    insert and read held that thread ~1 s, and every live request waited it out)."""
    import threading

    calls, threads = [], {}
    store, runner = _runner_with(tmp_path, calls)
    loop_thread = threading.current_thread()
    for name in ("add_lines", "pending", "finish_line", "results_file"):
        method = getattr(Store, name)

        def spy(self, *args, _name=name, _method=method, **kwargs):
            threads.setdefault(_name, set()).add(threading.current_thread() is loop_thread)
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(Store, name, spy)
    await runner._run(_batch(store, [[1], [2], [3]]))
    assert store.batch(None, "batch-t")["status"] == "completed" and len(calls) == 3
    assert threads == dict.fromkeys(("add_lines", "pending", "finish_line", "results_file"),
                                    {False})
    store.close()


def test_the_trees_sort_key_orders_as_the_token_ids_do():
    """build_tree sorts prompts by a bytes key (a memcmp, not a GIL-holding walk over tuples):
    it must order exactly as the id sequences, prefixes and ids past 16 bits included; ids
    that do not fit 32 bits sort after every other prompt."""
    import random

    from router.batches.order import _sort_key

    rng = random.Random(5)
    heads = [[rng.randrange(2**32) for _ in range(rng.randrange(1, 40))] for _ in range(20)]
    prompts = [rng.choice(heads)[:rng.randrange(0, 40)]
               + [rng.choice((0, 255, 256, 65535, 65536, 2**31, 2**32 - 1, rng.randrange(2**32)))
                  for _ in range(rng.randrange(0, 6))] for _ in range(2000)]
    assert (sorted(range(2000), key=lambda i: (_sort_key(prompts[i]), i))
            == sorted(range(2000), key=lambda i: (prompts[i], i)))
    odd = [[5], [2**32], [-1, 3], [4, 4]]
    assert sorted(range(4), key=lambda i: (_sort_key(odd[i]), i)) == [3, 0, 2, 1]


async def test_a_live_request_is_not_queued_behind_a_batchs_first_lines(tmp_path):
    """The runner starts lines one loop turn at a time: a live request that arrives as a batch
    starts its 40 lines (all allowed at once) reaches the app before most of them, not after
    every one (the live TTFT spikes of 0.4 s beside a batch on an H100)."""
    from microserve.metrics import Registry
    from router.batches.admission import Admission
    from router.batches.runner import BatchRunner

    order: list[str] = []
    first_line = asyncio.Event()
    app = FastAPI()

    async def completions(raw: dict):
        order.append("live" if raw.get("live") else "line")
        first_line.set()
        await asyncio.sleep(0)
        return {"id": "x", "choices": [{"text": ""}]}

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    store = Store(tmp_path)
    runner = BatchRunner(store, lambda: app, None, Registry(), Admission(64, lambda: 1), None)
    batch = _batch(store, [[i + 1] for i in range(40)])
    await runner._validate(batch)

    async def live():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            await first_line.wait()  # arrives as the batch's first line reaches the app
            await client.post("/v1/completions", json={"prompt": [1], "live": True})

    await asyncio.gather(runner._dispatch(store.batch(None, "batch-t")), live())
    assert order.count("line") == 40 and order.index("live") < 10
    store.close()


async def test_a_line_that_ends_starts_the_next_at_once(tmp_path, monkeypatch):
    """With one line at a time, each line's end must wake the dispatcher: were it to wait for
    admission's poll instead (made an hour here), the 6 lines would never finish."""
    import asyncio

    from router.batches import admission

    monkeypatch.setattr(admission, "POLL_S", 3600.0)
    calls = []
    store, runner = _runner_with(tmp_path, calls)
    runner.admission = admission.Admission(1, lambda: 1)
    batch = _batch(store, [[1, i] for i in range(6)])
    await runner._validate(batch)
    await asyncio.wait_for(runner._run(store.batch(None, "batch-t")), 30)
    assert store.batch(None, "batch-t")["status"] == "completed"
    assert sorted(calls) == [[1, i] for i in range(6)]


async def test_a_poke_wakes_a_waiting_dispatcher_and_a_poll_ends_its_wait(monkeypatch):
    import asyncio

    from router.batches import admission

    gate = admission.Admission(1, lambda: 1)
    monkeypatch.setattr(admission, "POLL_S", 3600.0)
    waiting = asyncio.create_task(gate.changed())
    await asyncio.sleep(0)
    assert not waiting.done()
    gate.poke()
    await asyncio.wait_for(waiting, 5)
    monkeypatch.setattr(admission, "POLL_S", 0.01)
    await asyncio.wait_for(gate.changed(), 5)  # nothing pokes: the poll ends it
