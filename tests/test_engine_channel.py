"""start_generate's chunks on a channel (GET /microserving/channel/{id}), against a real engine
process serving the tiny model: the router's EngineClient binds every request to its one
channel, gets each request's first chunk as the call's answer and the rest from one read per
engine step. The tokens are those of a stream per request and Hugging Face's; a channel that
is not open, or open twice, or a bad id is refused by name; a request whose reader stops
early, and every request of a channel that closes, is aborted: the engine ends quiet."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import msgspec
import pytest
from conftest import DAEMON_LOGS, hf_greedy
from daemons import ENGINE_AUTH, ENGINE_KEY, Daemon, serve
from deployments import assert_quiet, engine_stats

import microserve.microserving_client as microserving_client
from microserve.backend import MicroservingError
from microserve.messages import ChannelItem, SamplingParams
from microserve.microserving_client import EngineClient
from microserve.wire import FrameDecoder

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def eng(tiny_served_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("channel") / "daemon.log"
    yield from serve(Daemon(tiny_served_dir, log, "channel", "--max-model-len", "512",
                            "--api-key", ENGINE_KEY))


@pytest.fixture(autouse=True)
def logs_on_failure(request, eng):
    request.node.stash[DAEMON_LOGS] = [eng.log_path]
    yield
    assert_quiet("channel", eng.url)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


async def tokens_of(client: EngineClient, rid: str, prompt: list[int],
                    params: SamplingParams = GREEDY) -> list[int]:
    out = []
    async for chunk in client.start_generate(rid, prompt, 0, params):
        out += chunk.token_ids
    return out


def test_requests_on_one_channel_give_the_tokens_of_streams_and_hugging_faces(
        eng, tiny_served_dir, monkeypatch):
    """16 requests at once on one channel: Hugging Face's greedy tokens, as with a stream per
    request; the channel's reads carried chunks of several requests (16 streams would each
    have been read on their own)."""
    batch = prompts(16, seed=1)
    reads: list[int] = []
    make = microserving_client._channel_decoder

    def counted(response):
        decoder = make(response)
        feed = decoder.feed

        def counted_feed(data):
            items = feed(data)
            reads.append(len(items))
            return items

        decoder.feed = counted_feed
        return decoder

    monkeypatch.setattr(microserving_client, "_channel_decoder", counted)

    async def run(channel: bool) -> list[list[int]]:
        client = EngineClient(eng.url, api_key=ENGINE_KEY, channel=channel)
        try:
            return await asyncio.gather(*(tokens_of(client, f"{channel}-{i}", prompt)
                                          for i, prompt in enumerate(batch)))
        finally:
            client.close()

    on_channel, streamed = asyncio.run(run(True)), asyncio.run(run(False))
    assert on_channel == streamed == hf_greedy(tiny_served_dir, batch, MAX_TOKENS)
    # every chunk after each request's first came on the channel
    assert sum(reads) == 16 * (MAX_TOKENS - 1)
    assert max(reads) > 1


def post_start(eng: Daemon, body: dict) -> httpx.Response:
    return httpx.post(eng.url + "/microserving/start_generate", json=body, headers=ENGINE_AUTH)


def test_a_channel_that_is_not_open_a_bad_id_and_one_open_twice_are_refused_by_name(eng):
    r = post_start(eng, {"request_id": "x", "prompt": [1, 2, 3], "channel": "nope"})
    assert r.status_code == 409
    assert r.json()["error"]["param"] == "channel"
    assert r.json()["error"]["code"] == "channel_not_open"
    r = post_start(eng, {"request_id": "x", "prompt": [1, 2, 3], "channel": "a b"})
    assert r.status_code == 400 and "channel" in r.json()["error"]["param"]
    r = httpx.get(eng.url + "/microserving/channel/bad!id", headers=ENGINE_AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "channel_id"
    assert httpx.get(eng.url + "/microserving/channel/c1").status_code == 401  # no key
    with httpx.Client(base_url=eng.url, headers=ENGINE_AUTH) as http:
        with http.stream("GET", "/microserving/channel/c1") as first:
            assert first.status_code == 200
            again = http.get("/microserving/channel/c1")
            assert again.status_code == 409 and again.json()["error"]["param"] == "channel_id"
        # closed: the id may be opened again, once the engine has seen the connection go
        deadline = time.monotonic() + 10
        while True:
            with http.stream("GET", "/microserving/channel/c1") as reopened:
                if reopened.status_code == 200 or time.monotonic() > deadline:
                    break
            time.sleep(0.05)
        assert reopened.status_code == 200


def test_the_first_chunk_is_the_answer_and_the_rest_come_on_the_channel(eng):
    """Over plain HTTP: the call answers the first chunk as its body (JSON); the channel's
    NDJSON items carry the rest, each naming its request, the last with finish_reason."""
    prompt = prompts(1, seed=2)[0]
    with httpx.Client(base_url=eng.url, headers=ENGINE_AUTH, timeout=60) as http:
        with http.stream("GET", "/microserving/channel/plain") as channel:
            r = post_start(eng, {"request_id": "p1", "prompt": prompt, "channel": "plain",
                                 "sampling": {"max_tokens": 4, "temperature": 0,
                                              "ignore_eos": True}})
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            first = r.json()
            assert len(first["token_ids"]) == 1 and first["finish_reason"] is None
            items = []
            for line in channel.iter_lines():
                items.append(msgspec.json.decode(line, type=ChannelItem))
                if items[-1].chunk.finish_reason is not None:
                    break
    assert {item.request_id for item in items} == {"p1"}
    tokens = first["token_ids"] + [t for item in items for t in item.chunk.token_ids]
    assert len(tokens) == 4 and items[-1].chunk.finish_reason == "length"
    assert items[-1].chunk.usage.completion_tokens == 4


def test_a_reader_that_stops_early_gets_its_request_aborted(eng):
    async def run():
        client = EngineClient(eng.url, api_key=ENGINE_KEY)
        try:
            chunks = client.start_generate("early", prompts(1, seed=3)[0], 0, LONG)
            first = await anext(chunks)
            assert len(first.token_ids) == 1
            await anext(chunks)
            assert engine_stats(eng.url)["stats"]["running"] == 1
            await chunks.aclose()  # the abort call goes out at once
            await asyncio.gather(*client._aborts)
        finally:
            client.close()

    asyncio.run(run())
    assert engine_stats(eng.url)["stats"]["running"] == 0


def test_a_channel_that_closes_aborts_its_requests_and_fails_its_readers(eng):
    """Four long requests on a channel; the channel's connection drops (as when the router
    dies): the engine aborts all four, and their readers get BackendUnavailable at once."""
    async def run():
        client = EngineClient(eng.url, api_key=ENGINE_KEY)
        try:
            streams = [client.start_generate(f"cut-{i}", p, 0, LONG)
                       for i, p in enumerate(prompts(4, seed=4))]
            for stream in streams:
                await anext(stream)
            assert engine_stats(eng.url)["stats"]["running"] == 4
            client._channel._task.cancel()  # the connection closes mid-stream
            for stream in streams:
                with pytest.raises(microserving_client.BackendUnavailable, match="channel"):
                    while True:
                        await anext(stream)
            assert client._channel.error is not None
            # the next request opens another channel
            assert len(await tokens_of(client, "after", prompts(1, seed=5)[0])) == MAX_TOKENS
        finally:
            client.close()

    asyncio.run(run())


def test_an_engine_without_channels_gets_a_stream_per_request(eng, monkeypatch):
    """An engine whose /microserving/channel route is missing (an older engine) answers 404:
    the client streams each request, as before, and does not ask again."""
    opened = []
    real_open = EngineClient._open

    async def without_channels(self, method, name, data, timeout_s, keyless=False):
        opened.append(name)
        if name.startswith("channel/"):
            raise MicroservingError(404, "Not Found")
        return await real_open(self, method, name, data, timeout_s, keyless)

    monkeypatch.setattr(EngineClient, "_open", without_channels)
    prompt = prompts(1, seed=6)[0]

    async def run():
        client = EngineClient(eng.url, api_key=ENGINE_KEY)
        try:
            return [await tokens_of(client, f"old-{i}", prompt) for i in range(2)]
        finally:
            client.close()

    a, b = asyncio.run(run())
    assert a == b and len(a) == MAX_TOKENS
    assert [n.partition("/")[0] for n in opened] == ["channel", "start_generate",
                                                     "start_generate"]


def test_frames_decode_back_into_items():
    """The msgpack framing the channel uses, item by item."""
    from microserve import wire
    from microserve.messages import GenerateChunk
    items = [ChannelItem("a", chunk=GenerateChunk([5])), ChannelItem("b", chunk=GenerateChunk(
        [6, 7], finish_reason="stop"))]
    data = b"".join(wire.encode(item) for item in items)
    frames = FrameDecoder(msgspec.Raw)
    got = [msgspec.msgpack.decode(raw, type=ChannelItem) for raw in frames.feed(data)]
    assert got == items


def test_after_aclose_an_engine_stopped_at_once_exits_at_once(tiny_served_dir, tmp_path):
    """EngineClient.aclose() returns with its idle channel's connection closed: an engine sent
    SIGTERM right after, while the caller's loop is blocked waiting for it (a script's
    teardown), exits within seconds. (Before, the channel's reader was cancelled but never
    ran, its connection stayed open, and the engine waited for it: 30 s and a kill in
    bench.transfer.)"""
    daemon = Daemon(tiny_served_dir, tmp_path / "daemon.log", "aclose", "--max-model-len", "512",
                    "--api-key", ENGINE_KEY)
    try:
        daemon.wait_ready()

        async def run():
            client = EngineClient(daemon.url, api_key=ENGINE_KEY)
            assert len(await tokens_of(client, "one", prompts(1, seed=6)[0])) == MAX_TOKENS
            assert client._channel is not None and not client._channel.queues
            await client.aclose()
            assert client._channel._task.done()
            daemon.terminate()
            return daemon.proc.wait(10)  # blocks this loop, as stop_engines does

        assert asyncio.run(run()) == 0
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
