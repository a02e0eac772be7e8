"""`microserve drain`: take an engine out of a router's rotation and wait for its requests to end.

    microserve drain http://microserve-router:8000 --engine http://10.244.1.7:8000 --wait-s 300

What an engine pod's preStop hook runs before the kubelet sends SIGTERM: every engine of the
router at that URL (or of that name) is drained through the admin API (POST
/admin/engines/{name}/drain: no new requests), then this waits until the router has no call
open on it (or it left the pool, or `wait_s` passed). The engine's own SIGTERM handling then
finishes whatever is still open and exits. Needs the admin token (MICROSERVE_ADMIN_TOKEN).
"""

from __future__ import annotations

import time
from urllib.parse import quote

import httpx


class DrainError(RuntimeError):
    """The router could not be asked (unreachable, refused, or no such engine)."""


def drain(router_url: str, engine: str, admin_token: str, wait_s: float = 300.0,
          poll_s: float = 0.5) -> dict[str, int]:
    """Drain the router's engines named `engine` or at URL `engine`; wait until none has an
    open call. Returns their open calls by name when done (all 0 unless `wait_s` passed; an
    engine that left the pool meanwhile is not listed). Raises DrainError when the router
    cannot be asked or knows no such engine."""
    headers = {"Authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=router_url.rstrip("/"), headers=headers, timeout=10) as http:
        names = [e["name"] for e in _engines(http) if engine in (e["name"], e["url"])]
        if not names:
            raise DrainError(f"router {router_url} has no engine named or at {engine!r}")
        for name in names:
            r = _call(http, "POST", f"/admin/engines/{quote(name, safe='')}/drain")
            if r.status_code not in (200, 404):  # 404: it left the pool meanwhile
                raise DrainError(f"drain of {name} refused: {r.status_code} {r.text}")
        deadline = time.monotonic() + wait_s
        while True:
            open_calls = {e["name"]: e["open_sends"] + e["open_generations"]
                          + e.get("open_receives", 0)
                          for e in _engines(http) if e["name"] in names}
            if not any(open_calls.values()) or time.monotonic() > deadline:
                return open_calls
            time.sleep(poll_s)


def _engines(http: httpx.Client) -> list[dict]:
    r = _call(http, "GET", "/admin/engines")
    if r.status_code != 200:
        raise DrainError(f"GET /admin/engines: {r.status_code} {r.text}")
    return r.json()["engines"]


def _call(http: httpx.Client, method: str, path: str) -> httpx.Response:
    try:
        return http.request(method, path)
    except httpx.TransportError as e:
        raise DrainError(f"router {http.base_url} unreachable: {e}") from e
