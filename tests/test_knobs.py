"""knobs: defaults, set values, and clear errors for bad values, all read at call time."""

from pathlib import Path

import pytest

from tritune import knobs

ALL = (knobs.CONFIG_DIR, knobs.CONFIG_FMOE, knobs.CACHE_DIR, knobs.LOG_LEVEL, knobs.ONLINE_TUNE, knobs.ONLINE_BUDGET,
       knobs.START_METHOD, knobs.TIMER_PARK, knobs.MXFP4_DECODE, knobs.WORKER_PRELOAD,
       knobs.MOE_MLP_LAYOUT, knobs.DETERMINISTIC)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert knobs.config_dir() is None
    assert knobs.fmoe_config_files() == []
    assert knobs.cache_dir() == tmp_path / ".cache" / "tritune"
    assert knobs.log_level() == "WARNING"
    assert knobs.online_tune() is False
    assert knobs.online_budget() == knobs.ONLINE_BUDGET_DEFAULT_S == 10.0
    assert knobs.start_method() == "forkserver"  # Linux has it
    assert knobs.worker_preload() is True
    assert knobs.deterministic() is False


def test_deterministic_is_a_boolean(monkeypatch):
    monkeypatch.setenv(knobs.DETERMINISTIC, "yes")
    assert knobs.deterministic() is True
    monkeypatch.setenv(knobs.DETERMINISTIC, "always")
    with pytest.raises(ValueError, match=r"^TRITUNE_DETERMINISTIC='always' is not a boolean"):
        knobs.deterministic()


@pytest.mark.parametrize(("name", "read", "default", "text", "value", "bad", "message"), [
    (knobs.MOE_MLP_LAYOUT, knobs.moe_mlp_layout, "padded", "Plain", "plain", "grouped",
     r"^TRITUNE_MOE_MLP_LAYOUT='grouped': use one of padded, plain$"),
    # the Triton-ops decode until the PTX one is measured
    (knobs.MXFP4_DECODE, knobs.mxfp4_decode, "ops", "ASM", "asm", "ptx",
     r"^TRITUNE_MXFP4_DECODE='ptx': use one of ops, asm$"),
    (knobs.TIMER_PARK, knobs.timer_park, "short", " Full ", "full", "long",
     r"^TRITUNE_TIMER_PARK='long': use one of short, full$"),
])
def test_one_of_knobs_default_case_and_refusal(name, read, default, text, value, bad, message, monkeypatch):
    assert read() == default
    monkeypatch.setenv(name, text)
    assert read() == value  # case and surrounding blanks do not matter
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=message):
        read()


