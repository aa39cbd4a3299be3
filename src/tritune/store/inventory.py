"""What `tritune configs` lists: every tuned-config file of a folder (or of the places the run-time lookups read),
its kind, what it was tuned on, and whether the running machine would use it (the policy of `provenance`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from tritune import knobs
from tritune.store import fmoe_csv, fmoe_rows, gemm_json, grouped_gemm_json, user_json
from tritune.store.provenance import Machine, Recorded, compare

GEMM_SHAPE, GEMM_DEFAULT, FMOE, GROUPED, USER = "gemm shape", "gemm default", "fused-moe csv", "grouped-gemm", \
    "user kernel"
USER_SUBFOLDER = "user_kernels"  # where UserKernel.store_path puts its files under TRITUNE_CONFIG_DIR


@dataclass(frozen=True)
class Listed:
    """One tuned file, or one group of its rows or entries tuned on one machine (fused-MoE CSV, grouped-GEMM and
    user-kernel files may hold several)."""

    path: Path
    kind: str  # GEMM_SHAPE, GEMM_DEFAULT, FMOE, GROUPED or USER
    tuned_on: str  # Recorded.describe(); "" when malformed
    status: str  # "used", "used (Triton 3.6 != 3.9)", "skipped: <why>" or "malformed: <one-line reason>"
    count: int | None = None  # rows or entries in the group; None for a whole GEMM file

    @property
    def ok(self) -> bool:
        """Used as is."""
        return self.status == "used"


@dataclass(frozen=True)
class Inventory:
    machine: Machine
    places: tuple[str, ...]  # what was searched, for the report
    items: tuple[Listed, ...]

    @property
    def ok(self) -> bool:
        """Every file would be used as is (what `tritune configs --check` exits 0 on)."""
        return all(item.ok for item in self.items)

    def lines(self) -> list[str]:
        """The report: the machine, the places searched, each file with its items, then a count per outcome."""
        m = self.machine
        out = [f"this machine: {m.describe()}"]
        if m.interpreter:
            out.append("  no GPU: Triton's interpreter stands in, so every config tuned on a GPU is skipped here, as "
                       "the run-time lookups skip it (run this on that GPU to check it there)")
        out += [f"searched: {place}" for place in self.places]
        last = None
        for item in self.items:
            if item.path != last:
                out.append(str(item.path))
                last = item.path
            rows = "" if item.count is None else f", {item.count} {_noun(item.kind, item.count)}"
            tuned = f": tuned on {item.tuned_on}" if item.tuned_on else ""
            out.append(f"    {item.kind}{rows}{tuned} -> {item.status}")
        if not self.items:
            out.append("no tuned config files found")
        counts = {"used as is": sum(i.ok for i in self.items),
                  "used with a warning": sum(i.status.startswith("used (") for i in self.items),
                  "skipped": sum(i.status.startswith("skipped") for i in self.items),
                  "malformed": sum(i.status.startswith("malformed") for i in self.items)}
        files = len({i.path for i in self.items})
        out.append(f"{files} file(s), {len(self.items)} item(s): " + ", ".join(f"{n} {k}" for k, n in counts.items()))
        return out


def _noun(kind: str, count: int) -> str:
    if kind == FMOE:
        return "row" if count == 1 else "rows"
    return "entry" if count == 1 else "entries"


def kind_of(path: Path) -> str | None:
    """The kind of a tuned file by its name (and, for other CSV/JSON files, its header or `format`); None for a file
    that is not one."""
    if path.name.endswith("-GROUPED_GEMM.json"):
        return GROUPED
    parts = gemm_json.name_parts(path.name)
    if parts:
        return GEMM_SHAPE if parts[2] else GEMM_DEFAULT
    if path.suffix == ".csv":
        if "tuned_fmoe" in path.name.replace("untuned", ""):
            return FMOE
        try:
            with path.open(encoding="utf-8-sig") as f:
                header = {name.strip() for name in f.readline().split(",")}
        except (OSError, UnicodeDecodeError):
            return None
        return FMOE if set(fmoe_rows.TUNED_COLUMNS) <= header else None
    if path.suffix == ".json":
        if path.parent.name == USER_SUBFOLDER:
            return USER
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return USER if isinstance(doc, dict) and doc.get("format") == user_json.FORMAT else None
    return None


def _named_for(slug: str, machine: Machine, status: str) -> str:
    """A file named for another device is never looked up on this machine, whatever its provenance says."""
    if status.startswith("skipped") or slug == gemm_json.slug_of(machine.name):
        return status
    return f"skipped: named for {slug}, this is {machine.name}"


def _groups(path: Path, kind: str, recorded: Iterable[Recorded], machine: Machine) -> list[Listed]:
    counts: dict[Recorded, int] = {}
    for rec in recorded:
        counts[rec] = counts.get(rec, 0) + 1
    if not counts:
        return [Listed(path, kind, "nothing tuned (no rows or entries)", "used", 0)]
    return [Listed(path, kind, rec.describe(), compare(rec, machine).status(), n) for rec, n in counts.items()]


def _gemm(path: Path, kind: str, machine: Machine) -> list[Listed]:
    recorded = gemm_json.load_gemm_file(path).recorded  # either layout
    status = compare(recorded, machine).status()
    parts = gemm_json.name_parts(path.name)
    return [Listed(path, kind, recorded.describe(), _named_for(parts[0], machine, status) if parts else status)]


def _grouped(path: Path, kind: str, machine: Machine) -> list[Listed]:
    device, entries = grouped_gemm_json.read_store_file(path)
    slug = path.name.removesuffix("-GROUPED_GEMM.json")
    return [replace(item, status=_named_for(slug, machine, item.status))
            for item in _groups(path, kind, (e.recorded(device) for e in entries), machine)]


_READERS: dict[str, Callable[[Path, str, Machine], list[Listed]]] = {
    GEMM_SHAPE: _gemm,
    GEMM_DEFAULT: _gemm,
    FMOE: lambda path, kind, machine: _groups(path, kind, (r.recorded() for r in fmoe_csv.read_tuned(path)), machine),
    GROUPED: _grouped,
    USER: lambda path, kind, machine: _groups(
        path, kind, (e.recorded() for e in user_json.UserKernelStore(path).entries()), machine),
}


def check_file(path: Path, kind: str, machine: Machine) -> list[Listed]:
    """The items of one file of `kind`; a file that cannot be read is one item, "malformed: <reason>"."""
    try:
        return _READERS[kind](path, kind, machine)
    except (OSError, ValueError) as err:  # FmoeCsvError and UserStoreError are ValueErrors
        reason = " ".join(str(err).split())
        for prefix in (f"{path}: ", f"{path}, "):
            reason = reason.removeprefix(prefix)
        return [Listed(path, kind, "", f"malformed: {reason}")]


def _folder_items(folder: Path, machine: Machine) -> list[Listed]:
    """Every tuned file directly in `folder` and in its user_kernels/ subfolder, sorted by name."""
    paths = [p for sub in (folder, folder / USER_SUBFOLDER) if sub.is_dir() for p in sorted(sub.iterdir())]
    items = []
    for path in paths:
        kind = kind_of(path) if path.is_file() else None
        if kind is not None:
            items += check_file(path, kind, machine)
    return items


def check_folder(folder: Path, machine: Machine) -> Inventory:
    """Every tuned file in `folder` (and `folder/user_kernels/`), as `machine` would take it."""
    return Inventory(machine, (str(folder),), tuple(_folder_items(Path(folder), machine)))


def check_defaults(machine: Machine) -> Inventory:
    """The files the run-time lookups read: TRITUNE_CONFIG_DIR (GEMM, grouped-GEMM and user_kernels/ files), the
    shipped GEMM and grouped-GEMM folders, and the fused-MoE CSVs (TRITUNE_CONFIG_DIR's tuned_fmoe.csv, then
    TRITUNE_CONFIG_FMOE if set, else the shipped ones). A bad TRITUNE_CONFIG_DIR or TRITUNE_CONFIG_FMOE is a
    ValueError naming it."""
    user_dir = knobs.config_dir()
    fmoe_files = fmoe_csv.default_config_files()
    places, items = [], []
    if user_dir is not None:
        places.append(f"{knobs.CONFIG_DIR}={user_dir}")
        items += [item for item in _folder_items(user_dir, machine) if item.kind != FMOE]  # listed below if read
    for folder in (gemm_json.PACKAGE_DIR, grouped_gemm_json.PACKAGE_DIR):
        places.append(f"shipped {folder}")
        items += _folder_items(folder, machine)
    user_fmoe = None if user_dir is None else user_dir / fmoe_csv.USER_FILE_NAME
    read_from = ([f"{knobs.CONFIG_DIR}/{fmoe_csv.USER_FILE_NAME}"] if user_fmoe in fmoe_files else []) + [
        knobs.CONFIG_FMOE if knobs.fmoe_config_files() else "shipped"]
    source = f"fused-MoE CSVs ({' then '.join(read_from)})"
    places.append(f"{source}: {', '.join(map(str, fmoe_files)) or 'none'}")
    for path in fmoe_files:
        items += check_file(path, FMOE, machine)
    return Inventory(machine, tuple(places), tuple(items))
