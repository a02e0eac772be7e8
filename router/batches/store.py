"""What the Files and Batches API keeps, in a data directory: metadata in SQLite, bytes on disk.

    DATA_DIR/batches.sqlite3      files, batches and one row per batch line (WAL mode)
    DATA_DIR/files/FILE_ID        the bytes of each file (uploads, outputs, error files)

A line's result is committed to its row before the line counts as done, so a router killed at
any moment loses at most the lines it was running: on restart those rows are still `pending`
and run again, and every `done` or `failed` row keeps its result and is never run again.

    lines.state:   pending ──> done      (a 2xx answer; its output line is in `result`)
                          └──> failed    (a bad line or a 4xx/5xx answer; the error line)

The schema is versioned (`PRAGMA user_version`): a data directory written by a newer schema is
refused rather than misread. Two connections: the API's, used from the event loop's thread
only (short reads and writes), and the runner's for a batch's lines (the methods under "lines:
the runner's calls"), which the runner calls in a worker thread, one call at a time: inserting
a 50,000-line batch, reading its pending lines, the disk flush of each line's committed result
and writing the output files would otherwise stall the event loop that serves live requests
(a 10,000-line batch's insert and read took ~1 s on this project's CPU machine). No torch.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, lines INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, position INTEGER NOT NULL,
    custom_id TEXT, state TEXT NOT NULL, request TEXT, result TEXT,
    PRIMARY KEY (batch_id, idx));
CREATE INDEX lines_by_position ON lines (batch_id, state, position);
"""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class LineRow:
    """One line of a batch as the runner sees it: `request` is its body's JSON text (None for a
    line that failed before it could run; decoded when the line starts), `position` its place
    in the dispatch order."""

    idx: int
    position: int
    custom_id: str | None
    request: str | None


