"""Tokens `microserve router` and `microserve up` make when the operator gives none.

The admin API is closed without a token, so a router started without one gets a fresh one: it
is printed once and written to a file only its user can read (as Jupyter does with its server
token), `${XDG_RUNTIME_DIR}/microserve/admin-token-PORT`, or
`${MICROSERVE_CACHE_DIR:-~/.cache/microserve}/run/admin-token-PORT` where there is no runtime
directory. The engines of a deployment share an engine key the same way, but it never leaves
`up`: the engines get it through their environment and the router holds it in memory.
"""

from __future__ import annotations

import os
import secrets
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


def generated_admin_token(port: int) -> tuple[str, Path]:
    """A fresh admin token for the router on `port`, and the file it was written to."""
    token = new_token()
    path = runtime_dir() / f"admin-token-{port}"
    write_private(path, token)
    return token, path
