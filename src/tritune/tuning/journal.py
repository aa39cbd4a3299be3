"""The tuning journal: an SQLite file holding every measured candidate, committed as soon as it is measured.

A rerun after a crash, kill -9 or Ctrl-C reads it back and skips what was already measured. Tuners sharing one
journal (two runs on one output folder) share the work: a candidate is claimed before it is measured (a claim row
naming the owning process), others wait for its result instead of measuring it again, and the claims of a process
that died are taken over.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tritune.tuning.types import Config, Measurement, Status

_SCHEMA = """
CREATE TABLE IF NOT EXISTS measurements (
    problem_key TEXT NOT NULL,
    config TEXT NOT NULL,          -- Config.key()
    status TEXT NOT NULL,          -- Status value
    time_us REAL,                  -- NULL means NaN; +-inf is stored as a REAL infinity
    error REAL,
    rel_l2_err REAL,
    message TEXT NOT NULL,
    extra TEXT NOT NULL,           -- JSON object
    created REAL NOT NULL,         -- unix time of the last write
    eager_us REAL,                 -- finalists: eager per-call time; NULL when not re-timed (NaN)
    graph_us REAL,                 -- finalists: CUDA-graph replay time; NULL when not re-timed or not captured
    PRIMARY KEY (problem_key, config)
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS claims (
    problem_key TEXT NOT NULL,
    config TEXT NOT NULL,          -- Config.key()
    phase TEXT NOT NULL,           -- "measure" (first pass) or "retime" (a finalist timed as the op runs)
    owner TEXT NOT NULL,           -- host:pid:token of the claiming journal connection
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started TEXT NOT NULL,         -- the owner's process start time (Linux /proc), '' where unknown
    seen REAL NOT NULL,            -- unix time the owner last said it is alive
    PRIMARY KEY (problem_key, config, phase)
);
"""

PHASES = ("measure", "retime")
# A claim whose owner has not said it is alive for this long is taken over even when its process cannot be checked
# (another host sharing the file); owners refresh theirs every HEARTBEAT_S while they work.
STALE_AFTER_S = 300.0
HEARTBEAT_S = 5.0
# What "done" means per phase: measured at all, or (a finalist) re-timed as the op runs or failed doing so.
_DONE = {
    "measure": "SELECT 1 FROM measurements WHERE problem_key = ? AND config = ?",
    "retime": "SELECT 1 FROM measurements WHERE problem_key = ? AND config = ? "
              "AND (status != 'ok' OR eager_us IS NOT NULL)",
}


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux /proc; '' elsewhere or when gone): with the pid it
    names one process, so a reused pid is not mistaken for the claim's owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the parenthesised command name


def _alive(pid: int, started: str) -> bool:
    """Whether process `pid` (started at `started`, when known) still runs on this host; a zombie does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True  # no /proc: the signal check is all there is
    return state not in ("Z", "X") and (not started or _process_start(pid) == started)


@dataclass(frozen=True)
class Claims:
    """What `Journal.claim` found for the keys asked: claimed now by this journal (`mine`), held by another live
    owner (`others`), or already done in the journal (`done`)."""

    mine: frozenset[tuple[str, str]]
    others: frozenset[tuple[str, str]]
    done: frozenset[tuple[str, str]]

# Columns added after the first release: (name, SQL type). A journal written before them gains them on open.
_ADDED_COLUMNS = (("eager_us", "REAL"), ("graph_us", "REAL"))

_UPSERT = """
INSERT INTO measurements (problem_key, config, status, time_us, error, rel_l2_err, message, extra, created,
                          eager_us, graph_us)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (problem_key, config) DO UPDATE SET
    status = excluded.status, time_us = excluded.time_us, error = excluded.error,
    rel_l2_err = excluded.rel_l2_err, message = excluded.message, extra = excluded.extra,
    created = excluded.created, eager_us = excluded.eager_us, graph_us = excluded.graph_us
"""


def _to_sql(x: float) -> float | None:
    # SQLite stores +-inf as REAL but silently turns NaN into NULL; make that mapping explicit.
    return None if math.isnan(x) else float(x)


def _from_sql(x: float | None) -> float:
    return math.nan if x is None else float(x)


def _until_unlocked(step, deadline: float) -> None:
    """Run `step`, again after a short wait while SQLite says the database is locked, until time.monotonic()
    passes `deadline` (then the error stands)."""
    while True:
        try:
            step()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Journal:
    """Measurements keyed by (problem key, config key), plus a small text key/value `meta` table.

    Every `record` is committed before it returns, so a killed process loses at most the candidate it was
    measuring. WAL mode with synchronous=NORMAL: durable against process death (not against power loss),
    and other processes may read while one writes (writers wait up to `timeout` seconds for the lock).
    """

    def __init__(self, path: str | Path, timeout: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # check_same_thread=False plus our own lock: the tuner may record from a worker thread.
        self._conn = sqlite3.connect(self.path, timeout=timeout, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        # Two tuners opening a new journal at once: SQLite may answer the switch to WAL (and the schema) with
        # "database is locked" at once, without waiting on its busy handler. Retried until `timeout`.
        deadline = time.monotonic() + timeout
        _until_unlocked(lambda: self._conn.execute("PRAGMA journal_mode=WAL"), deadline)
        self._conn.execute("PRAGMA synchronous=NORMAL")
        _until_unlocked(lambda: self._conn.executescript(_SCHEMA), deadline)
        self._migrate()
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._started = _process_start(self._pid)
        self.owner = f"{self._host}:{self._pid}:{uuid.uuid4().hex[:8]}"
        self._beat = time.time()

    def _migrate(self) -> None:
        """Add the columns an older journal lacks (NULL in its rows: not re-timed), so it opens and resumes."""
        # BEGIN IMMEDIATE takes the write lock first, so two processes opening one old journal add each column once.
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            have = {row[1] for row in self._conn.execute("PRAGMA table_info(measurements)")}
            for name, kind in _ADDED_COLUMNS:
                if name not in have:
                    self._conn.execute(f"ALTER TABLE measurements ADD COLUMN {name} {kind}")
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise

    def record(self, m: Measurement) -> None:
        """Insert or replace the row for (m.problem_key, m.config); committed on return.

        `extra` is stored as JSON; values JSON cannot hold are written with str().
        """
        row = (
            m.problem_key,
            m.config.key(),
            m.status.value,
            _to_sql(m.time_us),
            _to_sql(m.error),
            _to_sql(m.rel_l2_err),
            m.message,
            json.dumps(m.extra, sort_keys=True, default=str),
            time.time(),
            _to_sql(m.eager_us),
            _to_sql(m.graph_us),
        )
        with self._lock:
            # isolation_level=None is autocommit: the single statement is its own committed transaction.
            self._conn.execute(_UPSERT, row)

    def measurements(self, problem_key: str) -> dict[Config, Measurement]:
        """Every recorded candidate of one problem, in first-recorded order."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT config, status, time_us, error, rel_l2_err, message, extra, eager_us, graph_us "
                "FROM measurements WHERE problem_key = ? ORDER BY rowid",
                (problem_key,),
            ).fetchall()
        out: dict[Config, Measurement] = {}
        for config_key, status, time_us, error, rel_l2, message, extra, eager_us, graph_us in rows:
            config = Config.from_key(config_key)
            out[config] = Measurement(
                problem_key=problem_key,
                config=config,
                status=Status(status),
                time_us=_from_sql(time_us),
                error=_from_sql(error),
                rel_l2_err=_from_sql(rel_l2),
                message=message,
                extra=json.loads(extra),
                eager_us=_from_sql(eager_us),
                graph_us=_from_sql(graph_us),
            )
        return out

    def claim(self, keys: Iterable[tuple[str, str]], phase: str) -> Claims:
        """Claim each (problem key, Config.key()) for `phase` unless it is done or a live owner holds it; one
        transaction, so two journals asking at once never both get a key. A claim of a dead owner (its process gone
        from this host, or silent for STALE_AFTER_S) is taken over."""
        if phase not in PHASES:
            raise ValueError(f"unknown claim phase {phase!r}; expected one of {PHASES}")
        mine, others, done = set(), set(), set()
        now = time.time()
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for key in keys:
                    if self._conn.execute(_DONE[phase], key).fetchone():
                        done.add(key)
                        continue
                    row = self._conn.execute(
                        "SELECT owner, host, pid, started, seen FROM claims WHERE problem_key = ? AND config = ? "
                        "AND phase = ?", (*key, phase)).fetchone()
                    if row is not None and row[0] != self.owner and not self._stale(*row[1:], now):
                        others.add(key)
                        continue
                    self._conn.execute(
                        "INSERT OR REPLACE INTO claims (problem_key, config, phase, owner, host, pid, started, seen) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (*key, phase, self.owner, self._host, self._pid, self._started, now))
                    mine.add(key)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return Claims(frozenset(mine), frozenset(others), frozenset(done))

    def _stale(self, host: str, pid: int, started: str, seen: float, now: float) -> bool:
        if now - seen > STALE_AFTER_S:
            return True
        return host == self._host and not _alive(pid, started)

    def release(self, keys: Iterable[tuple[str, str]] | None = None, phase: str | None = None) -> None:
        """Drop this journal's claims: of `keys` in `phase`, or (no keys) every one it holds."""
        with self._lock:
            if keys is None:
                self._conn.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))
                return
            self._conn.executemany("DELETE FROM claims WHERE problem_key = ? AND config = ? AND phase = ? "
                                   "AND owner = ?", [(*key, phase, self.owner) for key in keys])

    def heartbeat(self) -> None:
        """Say this journal's owner is alive (at most every HEARTBEAT_S; cheap to call in a polling loop)."""
        now = time.time()
        if now - self._beat < HEARTBEAT_S:
            return
        self._beat = now
        with self._lock:
            self._conn.execute("UPDATE claims SET seen = ? WHERE owner = ?", (now, self.owner))

    def is_done(self, key: tuple[str, str], phase: str) -> bool:
        """Whether (problem key, Config.key()) is done for `phase` in the journal (by any process)."""
        with self._lock:
            return self._conn.execute(_DONE[phase], key).fetchone() is not None

    def problem_keys(self) -> list[str]:
        """Problems with at least one recorded candidate, sorted."""
        with self._lock:
            rows = self._conn.execute("SELECT DISTINCT problem_key FROM measurements ORDER BY problem_key").fetchall()
        return [r[0] for r in rows]

    def count(self) -> int:
        """Recorded candidates over all problems."""
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0])

    def set_meta(self, key: str, value: str) -> None:
        """Insert or replace one meta entry (command line, provenance JSON, ...); committed on return."""
        with self._lock:
            self._conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def close(self) -> None:
        """Release every claim this journal holds, then close."""
        with self._lock:
            try:
                self._conn.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))
            except sqlite3.Error:
                pass  # a closed or broken connection: the claims go stale with this process
            self._conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Journal({str(self.path)!r})"