class Store:
    def __init__(self, data_dir: str | Path):
        self.root = Path(data_dir)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # users' prompts and answers
        (self.root / "files").mkdir(mode=0o700, exist_ok=True)
        # One router per data directory: two would run the same batches twice. The lock goes
        # with the process, however it ends.
        self._lock = open(self.root / "lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"data directory {self.root} is in use by another router")
        self.db = self._connect()
        self.db.execute("PRAGMA journal_mode=WAL")
        self._migrate()
        self._lines_db = self._connect(check_same_thread=False)  # the runner's, in a thread
        self._lines_lock = threading.Lock()

    def _connect(self, **kwargs) -> sqlite3.Connection:
        # a writer waits up to 10 s for the other connection's transaction (WAL: one writer)
        db = sqlite3.connect(self.root / "batches.sqlite3", isolation_level=None, timeout=10,
                             **kwargs)
        # FULL: a commit is on disk when it returns, power loss included (NORMAL could lose the
        # last commits, and their lines would run again).
        db.execute("PRAGMA synchronous=FULL")
        return db

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.root}: its database has schema {version}, newer than the "
                               f"{SCHEMA_VERSION} this microserve reads")
        if version == 0:
            self.db.executescript("BEGIN;" + _SCHEMA +
                                  f"PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")

    def close(self) -> None:
        with self._lines_lock:
            self._lines_db.close()
        self.db.close()
        self._lock.close()

    # -- files ----------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def add_file(self, owner: str, filename: str, purpose: str, data: bytes) -> dict:
        return self._add_file(self.db, owner, filename, purpose, data)

    def _add_file(self, db: sqlite3.Connection, owner: str, filename: str, purpose: str,
                  data: bytes) -> dict:
        file_id = new_id("file")
        path = self.file_path(file_id)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:  # bytes first, row second: a row always has its bytes
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)
        row = (file_id, filename, purpose, len(data),
               sum(1 for line in data.splitlines() if line.strip()), int(time.time()))
        db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", (row[0], owner, *row[1:]))
        return _file_object(row)

    def file(self, owner: str, file_id: str) -> dict | None:
        row = self.db.execute("SELECT id, filename, purpose, bytes, lines, created_at FROM files "
                              "WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return None if row is None else _file_object(row)

    def line_count(self, file_id: str) -> int:
        return self.db.execute("SELECT lines FROM files WHERE id = ?", (file_id,)).fetchone()[0]

    def files(self, owner: str, purpose: str | None = None) -> list[dict]:
        rows = self.db.execute("SELECT id, filename, purpose, bytes, lines, created_at FROM files "
                               "WHERE owner = ? AND (? IS NULL OR purpose = ?) "
                               "ORDER BY created_at DESC, rowid DESC", (owner, purpose, purpose))
        return [_file_object(r) for r in rows]

    def delete_file(self, owner: str, file_id: str) -> bool:
        deleted = self.db.execute("DELETE FROM files WHERE id = ? AND owner = ?",
                                  (file_id, owner)).rowcount
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # -- batches --------------------------------------------------------------------------------

    def add_batch(self, owner: str, batch: dict) -> None:
        self.db.execute("INSERT INTO batches VALUES (?, ?, ?)",
                        (batch["id"], owner, json.dumps(batch)))

    def batch(self, owner: str | None, batch_id: str) -> dict | None:
        """The batch object; `owner` None: whoever owns it (the runner's view)."""
        row = self.db.execute("SELECT body FROM batches WHERE id = ? AND (? IS NULL OR owner = ?)",
                              (batch_id, owner, owner)).fetchone()
        return None if row is None else json.loads(row[0])

    def batches(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, those created before `after`; and whether more follow."""
        start = 0
        if after is not None:
            start = self.db.execute("SELECT rowid FROM batches WHERE id = ? AND owner = ?",
                                    (after, owner)).fetchone()
            start = start[0] if start else 0
        rows = self.db.execute("SELECT body FROM batches WHERE owner = ? AND (? = 0 OR rowid < ?) "
                               "ORDER BY rowid DESC LIMIT ?", (owner, start, start, limit + 1))
        found = [json.loads(r[0]) for r in rows]
        return found[:limit], len(found) > limit

    def unfinished_batches(self) -> list[dict]:
        rows = self.db.execute("SELECT body FROM batches WHERE json_extract(body, '$.status') IN "
                               "('validating', 'in_progress', 'finalizing', 'cancelling') "
                               "ORDER BY rowid")
        return [json.loads(r[0]) for r in rows]

    def owner_of(self, batch_id: str) -> str:
        return self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]

    def update_batch(self, batch: dict) -> None:
        self.db.execute("UPDATE batches SET body = ? WHERE id = ?",
                        (json.dumps(batch), batch["id"]))

    # -- lines: the runner's calls, in a worker thread (has_lines and counts: the loop's) --------

    def add_lines(self, batch: dict, rows: list[tuple]) -> None:
        """All lines of a batch and its move to in_progress, in one transaction: a restart finds
        either no lines (and validates again) or all of them.

        rows: (idx, position, custom_id, state, request (JSON text) or None, result or None)."""
        values = [(batch["id"], idx, pos, cid, state, req,
                   None if res is None else json.dumps(res))
                  for idx, pos, cid, state, req, res in rows]
        with self._lines_lock, self._lines_db as db:
            db.execute("BEGIN")
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?, ?)", values)
            db.execute("UPDATE batches SET body = ? WHERE id = ?", (json.dumps(batch), batch["id"]))

    def has_lines(self, batch_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM lines WHERE batch_id = ? LIMIT 1",
                               (batch_id,)).fetchone() is not None

    def pending(self, batch_id: str) -> list[LineRow]:
        """The lines still to run, in dispatch order."""
        out = []
        with self._lines_lock:
            cursor = self._lines_db.execute(
                "SELECT idx, position, custom_id, request FROM lines "
                "WHERE batch_id = ? AND state = 'pending' ORDER BY position", (batch_id,))
            # in slices: one fetchall of a large batch holds the GIL (and the event loop) ~0.1 s
            while rows := cursor.fetchmany(256):
                out += [LineRow(*row) for row in rows]
        return out

    def finish_line(self, batch_id: str, idx: int, ok: bool, result: dict) -> None:
        """Record a line's outcome (committed when this returns); only a pending line moves."""
        text = json.dumps(result)
        with self._lines_lock:
            moved = self._lines_db.execute(
                "UPDATE lines SET state = ?, result = ? "
                "WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                ("done" if ok else "failed", text, batch_id, idx)).rowcount
        assert moved == 1, f"line {idx} of {batch_id} was not pending"

    def fail_pending(self, batch_id: str, result) -> None:
        """Every pending line failed, its result `result(row)`, in one transaction."""
        values = [(json.dumps(result(row)), batch_id, row.idx) for row in self.pending(batch_id)]
        with self._lines_lock, self._lines_db as db:
            db.execute("BEGIN")
            db.executemany("UPDATE lines SET state = 'failed', result = ? "
                           "WHERE batch_id = ? AND idx = ? AND state = 'pending'", values)

    def counts(self, batch_id: str) -> dict[str, int]:
        rows = self.db.execute("SELECT state, COUNT(*) FROM lines WHERE batch_id = ? "
                               "GROUP BY state", (batch_id,))
        counts = dict.fromkeys(("pending", "done", "failed"), 0) | dict(rows.fetchall())
        return counts

    def results(self, batch_id: str, state: str) -> list[str]:
        """The results of the lines in `state`, in input order, as JSON lines."""
        with self._lines_lock:
            rows = self._lines_db.execute("SELECT result FROM lines WHERE batch_id = ? AND "
                                          "state = ? ORDER BY idx", (batch_id, state)).fetchall()
        return [r[0] for r in rows]

    def results_file(self, owner: str, batch_id: str, state: str, filename: str) -> str | None:
        """A file of the results of the lines in `state` (input order); its id, or None if no
        line is in that state."""
        results = self.results(batch_id, state)
        if not results:
            return None
        data = "".join(r + "\n" for r in results).encode()
        with self._lines_lock:
            return self._add_file(self._lines_db, owner, filename, "batch_output", data)["id"]


def _file_object(row) -> dict:
    file_id, filename, purpose, size, _lines, created_at = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "status": "processed",
            "status_details": None, "expires_at": None}
