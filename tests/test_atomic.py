"""store.atomic: writes land whole or not at all, and leave no temp files behind."""

import json
import math
import os
import tempfile
from pathlib import Path

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


def test_locks_live_in_the_cache_folder_never_beside_the_output(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    atomic_write_json(out / "a.json", {"v": 1})
    with atomic.path_lock(out / "b.csv"):
        atomic_write_text(out / "b.csv", "x\n")
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.csv"]  # no .lock litter
    locks = sorted(p.name for p in (tmp_path / "cache" / "locks").iterdir())
    assert len(locks) == 2 and all(name.endswith(".lock") for name in locks)
    assert atomic.lock_path(out / "a.json") != atomic.lock_path(tmp_path / "a.json")  # same name, other file
    (tmp_path / "link").symlink_to(out)
    assert atomic.lock_path(tmp_path / "link" / "a.json") == atomic.lock_path(out / "a.json")  # one file, one lock


def test_lock_folder_falls_back_to_tmp_when_the_cache_cannot_be_made(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRITUNE_CACHE_DIR", str(tmp_path / "file" / "cache"))  # under a file: mkdir fails
    assert atomic.lock_folder().parent == Path(tempfile.gettempdir())


@pytest.mark.parametrize(("make", "target", "folder", "expected"), [
    ("file", "x/out.csv", False, "x is a file, not a folder"),  # a regular file where a folder must be
    ("file", "x/deeper/out.csv", False, "x is a file, not a folder"),  # ... further up
    ("dir", "x", False, "it is a folder"),  # -o names a folder, a file is needed
    ("file", "x", True, "it is a file"),  # -o names a file, a folder is needed
    ("file", "x/sub", True, "x is a file, not a folder"),
])
def test_check_writable_names_the_path_and_the_reason(make, target, folder, expected, tmp_path):
    (tmp_path / "x").mkdir() if make == "dir" else (tmp_path / "x").write_text("")
    with pytest.raises(ValueError) as info:
        atomic.check_writable(tmp_path / target, folder=folder)
    assert str(tmp_path / target) in str(info.value) and expected in str(info.value)
    assert "\n" not in str(info.value)


def test_check_writable_accepts_new_and_existing_paths(tmp_path):
    (tmp_path / "old.csv").write_text("")
    for target, folder in (("old.csv", False), ("new/deep/out.csv", False), (".", True), ("new/dir", True)):
        atomic.check_writable(tmp_path / target, folder=folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.csv"]  # nothing created


def test_check_writable_refuses_a_cache_folder_that_is_a_file(tmp_path, monkeypatch):
    # The write locks live under TRITUNE_CACHE_DIR: a file there failed only when the results were written.
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("TRITUNE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"^TRITUNE_CACHE_DIR=.*exists and is not a folder$"):
        atomic.check_writable(tmp_path / "out.csv")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_check_writable_refuses_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="no write permission"):
            atomic.check_writable(ro / "out.csv")
    finally:
        ro.chmod(0o700)
