"""Where files and batches live: their metadata in SQLite (WAL, synchronous=FULL), file bodies on disk
under the batch directory. A batch's input lines are copied into the database when it is validated,
and each finished line's output line is written into its row in the same transaction that marks the
row done and counts it, so a crash (kill -9) leaves every line either done once, with its output, or
still pending; the output and error files are written from the rows when the batch ends.

The store is synchronous and not thread-safe: its owner calls it from one thread (BatchService runs
every call on a single-thread executor, keeping the event loop free of disk waits)."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, seq INTEGER NOT NULL, status TEXT NOT NULL,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT, body TEXT, done INTEGER NOT NULL,
    ok INTEGER NOT NULL DEFAULT 0, result TEXT, PRIMARY KEY (batch_id, line_no));
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, done);
"""
# the statuses a batch no longer leaves
FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class PendingLine:
    line_no: int
    custom_id: str
    body: str  # the request's JSON body


@dataclass(frozen=True)
class LineResult:
    """One input line's output line (OpenAI's batch output format) and whether it goes to the output
    file (a 2xx answer) or the error file."""
    line_no: int
    record: dict[str, Any]
    ok: bool


class BatchStore:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.files_dir = self.directory / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.directory / "batches.sqlite3", isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)
        self._seq = int(self.db.execute(
            "SELECT max(s) FROM (SELECT max(seq) AS s FROM files UNION ALL SELECT max(seq) FROM batches)"
        ).fetchone()[0] or 0)

    def close(self) -> None:
        self.db.close()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _tx(self) -> _Transaction:
        return _Transaction(self.db)

    # ---- files ---------------------------------------------------------------------------
    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, owner: str, filename: str, purpose: str, content: bytes,
                 file_id: str | None = None) -> dict[str, Any]:
        """A new file (a given `file_id` is replaced if it exists: a batch's result files, written again
        after a crash)."""
        file_id = file_id or new_id("file-")
        _write_durably(self.path_of(file_id), content)
        row = (file_id, owner, filename, purpose, len(content), int(time.time()), self._next_seq())
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        return _file_object(row)

    def get_file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return _file_object(row) if row else None

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool) -> tuple[list[dict[str, Any]], bool]:
        rows = _page(self.db, "files", owner, after, limit, newest_first,
                     ("purpose = ?", purpose) if purpose is not None else None)
        return [_file_object(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._tx():
            deleted = self.db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount
        if deleted:
            self.path_of(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # ---- batches ---------------------------------------------------------------------------
    def add_batch(self, owner: str, data: dict[str, Any]) -> dict[str, Any]:
        batch_id = new_id("batch_")
        data = {**data, "id": batch_id, "object": "batch", "status": "validating"}
        with self._tx():
            self.db.execute("INSERT INTO batches (id, owner, seq, status, data) VALUES (?, ?, ?, ?, ?)",
                            (batch_id, owner, self._next_seq(), "validating", json.dumps(data)))
        return self.get_batch(batch_id, owner) or data

    def get_batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The batch object as OpenAI shapes it; `owner` None: whoever owns it (the runner's view)."""
        query = "SELECT * FROM batches WHERE id = ?" + ("" if owner is None else " AND owner = ?")
        row = self.db.execute(query, (batch_id,) if owner is None else (batch_id, owner)).fetchone()
        return _batch_object(row) if row else None

    def owner_of(self, batch_id: str) -> str:
        return str(self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()[0])

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        rows = _page(self.db, "batches", owner, after, limit, True, None)
        return [_batch_object(r) for r in rows[:limit]], len(rows) > limit

    def unfinished_batches(self) -> list[str]:
        marks = ",".join("?" * len(FINAL_STATUSES))
        return [r[0] for r in self.db.execute(f"SELECT id FROM batches WHERE status NOT IN ({marks}) ORDER BY seq",
                                              tuple(FINAL_STATUSES))]

    def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...] = (), add_failed: int = 0,
                   **fields: Any) -> dict[str, Any] | None:
        """Moves a batch to `status` (stamping `<status>_at` now, and any other fields), if its status is
        one of `only_from` (any when empty); returns the batch as it is then, or None if it did not move."""
        with self._tx():
            row = self.db.execute("SELECT status, data FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or (only_from and row[0] not in only_from):
                return None
            data = json.loads(row[1])
            data.update(fields, status=status)
            data.setdefault(f"{status}_at", None)
            data[f"{status}_at"] = data[f"{status}_at"] or int(time.time())
            self.db.execute("UPDATE batches SET status = ?, data = ?, failed = failed + ? WHERE id = ?",
                            (status, json.dumps(data), add_failed, batch_id))
        return self.get_batch(batch_id)

    # ---- lines ----------------------------------------------------------------------------
    def add_lines(self, batch_id: str, lines: list[tuple[str | None, str | None, dict[str, Any] | None]]) -> None:
        """The batch's input lines, once: (custom_id, request body, None) for a line to run, (custom_id or
        None, None, its error record) for a malformed one (done at once, in the error file)."""
        with self._tx():
            if self.db.execute("SELECT 1 FROM lines WHERE batch_id = ? LIMIT 1", (batch_id,)).fetchone():
                return  # validated before a crash
            self.db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, body, done, ok, result) VALUES (?, ?, ?, ?, ?, 0, ?)",
                ((batch_id, i, cid, body, int(error is not None), None if error is None else json.dumps(error))
                 for i, (cid, body, error) in enumerate(lines)))
            failed = sum(1 for _, _, error in lines if error is not None)
            self.db.execute("UPDATE batches SET total = ?, failed = ? WHERE id = ?", (len(lines), failed, batch_id))

    def pending_lines(self, batch_id: str) -> list[PendingLine]:
        return [PendingLine(*r) for r in self.db.execute(
            "SELECT line_no, custom_id, body FROM lines WHERE batch_id = ? AND done = 0 ORDER BY line_no",
            (batch_id,))]

    def finish_line(self, batch_id: str, result: LineResult) -> bool:
        """Marks the line done with its output line and counts it, in one transaction; False if it was
        done already (nothing changes)."""
        with self._tx():
            changed = self.db.execute(
                "UPDATE lines SET done = 1, ok = ?, result = ? WHERE batch_id = ? AND line_no = ? AND done = 0",
                (int(result.ok), json.dumps(result.record), batch_id, result.line_no)).rowcount
            if changed:
                column = "completed" if result.ok else "failed"
                self.db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (batch_id,))
        return bool(changed)

    def finish_batch(self, batch_id: str, status: str, unfinished_error: dict[str, Any] | None) -> dict[str, Any]:
        """Writes the output and error files from the finished lines (and, with `unfinished_error`, an
        error line for each line never run, counted as failed) and moves the batch to `status`. Safe
        to repeat after a crash: the result files have ids made from the batch's, so they are replaced."""
        owner = self.owner_of(batch_id)
        out_lines: list[str] = []
        err_lines: list[str] = []
        unfinished = 0
        for ok, result, custom_id in self.db.execute(
                "SELECT ok, result, custom_id FROM lines WHERE batch_id = ? ORDER BY line_no", (batch_id,)):
            if result is None:
                if unfinished_error is None:
                    continue
                unfinished += 1
                result = json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                                     "error": unfinished_error})
            (out_lines if ok else err_lines).append(result)
        ids: dict[str, Any] = {}
        for key, lines in (("output_file_id", out_lines), ("error_file_id", err_lines)):
            if lines:
                kind = key.split("_")[0]
                ids[key] = self.add_file(owner, f"{batch_id}_{kind}.jsonl", "batch_output",
                                         ("\n".join(lines) + "\n").encode(), f"file-{kind}-{batch_id}")["id"]
        batch = self.set_status(batch_id, status, add_failed=unfinished, **ids)
        assert batch is not None
        return batch


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, *_: object) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def _write_durably(path: Path, content: bytes) -> None:
    tmp = path.with_suffix(".part")
    with open(tmp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _page(db: sqlite3.Connection, table: str, owner: str, after: str | None, limit: int, newest_first: bool,
          condition: tuple[str, Any] | None) -> list[tuple[Any, ...]]:
    """Up to limit + 1 rows of `owner` after the row `after` (cursor pagination, OpenAI's `after`)."""
    where, args = ["owner = ?"], [owner]
    if condition is not None:
        where.append(condition[0])
        args.append(condition[1])
    if after is not None:
        row = db.execute(f"SELECT seq FROM {table} WHERE id = ? AND owner = ?", (after, owner)).fetchone()
        if row is not None:
            where.append("seq < ?" if newest_first else "seq > ?")
            args.append(row[0])
    order = "DESC" if newest_first else "ASC"
    return list(db.execute(f"SELECT * FROM {table} WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?",
                           (*args, limit + 1)))


def _file_object(row: tuple[Any, ...]) -> dict[str, Any]:
    file_id, _owner, filename, purpose, size, created_at, _seq = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}


def _batch_object(row: tuple[Any, ...]) -> dict[str, Any]:
    _id, _owner, _seq, status, total, completed, failed, data = row
    batch: dict[str, Any] = {key: None for key in _BATCH_FIELDS}
    batch.update(json.loads(data))
    batch["status"] = status
    batch["request_counts"] = {"total": total, "completed": completed, "failed": failed}
    return batch


_BATCH_FIELDS = ("id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status",
                 "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
                 "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts",
                 "metadata")


def read_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            yield line.rstrip("\r\n")
