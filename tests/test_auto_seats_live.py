"""`auto` and an engine's seats on a live router: `microserve up` with a prefill and a decode
engine of the tiny model, each running at most 2 sequences (--max-num-seqs 2). Six clients keep
more requests open than D has seats; D's steps stay short, so only its seats say it is full.
`auto` serves these short prompts whole (no handover to pay), so D alone decodes; with
flip_roles it turns P into a decode engine by decode_bound (P idles, no request went P/D, and
chat_like is held off), then runs requests whole on P while D's seats are taken; no request
fails, every answer is the same greedy text, and both engines end quiet."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from deployments import admin_session, engine_stats, up_prefill_decode

from bench.strategies import Bench, StrategyRun

ADMIN = "seats-admin"
ENGINE_ARGS = ["--num-pages", "256", "--max-model-len", "512", "--max-num-seqs", "2"]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
# a TPOT target no CPU step reaches, so that seats alone make D full; chat_like needs a
# million choices in its window: only decode_bound may flip
AUTO = {"builtin": "auto", "args": {
    "slo_tpot_ms": 10_000,
    "flip_roles": {"window_s": 1.0, "cooldown_s": 600, "min_requests": 1_000_000}}}


@pytest.fixture(scope="module")
def up(tiny_served_dir, tmp_path_factory):
    yield from up_prefill_decode(tmp_path_factory.mktemp("seats"), tiny_served_dir,
                                 ENGINE_ARGS, ADMIN)


@pytest.fixture
def admin(up, request):
    yield from admin_session(up, request, ADMIN)


async def test_a_decoder_out_of_seats_turns_p_to_decode_and_requests_run_whole_on_it(up, admin):
    r = admin.put("/admin/strategy", json=AUTO)
    assert r.status_code == 200, r.text
    p_url = up.engine_urls["p"]
    before = engine_stats(p_url, check=False)["stats"]["generation_tokens"]

    def flips() -> list[dict]:
        return admin.get("/admin/strategy").json()["active"]["settings"]["flip_roles"]["flips"]

    async def until_p_generated() -> None:
        """Until P has flipped and finished generations of its own (or 30 s)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = engine_stats(p_url, check=False)["stats"]["generation_tokens"] - before
            if await asyncio.to_thread(flips) and done >= 4 * 32:
                return
            await asyncio.sleep(0.2)

    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    answers: list[tuple[int, str]] = []
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            r = await http.post("/v1/completions", json=body)
            answers.append((r.status_code, r.json()["choices"][0]["text"]
                            if r.status_code == 200 else r.text))

    async def work() -> None:
        try:
            await until_p_generated()
        finally:
            stop.set()

    async with httpx.AsyncClient(base_url=up.url, timeout=60) as http:
        await asyncio.gather(work(), *(client(http) for _ in range(6)))

    assert {answer for answer in answers} == {(200, answers[0][1])}, answers[:3]
    assert [(f["engine"], f["from"], f["to"], f["reason"]) for f in flips()] == [
        ("p", "prefill", "decode", "decode_bound")]
    # P, a prefill engine at first, finished whole generations of 32 tokens after its flip
    assert engine_stats(p_url, check=False)["stats"]["generation_tokens"] - before >= 4 * 32
    described = admin.get("/admin/strategy").json()["active"]["settings"]
    assert described["chosen"]["whole"] >= 4
    read = described["last"]["engines"]  # what the model read of each engine, last request
    assert set(read) == {"p", "d"} and read["d"]["seats"] == read["p"]["seats"] == 2
    assert set(read["d"]) == {"queue", "decoding", "held", "calls", "seats", "ends_per_s",
                              "seat_wait_s", "step_s", "prompt_share"}
    roles = {e["name"]: (e["role"], e["added_role"])
             for e in admin.get("/admin/engines").json()["engines"]}
    assert roles == {"p": ("decode", "prefill"), "d": ("decode", "decode")}
    assert "engine p: role prefill -> decode (decode_bound) after" in up.log()
    def roles_now() -> dict[str, str]:
        return {e["name"]: e["role"] for e in admin.get("/admin/engines").json()["engines"]}

    # swapped out, auto gives P the role it had before its flip (P had no work to drain)
    assert admin.put("/admin/strategy", json={"builtin": "data_parallel"}).status_code == 200
    deadline = time.monotonic() + 30
    while roles_now() != {"p": "prefill", "d": "decode"}:
        assert time.monotonic() < deadline, roles_now()
        await asyncio.sleep(0.2)
    assert "engine p: role decode -> prefill (restore) after" in up.log()
    # bench.strategies swaps each strategy in on the roles the engines joined with, whoever
    # changed them (here an ops call)
    assert admin.post("/admin/engines/d/role", json={"role": "any"}).json()["flipped"]
    bench = Bench(up.url, None, ADMIN, args=None)
    try:
        await bench.use(StrategyRun("dp", "data_parallel"), ["p", "d"])
    finally:
        await bench.close()
    assert roles_now() == {"p": "prefill", "d": "decode"}
    assert admin.get("/admin/strategy").json()["active"]["class"] == "DataParallel"
