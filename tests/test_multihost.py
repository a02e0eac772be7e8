"""Several hosts on one machine: the router, a prefill engine and a decode engine each in its
own network namespace (tests/netns.py), joined by veth links to a bridge on 10.77.N.0/24, KV
moving from P to D over `tcp`. The router finds its engines through DNS (--engines-from-dns)
from a real dnsmasq in its namespace, which its system resolver asks (`ip netns exec` puts
/etc/netns/<ns>/resolv.conf in front of it).

    p.test -> P (10.77.N.11, prefill)     d.test -> D (10.77.N.12, decode)

P also answers at 10.77.N.13 and D at 10.77.N.14: those are the "new pods" the DNS answers move
to. After each test both engines hold nothing (tests/deployments.py: assert_quiet).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import DAEMON_LOGS, hf_greedy
from daemons import ENGINE_KEY, Daemon, serve_together
from deployments import RouterProcess, assert_quiet, engine_stats
from netns import Dnsmasq, Hosts, missing
from test_pd_pressure import MAX_TOKENS, complete, prompts, router_metric

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(missing() is not None, reason=missing() or "")]

ADMIN = {"Authorization": "Bearer multihost-admin"}
DEPLOYMENT = "multihost-test"
LIVENESS_TIMEOUT_S = 3.0  # the router's --liveness-timeout-s: bounds the wait on a host cut off
DNS_INTERVAL_S = 0.2
ENGINE_ARGS = ("--max-model-len", "512", "--api-key", ENGINE_KEY, "--deployment", DEPLOYMENT)


class Cluster:
    def __init__(self, hosts: Hosts, dns: Dnsmasq, p: Daemon, d: Daemon, router: RouterProcess):
        self.hosts, self.dns, self.p, self.d, self.router = hosts, dns, p, d, router
        self.admin = httpx.Client(base_url=router.url, headers=ADMIN, timeout=30)

    def alias(self, name: str) -> str:
        """The engine's second address (.13 for p, .14 for d)."""
        return str(self.hosts.subnet.network_address + {"p": 13, "d": 14}[name])

    def answer(self, p: list[str], d: list[str]) -> None:
        self.dns.answer({"p.test": p, "d.test": d})

    def engines(self) -> dict[str, tuple]:
        r = self.admin.get("/admin/engines")
        assert r.status_code == 200, r.text
        return {e["name"]: (e["role"], e["source"], e["state"]) for e in r.json()["engines"]}

    def wait_engines(self, want: dict[str, tuple], timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while (have := self.engines()) != want:
            assert time.monotonic() < deadline, f"engines {have}, expected {want}"
            time.sleep(0.05)

    def default_engines(self) -> dict[str, tuple]:
        return {f"p.test@{self.hosts.address('p')}": ("prefill", "dns:p.test", "up"),
                f"d.test@{self.hosts.address('d')}": ("decode", "dns:d.test", "up")}

    def assert_quiet(self) -> None:
        assert_quiet("p", self.p.url)
        assert_quiet("d", self.d.url)
        for engine in self.admin.get("/admin/engines").json()["engines"]:
            assert (engine["open_sends"], engine["open_generations"]) == (0, 0), engine


@pytest.fixture(scope="module")
def cluster(tiny_served_dir, tmp_path_factory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("multihost")
    with Hosts("router", "p", "d") as hosts:
        hosts.add_address("p", str(hosts.subnet.network_address + 13))
        hosts.add_address("d", str(hosts.subnet.network_address + 14))
        dns = Dnsmasq(hosts, "router", "127.0.0.1", "test", work)
        hosts.write_resolv_conf("router", "127.0.0.1")
        dns.answer({"p.test": [hosts.address("p")], "d.test": [hosts.address("d")]})
        engines = serve_together(*(Daemon(
            tiny_served_dir, work / f"{name}.log", name, *ENGINE_ARGS,
            "--kv-transfer", "tcp", "--kv-transfer-host", hosts.address(name),
            "--kv-transfer-port", "9000", host="0.0.0.0", url_host=hosts.address(name),
            prefix=("ip", "netns", "exec", hosts.netns(name))) for name in ("p", "d")))
        p, d = next(engines)
        router = RouterProcess(
            tiny_served_dir, {}, work / "router.log", "--strategy", "pd",
            "--engines-from-dns", "p.test,prefill", "--engines-from-dns", "d.test:8000,decode",
            "--dns-interval-s", str(DNS_INTERVAL_S), "--deployment", DEPLOYMENT,
            "--liveness-timeout-s", str(LIVENESS_TIMEOUT_S),
            "--admin-token", ADMIN["Authorization"][7:],
            host=hosts.address("router"), prefix=("ip", "netns", "exec", hosts.netns("router")))
        try:
            router.wait_ready()
            cluster = Cluster(hosts, dns, p, d, router)
            yield cluster
            cluster.admin.close()
        finally:
            router.stop()
            next(engines, None)
    assert hosts.leftovers() == []


@pytest.fixture(autouse=True)
def each_test(request, cluster):
    """Logs in a failure's report; every test starts (and leaves) the cluster as it was made."""
    request.node.stash[DAEMON_LOGS] = [cluster.p.log_path, cluster.d.log_path,
                                       cluster.router.log_path, cluster.dns.log_path]
    cluster.wait_engines(cluster.default_engines())
    yield
    for name in ("p", "d"):
        cluster.hosts.link(name, up=True)
    if cluster.dns.proc.poll() is not None:
        cluster.dns.start()
    cluster.answer(p=[cluster.hosts.address("p")], d=[cluster.hosts.address("d")])
    cluster.wait_engines(cluster.default_engines())


def stream(http: httpx.Client, prompt: list[int], max_tokens: int) -> Iterator[list[int] | dict]:
    """A streamed completion through the router: each event's token ids, or the error object
    an event carries."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                yield event["error"]
            elif event["choices"][0]["logprobs"]:
                yield [int(t[1:-1]) for t in event["choices"][0]["logprobs"]["tokens"]]


@contextlib.contextmanager
def held_on_d(cluster: Cluster, model_dir: str, seed: int) -> Iterator[None]:
    """A request streams from D, held there while the body runs (D's engine core stopped: D is
    slow, not down, as long as the body takes less than the liveness timeout); afterwards it
    must have finished with Hugging Face's greedy tokens."""
    prompt = prompts(1, seed=seed)[0]
    want = hf_greedy(model_dir, [prompt], 64)[0]
    core = cluster.d.core_pid()
    with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
        events = stream(http, prompt, 64)
        got = next(events)
        os.kill(core, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(core, signal.SIGCONT)
        for tokens in events:
            got += tokens
    assert got == want


def wait_draining(cluster: Cluster, name: str) -> None:
    """Until the router shows engine `name` draining (within the liveness timeout, less 1 s)."""
    deadline = time.monotonic() + LIVENESS_TIMEOUT_S - 1
    while (state := cluster.engines().get(name, ())[-1:]) != ("draining",):
        assert time.monotonic() < deadline, f"{name}: {state}"
        time.sleep(0.02)


def run_all(url: str, batch: list[list[int]]) -> list:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.gather(*(complete(http, x) for x in batch))

    return asyncio.run(run())


def test_pd_between_hosts_over_tcp_gives_the_single_engine_greedy_tokens(cluster,
                                                                         tiny_served_dir):
    assert cluster.engines() == cluster.default_engines()
    p_before, d_before = engine_stats(cluster.p.url), engine_stats(cluster.d.url)
    assert (p_before["info"]["kv_transfer"], d_before["info"]["kv_transfer"]) == ("tcp", "tcp")
    batch = prompts(4, seed=11)
    assert run_all(cluster.router.url, batch) == hf_greedy(tiny_served_dir, batch, MAX_TOKENS)
    # Every prompt but its last token was computed on P and sent to D over the bridge.
    sent = sum(len(x) - 1 for x in batch)
    p_after, d_after = engine_stats(cluster.p.url), engine_stats(cluster.d.url)
    assert p_after["stats"]["kv_tokens_sent"] - p_before["stats"]["kv_tokens_sent"] == sent
    assert (d_after["stats"]["kv_tokens_received"]
            - d_before["stats"]["kv_tokens_received"]) == sent
    assert router_metric(cluster.router, "microserve_router_pd_fallbacks_total") == 0
    cluster.assert_quiet()


def test_discovery_follows_the_dns_answers(cluster, tiny_served_dir):
    hosts, admin = cluster.hosts, cluster.admin
    p_name, d_name = (f"{n}.test@{hosts.address(n)}" for n in ("p", "d"))
    moved = f"d.test@{cluster.alias('d')}"
    # Next to the discovered engines, one added through the admin API (it is checked the same
    # way: the same model and deployment); the sources say which came how.
    r = admin.post("/admin/engines", json={"name": "d-admin", "role": "decode",
                                           "url": f"http://{cluster.alias('d')}:8000"})
    assert r.status_code == 201 and r.json()["source"] == "admin", r.text
    assert cluster.engines() == {**cluster.default_engines(),
                                 "d-admin": ("decode", "admin", "up")}
    assert admin.delete("/admin/engines/d-admin").status_code == 200

    # D's pod moves (d.test answers .14 instead of .12) while a request streams from it: the
    # old one is drained, not cut, and removed once that request has ended.
    with held_on_d(cluster, tiny_served_dir, seed=12):
        cluster.answer(p=[hosts.address("p")], d=[cluster.alias("d")])
        wait_draining(cluster, d_name)
        assert _open_generations(cluster, d_name) == 1
    cluster.wait_engines({p_name: ("prefill", "dns:p.test", "up"),
                          moved: ("decode", "dns:d.test", "up")})

    # A DNS blip (the server gone: lookups fail) changes nothing; the failures are counted.
    failures = router_metric(cluster.router, "microserve_router_dns_failures_total")
    cluster.dns.stop()
    deadline = time.monotonic() + 10
    while router_metric(cluster.router, "microserve_router_dns_failures_total") < failures + 4:
        assert time.monotonic() < deadline, "no failed lookups counted"
        time.sleep(0.05)
    assert cluster.engines() == {p_name: ("prefill", "dns:p.test", "up"),
                                 moved: ("decode", "dns:d.test", "up")}
    cluster.dns.start()

    # p.test has no address any more (NXDOMAIN, as a Service scaled to zero): after a few
    # answers in a row its engine goes, and D serves requests whole.
    cluster.answer(p=[], d=[cluster.alias("d")])
    cluster.wait_engines({moved: ("decode", "dns:d.test", "up")})
    batch = prompts(2, seed=13)
    assert run_all(cluster.router.url, batch) == hf_greedy(tiny_served_dir, batch, MAX_TOKENS)
    cluster.assert_quiet()


def _open_generations(cluster: Cluster, name: str) -> int:
    engines = cluster.admin.get("/admin/engines").json()["engines"]
    return next(e["open_generations"] for e in engines if e["name"] == name)


def test_a_host_cut_off_mid_request_fails_it_promptly_and_leaks_nothing(cluster,
                                                                        tiny_served_dir):
    prompt = prompts(1, seed=14)[0]
    core = cluster.d.core_pid()
    with httpx.Client(base_url=cluster.router.url, timeout=LIVENESS_TIMEOUT_S + 10) as http:
        events = stream(http, prompt, 512 - len(prompt))
        assert isinstance(next(events), list)
        os.kill(core, signal.SIGSTOP)  # so that the stream is surely mid-way when D is cut
        cluster.hosts.link("d", up=False)
        cut = time.monotonic()
        os.kill(core, signal.SIGCONT)
        rest = list(events)
        failed_s = time.monotonic() - cut
    error = rest[-1]
    assert isinstance(error, dict) and "went down while generating" in error["message"], rest
    # The router's liveness probe finds D silent after its timeout (probes are 0.5 s apart).
    assert failed_s < LIVENESS_TIMEOUT_S + 2.5, failed_s
    print(f"the client had its error {failed_s:.2f} s after D was cut off")
    d_name = f"d.test@{cluster.hosts.address('d')}"
    assert cluster.engines()[d_name][2] == "down"
    # The survivor holds nothing for it, and serves requests whole meanwhile.
    assert_quiet("p", cluster.p.url)
    batch = prompts(2, seed=15)
    assert run_all(cluster.router.url, batch) == hf_greedy(tiny_served_dir, batch, MAX_TOKENS)
    # D comes back when its link does, and holds nothing either.
    cluster.hosts.link("d", up=True)
    cluster.wait_engines(cluster.default_engines(), timeout_s=30)
    cluster.assert_quiet()


def test_a_stopping_pod_drains_its_engine_first(cluster, tiny_served_dir):
    """What an engine pod's preStop hook runs (deploy/kubernetes): `microserve drain` from
    inside the pod returns once the request streaming from it has ended, and no new request
    goes to the engine meanwhile."""
    d_name, d_url = f"d.test@{cluster.hosts.address('d')}", cluster.d.url
    with held_on_d(cluster, tiny_served_dir, seed=16):
        pre_stop = cluster.hosts.run("d", [
            sys.executable, "-m", "launcher.cli", "drain", cluster.router.url,
            "--engine", d_url], cluster.router.log_path.with_name("pre-stop.log"),
            env={**os.environ, "MICROSERVE_ADMIN_TOKEN": ADMIN["Authorization"][7:]})
        wait_draining(cluster, d_name)
        assert pre_stop.poll() is None  # still waiting: the request is open on D
    assert pre_stop.wait(10) == 0
    # Drained: a new request is served whole by P, not by D.
    before = engine_stats(d_url)["stats"]["generation_tokens"]
    batch = prompts(1, seed=17)
    assert run_all(cluster.router.url, batch) == hf_greedy(tiny_served_dir, batch, MAX_TOKENS)
    assert engine_stats(d_url)["stats"]["generation_tokens"] == before
    assert cluster.admin.post(f"/admin/engines/{d_name}/undrain").status_code == 200
    cluster.assert_quiet()