def test_start_method_values(monkeypatch):
    monkeypatch.setattr(knobs.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert knobs.start_method() == "spawn"  # a platform without a fork server
    monkeypatch.undo()
    monkeypatch.setenv(knobs.START_METHOD, " ForkServer ")
    assert knobs.start_method() == "forkserver"
    monkeypatch.setenv(knobs.START_METHOD, "fork")  # the driver holds a CUDA context: never plain fork
    with pytest.raises(ValueError, match=r"^TRITUNE_START_METHOD='fork': use one of spawn, forkserver$"):
        knobs.start_method()


def test_blank_means_default(monkeypatch):
    for name in ALL:
        monkeypatch.setenv(name, "  ")
    assert knobs.config_dir() is None
    assert knobs.fmoe_config_files() == []
    assert knobs.log_level() == "WARNING"
    assert knobs.online_tune() is False
    assert knobs.online_budget() == 10.0


def test_set_values_read_at_call_time(monkeypatch, tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("x\n")
    b.write_text("x\n")
    monkeypatch.setenv(knobs.CONFIG_DIR, str(tmp_path))
    monkeypatch.setenv(knobs.CONFIG_FMOE, f"{a}::{b}")  # empty entry skipped
    monkeypatch.setenv(knobs.CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(knobs.LOG_LEVEL, "debug")
    assert knobs.config_dir() == tmp_path
    assert knobs.fmoe_config_files() == [a, b]
    assert knobs.cache_dir() == tmp_path / "cache"
    assert knobs.log_level() == "DEBUG"
    monkeypatch.setenv(knobs.LOG_LEVEL, "error")
    assert knobs.log_level() == "ERROR"


def test_config_dir_must_exist(monkeypatch, tmp_path):
    missing = tmp_path / "nope"
    monkeypatch.setenv(knobs.CONFIG_DIR, str(missing))
    with pytest.raises(ValueError, match="TRITUNE_CONFIG_DIR.*does not exist"):
        knobs.config_dir()
    afile = tmp_path / "f.json"
    afile.write_text("{}")
    monkeypatch.setenv(knobs.CONFIG_DIR, str(afile))
    with pytest.raises(ValueError, match="is not a folder"):
        knobs.config_dir()


def test_fmoe_missing_file(monkeypatch, tmp_path):
    monkeypatch.setenv(knobs.CONFIG_FMOE, str(tmp_path / "missing.csv"))
    with pytest.raises(ValueError, match="TRITUNE_CONFIG_FMOE.*missing.csv"):
        knobs.fmoe_config_files()


def test_cache_dir_not_a_file(monkeypatch, tmp_path):
    afile = tmp_path / "f"
    afile.write_text("")
    monkeypatch.setenv(knobs.CACHE_DIR, str(afile))
    with pytest.raises(ValueError, match="TRITUNE_CACHE_DIR.*not a folder"):
        knobs.cache_dir()


def test_bad_log_level(monkeypatch):
    monkeypatch.setenv(knobs.LOG_LEVEL, "LOUD")
    with pytest.raises(ValueError, match="TRITUNE_LOG_LEVEL='LOUD' is not a logging level.*DEBUG"):
        knobs.log_level()


def test_describe_lists_every_knob_and_survives_bad_values(monkeypatch, tmp_path):
    rows = knobs.describe()
    assert [r[0] for r in rows] == list(ALL)
    assert all(isinstance(doc, str) and doc for _, _, doc in rows)
    monkeypatch.setenv(knobs.LOG_LEVEL, "LOUD")
    monkeypatch.setenv(knobs.CONFIG_DIR, str(tmp_path))
    values = {name: value for name, value, _ in knobs.describe()}
    assert values[knobs.LOG_LEVEL].startswith("invalid:")
    assert values[knobs.CONFIG_DIR] == str(tmp_path)
    assert values[knobs.CONFIG_FMOE] == ""
    assert Path(values[knobs.CACHE_DIR]).name == "tritune"


@pytest.mark.parametrize(("text", "on"), [("1", True), ("0", False), ("true", True), ("FALSE", False), (" on ", True),
                                         ("no", False)])
def test_online_tune_values(text, on, monkeypatch):
    monkeypatch.setenv(knobs.ONLINE_TUNE, text)
    assert knobs.online_tune() is on


@pytest.mark.parametrize(("text", "on"), [("0", False), ("off", False), ("YES", True)])
def test_worker_preload_values(text, on, monkeypatch):
    monkeypatch.setenv(knobs.WORKER_PRELOAD, text)
    assert knobs.worker_preload() is on


@pytest.mark.parametrize(("text", "seconds"), [("2.5", 2.5), ("30", 30.0), ("1e-1", 0.1)])
def test_online_budget_values(text, seconds, monkeypatch):
    monkeypatch.setenv(knobs.ONLINE_BUDGET, text)
    assert knobs.online_budget() == seconds


@pytest.mark.parametrize(("name", "text", "read"), [
    (knobs.ONLINE_TUNE, "maybe", knobs.online_tune),  # not a boolean
    (knobs.ONLINE_TUNE, "2", knobs.online_tune),  # a number that is not 0 or 1
    (knobs.WORKER_PRELOAD, "sometimes", knobs.worker_preload),
    (knobs.ONLINE_BUDGET, "0", knobs.online_budget),  # zero seconds
    (knobs.ONLINE_BUDGET, "-3", knobs.online_budget),  # negative
    (knobs.ONLINE_BUDGET, "inf", knobs.online_budget),  # never ends
    (knobs.ONLINE_BUDGET, "nan", knobs.online_budget),
    (knobs.ONLINE_BUDGET, "5s", knobs.online_budget),  # a unit
])
def test_bad_online_values_are_one_line_naming_the_variable(name, text, read, monkeypatch):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError) as err:
        read()
    message = str(err.value)
    assert message.startswith(f"{name}={text!r}") and "\n" not in message


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "On", "y", "0", "false", "off", "", " 1", "2", "maybe"])
def test_interpreting_agrees_with_triton(text, monkeypatch):
    # One reader of TRITON_INTERPRET, with Triton's own truthiness (" 1" and "2" are false to Triton too).
    triton = pytest.importorskip("triton")
    monkeypatch.setenv(knobs.INTERPRET, text)
    assert knobs.interpreting() is bool(triton.knobs.runtime.interpret)


def test_interpreting_unset_is_false(monkeypatch):
    monkeypatch.delenv(knobs.INTERPRET, raising=False)
    assert knobs.interpreting() is False
