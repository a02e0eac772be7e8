"""Hosts on one machine for the multi-host suites: network namespaces joined by veth links to a
bridge, and a real DNS server (dnsmasq) for them.

    with Hosts("router", "p", "d") as hosts:         # needs root and `ip`; see missing()
        hosts.address("p")                           # 10.77.N.11: p's address on the bridge
        hosts.run("p", [sys.executable, ...])        # argv to run inside p's namespace
        hosts.link("d", up=False)                    # cut d off (its veth goes down)

The bridge sits in a namespace of its own (so the machine's firewall does not see the traffic),
and this machine joins it too, at 10.77.N.1, so the tests talk to the hosts the way a client
on the network would. Every name carries a random tag and N is a /24 no interface here uses,
so a run that crashed and left something behind never blocks the next. Everything is torn down
on exit, failure or not: processes started with run(), namespaces (with their veths), the
machine's veth, and /etc/netns/<namespace>/.

`ip netns exec` bind-mounts /etc/netns/<namespace>/resolv.conf over /etc/resolv.conf for the
process it runs: write_resolv_conf() points a host's system resolver at a DNS server.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path


def missing() -> str | None:
    """Why these hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links)"
    for tool, package in (("ip", "iproute2"), ("ss", "iproute2"), ("dnsmasq", "dnsmasq-base")):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian package {package}; .ci/run installs it)"
    return None


def sh(*argv: str) -> str:
    run = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({run.returncode}): {run.stderr.strip()}")
    return run.stdout


def _free_subnet() -> ipaddress.IPv4Network:
    used = sh("ip", "-4", "-o", "addr")
    for _ in range(100):
        third = secrets.randbelow(256)
        if f"inet 10.77.{third}." not in used:
            return ipaddress.ip_network(f"10.77.{third}.0/24")
    raise RuntimeError("no free 10.77.N.0/24 here")


class Hosts:
    """Namespaces `names` on one bridge; host i (from 0) is at 10.77.N.(10 + i)... except the
    first, at .2 (the router's usual place). Use as a context manager."""

    def __init__(self, *names: str):
        self.tag = secrets.token_hex(3)
        self.subnet = _free_subnet()
        self.names = names
        self.bridge_ns = f"ms{self.tag}-sw"
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces created, in order
        self._host_veth = f"ms{self.tag}h"  # this machine's end of its link to the bridge

    def netns(self, name: str) -> str:
        return f"ms{self.tag}-{name}"

    def address(self, name: str) -> str:
        i = self.names.index(name)
        return str(self.subnet.network_address + (2 if i == 0 else 10 + i))

    @property
    def gateway(self) -> str:
        """This machine's address on the bridge."""
        return str(self.subnet.network_address + 1)

    def veth(self, name: str) -> str:
        return f"ms{self.tag}{self.names.index(name)}"  # its end in the bridge's namespace

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        prefix = self.subnet.prefixlen
        self._add_ns(self.bridge_ns)
        br = ("ip", "-n", self.bridge_ns)
        sh(*br, "link", "add", "br0", "type", "bridge")
        sh(*br, "link", "set", "br0", "up")
        # This machine's link to the bridge.
        sh("ip", "link", "add", self._host_veth, "type", "veth", "peer", "name", "host",
           "netns", self.bridge_ns)
        sh(*br, "link", "set", "host", "master", "br0", "up")
        sh("ip", "addr", "add", f"{self.gateway}/{prefix}", "dev", self._host_veth)
        sh("ip", "link", "set", self._host_veth, "up")
        for name in self.names:
            ns = self.netns(name)
            self._add_ns(ns)
            sh(*br, "link", "add", self.veth(name), "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            sh(*br, "link", "set", self.veth(name), "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.address(name)}/{prefix}", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _add_ns(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        """Stop what run() started, then remove every namespace, link and file made here."""
        for proc in self._procs:
            stop(proc)
        for ns in self._made:  # anything else still running in them (engine cores...)
            with contextlib.suppress(RuntimeError):
                for pid in sh("ip", "netns", "pids", ns).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(RuntimeError):
            sh("ip", "link", "del", self._host_veth)
        for ns in reversed(self._made):
            with contextlib.suppress(RuntimeError):
                sh("ip", "netns", "del", ns)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made.clear()

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run still on the machine (after close: none)."""
        left = [ns for ns in sh("ip", "netns", "list").split() if ns.startswith(f"ms{self.tag}")]
        links = sh("ip", "-o", "link").split()
        return left + [w for w in links if w.startswith(f"ms{self.tag}")]

    # -- inside the hosts -------------------------------------------------------------------

    def run(self, name: str, argv: list[str], log_path: Path,
            env: dict | None = None) -> subprocess.Popen:
        """Start `argv` in host `name`'s namespace, output to `log_path`; stopped by close()."""
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.netns(name), *argv],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
        self._procs.append(proc)
        return proc

    def add_address(self, name: str, address: str) -> None:
        sh("ip", "-n", self.netns(name), "addr", "add",
           f"{address}/{self.subnet.prefixlen}", "dev", "eth0")

    def link(self, name: str, up: bool) -> None:
        """Connect host `name` to the bridge, or cut it off (its end of the link goes down:
        nothing goes in or out, and nobody is told)."""
        sh("ip", "-n", self.netns(name), "link", "set", "eth0", "up" if up else "down")

    def write_resolv_conf(self, name: str, nameserver: str) -> None:
        """Point host `name`'s system resolver at `nameserver` (for processes run() starts)."""
        path = Path(f"/etc/netns/{self.netns(name)}")
        path.mkdir(parents=True, exist_ok=True)
        (path / "resolv.conf").write_text(f"nameserver {nameserver}\noptions timeout:1 "
                                          "attempts:1\n")


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class Dnsmasq:
    """A real DNS server: dnsmasq answering from a hosts file it re-reads on SIGHUP, and
    NXDOMAIN for any other name under `domain` (what a cluster DNS says of a name with no
    addresses); nothing is forwarded anywhere."""

    def __init__(self, hosts: Hosts, name: str, listen: str, domain: str, workdir: Path):
        self.hosts, self.name, self.listen, self.domain = hosts, name, listen, domain
        self.hosts_file = workdir / "dns-hosts"
        self.hosts_file.write_text("")
        self.workdir = workdir
        self.starts = 0
        self.start()

    def start(self) -> None:
        """Start serving (again, after stop()); returns once it listens."""
        self.starts += 1
        self.log_path = self.workdir / f"dnsmasq-{self.starts}.log"
        self.proc = self.hosts.run(self.name, [
            shutil.which("dnsmasq") or "dnsmasq", "--keep-in-foreground", "--no-resolv",
            "--no-hosts", "--bind-interfaces", f"--listen-address={self.listen}", "--port=53",
            f"--addn-hosts={self.hosts_file}", f"--local=/{self.domain}/", "--no-negcache",
            "--local-ttl=0", "--log-queries", "--log-facility=-", "--user=root"],
            self.log_path)
        deadline = time.monotonic() + 10
        while f"{self.listen}:53 " not in sh("ip", "netns", "exec", self.hosts.netns(self.name),
                                             "ss", "-Hnul", "sport = :53") + " ":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq did not start:\n{self.log_path.read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop answering: lookups then fail (the resolver finds no server)."""
        stop(self.proc)

    def answer(self, records: dict[str, list[str]]) -> None:
        """Make the server answer `name` with exactly `addresses`, for each name given."""
        lines = [f"{address} {name}" for name, addresses in records.items()
                 for address in addresses]
        self.hosts_file.write_text("".join(line + "\n" for line in lines))
        self.proc.send_signal(signal.SIGHUP)
