"""store.atomic: writes land whole or not at all, and leave no temp files behind."""

import json
import math
import os

import pytest

from tritune.store import atomic
from tritune.store.atomic import atomic_write_json, atomic_write_text, json_safe


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_writes_text_and_creates_parents(tmp_path):
    path = tmp_path / "a" / "b" / "x.txt"
    atomic_write_text(path, "hello\n")
    assert path.read_text() == "hello\n"
    atomic_write_text(path, "again")
    assert path.read_text() == "again"
    assert leftovers(path.parent) == []


def test_keeps_mode_of_existing_file(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("old")
    os.chmod(path, 0o640)
    atomic_write_text(path, "new")
    assert path.stat().st_mode & 0o777 == 0o640


def test_json_format_and_non_finite(tmp_path):
    path = tmp_path / "x.json"
    atomic_write_json(path, {"b": 1, "a": [math.inf, -math.inf, math.nan, 1.5], "c": {"d": (math.nan,)}})
    text = path.read_text()
    assert text.endswith("}\n")
    assert text.index('"b"') < text.index('"a"')  # insertion order kept
    assert json.loads(text) == {"b": 1, "a": [None, None, None, 1.5], "c": {"d": [None]}}
    assert json_safe({"x": 2.0, "y": "s", "z": True}) == {"x": 2.0, "y": "s", "z": True}


def test_unencodable_object_leaves_old_file(tmp_path):
    path = tmp_path / "x.json"
    atomic_write_json(path, {"v": 1})
    before = path.read_text()
    with pytest.raises(TypeError):
        atomic_write_json(path, {"v": object()})
    assert path.read_text() == before
    assert leftovers(tmp_path) == []


def test_failure_mid_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.txt"
    atomic_write_text(path, "old")

    def boom(*args):
        raise OSError("disk on fire")

    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert leftovers(tmp_path) == []


def test_lock_is_reentrant_for_read_modify_write(tmp_path):
    path = tmp_path / "x.txt"
    with atomic.path_lock(path):
        atomic_write_text(path, "inside")  # takes the same lock again: must not deadlock
    assert path.read_text() == "inside"
    assert atomic.path_lock(path) is atomic.path_lock(tmp_path / "." / "x.txt")
