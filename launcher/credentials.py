"""Tokens `microserve router` and `microserve up` make when the operator gives none.

The admin API is closed without a token, so a router started without one gets a fresh one: it
is printed once and written to a file only its user can read (as Jupyter does with its server
token), `${XDG_RUNTIME_DIR}/microserve/admin-token-PORT`, or
`${MICROSERVE_CACHE_DIR:-~/.cache/microserve}/run/admin-token-PORT` where there is no runtime
directory. The file belongs to the router that holds PORT: it is written only once that router
has the port (a second router on a busy port fails first and leaves the running one's file
alone) and removed when it stops. The engines of a deployment share an engine key the same
way, but it never leaves `up`: the engines get it through their environment and the router
holds it in memory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from microserve.model_files import cache_dir


def new_token() -> str:
    return secrets.token_urlsafe(32)  # 256 bits


def runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "microserve" if xdg else cache_dir() / "run"


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by this user only (0600 in a 0700
    directory), replacing what was there. The mode is set before the text is written."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older file may have had a wider mode
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def admin_token_path(port: int) -> Path:
    """Where the generated admin token of the router on `port` is saved while it runs."""
    return runtime_dir() / f"admin-token-{port}"


@contextlib.contextmanager
def admin_token(given: str | None, port: int) -> Iterator[str]:
    """The admin token of the router on `port`: `given`, or else a new one, printed once and
    saved in `admin_token_path(port)` until the block ends. Enter it only once the router
    holds `port`: the file of the router that held it before is replaced."""
    if given is not None:
        yield given
        return
    token = new_token()
    path = admin_token_path(port)
    write_private(path, token)
    print(f"microserve: no admin token given; /admin takes this one: {token}\n"
          f"microserve: (saved in {path}, readable only by you, until this router stops; "
          f"`microserve admin-token --port {port}` prints it; set --admin-token or "
          f"MICROSERVE_ADMIN_TOKEN to choose it)", flush=True)
    try:
        yield token
    finally:
        with contextlib.suppress(OSError):
            if path.read_text().strip() == token:  # still ours
                path.unlink()


def saved_admin_token(port: int) -> str:
    """The generated admin token of the router running on `port`, read from its file.
    Raises ValueError naming the file when there is none."""
    path = admin_token_path(port)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise ValueError(f"no admin token saved for port {port} ({path} does not exist): is a "
                         "router running there that was started without --admin-token?"
                         ) from None
