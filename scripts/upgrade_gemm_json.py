"""Rewrite GEMM config files of tritune's nested layout (format 1) in the aiter layout, losing nothing.

Usage: python scripts/upgrade_gemm_json.py PATH...   (a folder: its *-GEMM-*.json files). tritune reads both layouts
and rewrites a shape file in the new one when it merges into it; this is for files a reader of aiter's layout must
see now. Files already in the new layout are left as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tritune.store.atomic import atomic_write_json
from tritune.store.gemm_json import META, load_gemm_file, name_parts, to_aiter_layout


def upgrade(path: Path) -> bool:
    """Rewrite `path` in the aiter layout if it is in the nested one; True when it was rewritten."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if isinstance(doc, dict) and META in doc:
        return False
    before = load_gemm_file(path)
    try:
        new = to_aiter_layout(doc, path.name)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    atomic_write_json(path, new)
    after = load_gemm_file(path)
    fields = ("kernel", "out_dtype", "shape", "configs", "provenance")
    same = all(getattr(before, f) == getattr(after, f) for f in fields) and doc.get("by_M") == new[META].get("by_M")
    if not same:  # never expected: to_aiter_layout only moves keys
        raise AssertionError(f"{path}: the rewritten file reads differently")
    return True


def main(argv: list[str]) -> int:
    """Upgrade every file named (a folder: its GEMM files); a path that is missing, unreadable or not a GEMM file
    of either layout is one line on stderr and exit 2, and the files before it stay upgraded."""
    parser = argparse.ArgumentParser(prog="upgrade_gemm_json.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help="a GEMM config file, or a folder of them (*-GEMM-*.json)")
    args = parser.parse_args(argv)
    try:
        for arg in args.paths:
            if arg.is_dir():
                paths = sorted(p for p in arg.glob("*.json") if name_parts(p.name))
                if not paths:
                    print(f"no GEMM config files (*-GEMM-*.json) in {arg}")
            elif arg.exists():
                paths = [arg]
            else:
                raise ValueError(f"{arg}: no such file or folder")
            for path in paths:
                print(f"{'upgraded' if upgrade(path) else 'already new'}: {path}")
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        print(f"upgrade_gemm_json.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
