"""The repository commits no symlink that points outside itself (a checkout elsewhere would hold a dangling link,
e.g. the `collect2 -> /tmp/nomake/collect2` once committed at the root)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def committed_links(root: Path) -> dict[str, str]:
    """path -> target of every symlink in the index (`git ls-files -s` mode 120000; the target is the blob)."""
    listing = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=root, capture_output=True, check=True).stdout
    links = {}
    for entry in filter(None, listing.split(b"\0")):
        meta, path = entry.split(b"\t", 1)
        mode, sha, _ = meta.split()
        if mode == b"120000":
            target = subprocess.run(["git", "cat-file", "blob", sha.decode()], cwd=root, capture_output=True,
                                    check=True).stdout
            links[path.decode()] = target.decode()
    return links


def outside(root: Path, link: str, target: str) -> bool:
    """Whether `target` (as a link at `link` would resolve it, without touching the disk) leaves `root`."""
    resolved = Path(os.path.normpath(root / Path(link).parent / target))  # an absolute target replaces the rest
    return not resolved.is_relative_to(root)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_no_committed_symlink_points_outside_the_repository():
    bad = {link: target for link, target in committed_links(ROOT).items() if outside(ROOT, link, target)}
    assert bad == {}, f"committed symlinks pointing outside the repository: {bad}"


def test_outside_tells_inside_from_outside():
    root = Path("/repo")
    assert outside(root, "collect2", "/tmp/nomake/collect2")  # absolute, elsewhere
    assert outside(root, "docs/x", "../../etc/passwd")  # climbs out
    assert not outside(root, "docs/x", "../README.md")  # stays in
    assert not outside(root, "x", "/repo/src/y")  # absolute, but inside
