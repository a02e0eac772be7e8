"""A/B arms and role flips on a live router: `microserve up` with two tiny-model engines (one
deployment for the module). Requests land on the arm their key hashes to and /metrics counts
exactly those; a request in flight when the arms change finishes on the arm it started on; bad
bodies get a 4xx naming the field; a single strategy ends the experiment. A role flip waits for
the old role's work; `auto` flips roles by itself under sustained load, and no request fails."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import pytest
from deployments import admin_session, up_prefill_decode

from router.arms import pick

ADMIN = "ab-admin"
ENGINE_ARGS = ["--num-pages", "256", "--max-model-len", "512"]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
ARMS = [{"name": "a", "builtin": "data_parallel"}, {"name": "b", "builtin": "pd"}]
# data parallel that holds its last chunk back a while: a request certainly still in flight
# when the test changes the arms (the tiny model generates its 200 tokens in well under that)
SLOW = """
import asyncio
from router.strategy import Strategy

class HoldsTheEnd(Strategy):
    async def generate(self, request, engines):
        async for out in engines.round_robin().start_generate(request, begin=0):
            if out.finish_reason is not None:
                await asyncio.sleep(1.5)
            yield out
"""


@pytest.fixture(scope="module")
def up(tiny_served_dir, tmp_path_factory):
    yield from up_prefill_decode(tmp_path_factory.mktemp("ab"), tiny_served_dir, ENGINE_ARGS,
                                 ADMIN)


@pytest.fixture
def admin(up, request):
    # ends any experiment
    yield from admin_session(up, request, ADMIN, reset={"builtin": "data_parallel"})


def arm_counts(admin) -> dict[tuple[str, str], float]:
    text = admin.get("/metrics").text
    return {(arm, outcome): float(v) for arm, outcome, v in re.findall(
        r'^microserve_router_arm_requests_total\{arm="([^"]+)",outcome="([^"]+)"\} (\S+)$',
        text, re.M)}


async def completion(http: httpx.AsyncClient, headers: dict | None = None, user=None,
                     max_tokens: int = 6) -> list:
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **({"user": user} if user else {})}
    r = await http.post("/v1/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def test_each_key_runs_on_its_arm_and_metrics_count_each_arm(up, admin):
    r = admin.put("/admin/strategy", json={"arms": ARMS, "sticky_by": "header:X-User"})
    assert r.status_code == 200, r.text
    assert [a["weight"] for a in r.json()["arms"]] == [1.0, 1.0]
    before = arm_counts(admin)
    users = [f"user{i}" for i in range(12)]
    want = {"a": 0, "b": 0}
    for u in users:
        want["ab"[pick(f"header:{u}", [1, 1])]] += 1
    assert 0 < want["a"] < 12  # both arms get some
    async with httpx.AsyncClient(base_url=up.url, timeout=60) as http:
        texts = await asyncio.gather(*(completion(http, {"X-User": u}) for u in users),
                                     completion(http, {"X-User": users[0]}))
    assert len(set(texts)) == 1  # greedy: both arms give the same tokens
    want["ab"[pick(f"header:{users[0]}", [1, 1])]] += 1
    after = arm_counts(admin)
    for arm in "ab":
        assert after[(arm, "finished")] - before.get((arm, "finished"), 0) == want[arm]
        assert after.get((arm, "failed"), 0) == before.get((arm, "failed"), 0)
    state = admin.get("/admin/strategy").json()
    assert state["active"] is None
    arms = {a["name"]: a for a in state["experiment"]["arms"]}
    assert {n: a["requests"] for n, a in arms.items()} == want
    assert arms["b"]["strategy"]["class"] == "PrefillDecode"
    assert arms["a"]["ttft"]["n"] == want["a"] and arms["a"]["goodput"]["ci95"][1] <= 1
    assert "ttft" in state["experiment"]["differences"]["b-a"]
    assert 'microserve_router_arm_ttft_seconds_count{arm="a"}' in admin.get("/metrics").text

    # re-weighting through PATCH: b at 0 takes nothing new
    r = admin.patch("/admin/strategy/arms/b", json={"weight": 0})
    assert r.status_code == 200, r.text
    async with httpx.AsyncClient(base_url=up.url, timeout=60) as http:
        await asyncio.gather(*(completion(http, user=u) for u in users[:4]))
    assert arm_counts(admin)[("b", "finished")] == after[("b", "finished")]
    assert arm_counts(admin)[("a", "finished")] == after[("a", "finished")] + 4


async def test_a_request_in_flight_finishes_on_the_arm_it_started_on(up, admin):
    slow = {"name": "a", "source": SLOW, "filename": "holds_the_end.py"}
    r = admin.put("/admin/strategy", json={"arms": [slow, {**ARMS[1], "weight": 0}],
                                           "sticky_by": "user"})
    assert r.status_code == 200, r.text
    before = arm_counts(admin)
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "user": "zed"}
    async with httpx.AsyncClient(base_url=up.url, timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # it runs, on arm a
            # now a leaves the experiment: only b serves new requests
            r = await asyncio.to_thread(admin.put, "/admin/strategy",
                                        json={"arms": [ARMS[1]], "sticky_by": "user"})
            assert r.status_code == 200, r.text
            retired = admin.get("/admin/strategy").json()["retired"]
            assert [(s.get("arm"), s["inflight"]) for s in retired] == [("a", 1)]
            await completion(http, user="zed")  # the same user now gets b
            rest = [line async for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 200  # all of it
    after = arm_counts(admin)
    assert after[("a", "finished")] - before.get(("a", "finished"), 0) == 1
    assert after[("b", "finished")] - before.get(("b", "finished"), 0) == 1
    assert admin.get("/admin/strategy").json()["retired"] == []  # a's instance stopped


BAD = [
    ({"arms": ARMS + [ARMS[0]]}, 400, "arm names must be unique, got ['a', 'b', 'a']"),
    ({"arms": [{**ARMS[0], "weight": 0}]}, 400, "positive sum, got [0.0]"),
    ({"arms": [ARMS[0], {"name": "b", "builtin": "nope"}]}, 400, "no built-in strategy 'nope'"),
    ({"arms": [ARMS[0], {"name": "b", "builtin": "balanced_pd", "args": {"ratio": 7}}]}, 400,
     "arm 'b'"),
    ({"arms": [{**ARMS[0], "path": "x.py", "builtin": None}]}, 403, "--strategies-dir"),
    ({"arms": ARMS, "sticky_by": "cookie"}, 400, "got 'cookie'"),
]


def test_bad_arms_bodies_get_a_4xx_naming_the_field(up, admin):
    for body, status, message in BAD:
        r = admin.put("/admin/strategy", json=body)
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    r = admin.patch("/admin/strategy/arms/a", json={"weight": 1})
    assert r.status_code == 404 and "no experiment is running" in r.text
    assert admin.put("/admin/strategy", json={"arms": ARMS}).status_code == 200
    r = admin.patch("/admin/strategy/arms/zz", json={"weight": 1})
    assert r.status_code == 404 and "(arms: a, b)" in r.text
    assert admin.patch("/admin/strategy/arms/a", json={"weight": 0}).status_code == 200
    r = admin.patch("/admin/strategy/arms/b", json={"weight": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weight", r.text
    r = admin.patch("/admin/strategy/arms/b", json={"weight": -1})
    assert r.status_code == 400 and "greater than or equal to 0" in r.text
    # a single strategy ends the experiment
    r = admin.put("/admin/strategy", json={"builtin": "pd"})
    assert r.status_code == 200
    assert admin.get("/admin/strategy").json()["experiment"] is None


def test_microserve_ab_runs_an_experiment_prints_it_and_restores_the_strategy(up, admin):
    admin.put("/admin/strategy", json={"builtin": "balanced_pd", "args": {"ratio": 0.5}})
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "ab", "--base-url", up.url + "/v1",
         "--admin-token", ADMIN, "--arm", "a=data_parallel", "--arm", "b=pd@3",
         "--duration-s", "4", "--rate", "10", "--input-len", "8", "--output-len", "4",
         "--vocab", "256"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.startswith(("a ", "b "))}
    assert rows["a"][1:3] == ["DataParallel", "{}"] and rows["b"][1:3] == ["PrefillDecode", "{}"]
    assert rows["a"][3] == "1" and rows["b"][3] == "3"
    # 40 arrivals and the warm-up, by random request ids at weights 1:3 (with 20, arm a drew
    # none in about one run of 400 and the difference below had nothing to compare; with 40,
    # about one in 130,000)
    assert int(rows["a"][4]) + int(rows["b"][4]) == 41
    assert rows["a"][5] == rows["b"][5] == "0"  # none failed
    assert "difference b-a: goodput" in out.stdout
    assert "restored builtin:balanced_pd {'ratio': 0.5}" in out.stdout
    state = admin.get("/admin/strategy").json()
    assert state["experiment"] is None
    assert (state["active"]["class"], state["active"]["args"]) == ("BalancedPD", {"ratio": 0.5})


# holds its last chunk back on engine d: a generation open on d for a while
HOLDS_ON_D = SLOW.replace("engines.round_robin()", 'engines["d"]')


async def test_a_role_flip_waits_for_the_old_roles_work_then_flips(up, admin):
    r = admin.put("/admin/strategy", json={"source": HOLDS_ON_D, "filename": "holds_on_d.py"})
    assert r.status_code == 200, r.text
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=up.url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # generating on d
            # decode -> prefill: d's generation is decode work, waited for
            r = await asyncio.to_thread(admin.post, "/admin/engines/d/role",
                                        json={"role": "prefill", "wait_s": 10})
            rest = [line async for line in lines if line.startswith("data: ")]
    assert r.status_code == 200, r.text
    flip = r.json()
    assert (flip["from"], flip["to"], flip["flipped"], flip["left"]) == (
        "decode", "prefill", True, 0)
    assert 0.5 < flip["waited_s"] < 2.0  # the held second and a half, less what had passed
    assert rest[-1] == "data: [DONE]"
    roles = {e["name"]: (e["role"], e["state"]) for e in admin.get("/admin/engines").json()[
        "engines"]}
    assert roles == {"p": ("prefill", "up"), "d": ("prefill", "up")}
    # back: nothing of prefill's is open on d, so no wait; the same role again changes nothing
    back = admin.post("/admin/engines/d/role", json={"role": "decode"}).json()
    assert back["flipped"] and back["waited_s"] < 0.5
    assert not admin.post("/admin/engines/d/role", json={"role": "decode"}).json()["flipped"]
    metrics = admin.get("/metrics").text
    for old, new in (("decode", "prefill"), ("prefill", "decode")):
        assert (f'microserve_router_role_flips_total{{engine="d",from_role="{old}",'
                f'to_role="{new}",reason="ops"}} 1') in metrics
    # bad calls
    r = admin.post("/admin/engines/d/role", json={"role": "both"})
    assert r.status_code == 400 and "role" in r.text
    r = admin.post("/admin/engines/zz/role", json={"role": "any"})
    assert r.status_code == 404 and "no engine named 'zz'" in r.text
    r = admin.post("/admin/engines/d/role", json={"role": "any", "wait_s": -1})
    assert r.status_code == 400 and "wait_s" in r.text


# Short windows so that the test sees two flips in seconds; a handover priced at 0.5 s keeps
# `auto` choosing "whole" for these short prompts whatever the CPU's fit says (chat-like).
AUTO_FLIPS = {"builtin": "auto", "args": {
    "slo_tpot_ms": 10_000, "handover_s": 0.5,
    "flip_roles": {"window_s": 1.0, "cooldown_s": 1.0, "min_requests": 5}}}


async def test_auto_flips_roles_under_chat_like_load_and_no_request_fails(up, admin):
    """Sustained short requests: auto turns P, then D, to "any" (rule chat_like); then, load
    still on, an ops call turns P back to prefill, waiting for the generations it has."""
    r = admin.put("/admin/strategy", json=AUTO_FLIPS)
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["flip_roles"]["settings"]["window_s"] == 1.0

    def auto_flips() -> list[dict]:
        return admin.get("/admin/strategy").json()["active"]["settings"]["flip_roles"]["flips"]

    async def flips_then_ops_flip() -> dict:
        deadline = time.monotonic() + 20
        while len(await asyncio.to_thread(auto_flips)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        r = await asyncio.to_thread(admin.post, "/admin/engines/p/role",
                                    json={"role": "prefill", "wait_s": 2})
        assert r.status_code == 200, r.text
        return r.json()

    answers, ops = await load_while(up.url, flips_then_ops_flip())
    # no request failed, and each gave the same greedy tokens wherever it ran
    assert {(status, text) for status, text in answers} == {(200, answers[0][1])}
    assert len(answers) >= 10
    flips = auto_flips()
    assert [(f["engine"], f["from"], f["to"], f["reason"], f["left"]) for f in flips] == [
        ("p", "prefill", "any", "chat_like", 0), ("d", "decode", "any", "chat_like", 0)]
    assert all(f["waited_s"] < 0.5 for f in flips)  # to "any": nothing to wait for
    assert (ops["from"], ops["to"], ops["flipped"], ops["left"]) == ("any", "prefill", True, 0)
    assert ops["waited_s"] < 2.0  # p's generations of 8 tokens drained
    roles = {e["name"]: e["role"] for e in admin.get("/admin/engines").json()["engines"]}
    assert roles == {"p": "prefill", "d": "any"}
    metrics = admin.get("/metrics").text
    for name, old in (("p", "prefill"), ("d", "decode")):
        assert (f'microserve_router_role_flips_total{{engine="{name}",from_role="{old}",'
                f'to_role="any",reason="chat_like"}} 1') in metrics
        assert f"engine {name}: role {old} -> any (chat_like) after" in up.log()
    assert ('microserve_router_role_flips_total{engine="p",from_role="any",'
            'to_role="prefill",reason="ops"} 1') in metrics

    # swapped out with no request left, auto is stopped (its steering with it) once it gave
    # D back its role from before its flip; P's role, set by the ops call since, stands
    assert admin.put("/admin/strategy", json={"builtin": "data_parallel"}).status_code == 200
    assert admin.get("/admin/strategy").json()["retired"] == []
    deadline = time.monotonic() + 10  # the restoring is the stopping strategy's task
    while "engine d: role any -> decode (restore) after" not in up.log():
        assert time.monotonic() < deadline, up.log()[-2000:]
        await asyncio.sleep(0.1)
    roles = {e["name"]: e["role"] for e in admin.get("/admin/engines").json()["engines"]}
    assert roles == {"p": "prefill", "d": "decode"}
    assert "engine p: role any -> prefill (restore)" not in up.log()


async def load_while(url: str, work) -> tuple[list[tuple[int, str]], object]:
    """Four clients sending short completions back to back until `work` (a coroutine) is
    done; every answer's status and text, and what `work` returned."""
    answers: list[tuple[int, str]] = []
    done = asyncio.Event()
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}

    async def client(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            r = await http.post("/v1/completions", json=body)
            answers.append((r.status_code, r.json()["choices"][0]["text"]
                            if r.status_code == 200 else r.text))

    async def run_work():
        try:
            return await work
        finally:
            done.set()

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        result, *_ = await asyncio.gather(run_work(), *(client(http) for _ in range(4)))
    return answers, result
