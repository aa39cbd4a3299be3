"""The expression language of run specs and grids (tritune.expr): precedence, floor semantics, functions, errors."""

import random

import pytest

from tritune.expr import (
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    ExprError,
    args_used,
    check,
    evaluate,
    names_used,
    variables_used,
)

NAMES = {"EM": 3064, "BLOCK_SIZE_M": 64, "N": 4096, "neg": -7, "zero": 0}


@pytest.mark.parametrize(
    "text, value",
    [
        ("1 + 2 * 3", 7),  # * before +
        ("(1 + 2) * 3", 9),
        ("10 - 4 - 3", 3),  # left associative
        ("64 / 4 / 2", 8),
        ("7 % 4 * 2", 6),  # % and * same level, left to right
        ("2 * 7 % 4", 2),
        ("-2 * 3", -6),
        ("- - 5", 5),
        ("-(2 + 3) * 2", -10),
        ("1 - -1", 2),
        ("EM / BLOCK_SIZE_M * BLOCK_SIZE_M", 3008),
        ("\t N  +1", 4097),  # spaces and tabs anywhere
        ("007", 7),  # leading zeros are decimal, not octal
    ],
)
def test_precedence_and_associativity(text, value):
    assert evaluate(text, NAMES) == value


@pytest.mark.parametrize("a", [-7, -6, -1, 0, 1, 6, 7, INT64_MIN + 1, INT64_MAX])
@pytest.mark.parametrize("b", [-3, -1, 1, 2, 3, 64])
def test_floor_division_and_remainder_match_python(a, b):
    names = {"a": a, "b": b}
    assert evaluate("a / b", names) == a // b
    assert evaluate("a % b", names) == a % b
    assert evaluate("cdiv(a, b)", names) == -(-a // b)


def test_unary_minus_binds_tighter_than_division():
    # As Python's -7 // 2: (-7) / 2 = -4, not -(7 / 2) = -3.
    assert evaluate("-7 / 2", {}) == -4
    assert evaluate("-(7 / 2)", {}) == -3
    assert evaluate("neg % 2", NAMES) == 1


def test_functions():
    assert evaluate("cdiv(EM, BLOCK_SIZE_M)", NAMES) == 48
    assert evaluate("cdiv(0, 5)", {}) == 0
    assert evaluate("min(EM, N) + max(-1, neg)", NAMES) == 3063
    assert evaluate("max(min(1, 2), min(3, 4))", {}) == 3
    counts = {"sorted_token_ids": 3064, "c": 8192}
    firsts = {"num_tokens_post_padded": 2944}
    value = evaluate(
        "cdiv(first(num_tokens_post_padded), BLOCK_SIZE_M) * cdiv(numel(c), N)",
        NAMES,
        numel=counts.__getitem__,
        first=firsts.__getitem__,
    )
    assert value == 46 * 2


_PY_OPS = {
    "+": lambda x, y: x + y,
    "-": lambda x, y: x - y,
    "*": lambda x, y: x * y,
    "/": lambda x, y: x // y,
    "%": lambda x, y: x % y,
}


def test_random_expressions_agree_with_python():
    # a OP1 b OP2 c with Python's precedence and floor semantics as the oracle.
    rng = random.Random(0)
    for _ in range(300):
        a, b, c = rng.randint(-50, 50), rng.randint(-9, 9), rng.randint(-50, 50)
        op1, op2 = rng.choice("+-*/%"), rng.choice("+-*/%")
        text = f"{a} {op1} {b} {op2} {c}"
        try:
            if op1 in "*/%" or op2 in "+-":
                expected = _PY_OPS[op2](_PY_OPS[op1](a, b), c)
            else:
                expected = _PY_OPS[op1](a, _PY_OPS[op2](b, c))
        except ZeroDivisionError:
            with pytest.raises(ExprError, match="division by zero"):
                evaluate(text, {})
            continue
        assert evaluate(text, {}) == expected, text


def test_names_used_and_args_used():
    text = "cdiv(first(num_tokens_post_padded), BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N) + numel(c) - min(x, 1)"
    assert names_used(text) == {"num_tokens_post_padded", "BLOCK_SIZE_M", "N", "BLOCK_SIZE_N", "c", "x"}
    assert variables_used(text) == {"BLOCK_SIZE_M", "N", "BLOCK_SIZE_N", "x"}
    assert args_used(text) == {"num_tokens_post_padded", "c"}
    assert names_used("42") == set()


@pytest.mark.parametrize(
    "text, match",
    [
        ("", r"column 1: expected a number, a name or '\(', got the end"),
        ("1 +", r"column 4: expected a number, a name or '\(', got the end"),
        ("(1 + 2", r"column 7: expected '\)', got the end"),
        ("1 2", r"column 3: unexpected '2' after the expression"),
        ("N)", r"column 2: unexpected '\)' after the expression"),
        ("1 $ 2", r"column 3: unexpected character '\$'"),
        ("+1", r"column 1: expected a number"),  # no unary plus
        ("2 ** 3", r"column 4: expected a number"),
        ("foo(1)", r"column 1: unknown function 'foo'"),
        ("min(1)", r"column 1: min\(\) takes 2 arguments, got 1"),
        ("max(1, 2, 3)", r"column 1: max\(\) takes 2 arguments, got 3"),
        ("cdiv()", r"column 1: cdiv\(\) takes 2 arguments, got 0"),
        ("numel(1)", r"column 7: numel\(\) takes one argument name"),
        ("first(a, b)", r"column 7: first\(\) takes one argument name"),
        ("numel(a + 1)", r"column 7: numel\(\) takes one argument name"),
        ("9223372036854775808", r"column 1: number 9223372036854775808 does not fit in 64 bits"),
        ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), rf"nested more than {MAX_DEPTH} deep"),
    ],
)
def test_syntax_errors_quote_the_expression_and_column(text, match):
    for call in (lambda: evaluate(text, NAMES), lambda: check(text), lambda: names_used(text)):
        with pytest.raises(ExprError, match=match) as info:
            call()
        assert str(info.value).startswith(f'expression "{text}", column ')


def test_nesting_up_to_the_limit_is_fine():
    depth = MAX_DEPTH - 1
    assert evaluate("(" * depth + "1" + ")" * depth, {}) == 1


@pytest.mark.parametrize(
    "text, match",
    [
        ("N / zero", r"column 3: division by zero"),
        ("N % (1 - 1)", r"column 3: division by zero"),
        ("cdiv(N, zero)", r"column 1: division by zero in cdiv\(\)"),
        ("M + 1", r"column 1: unknown name 'M'"),
        ("9223372036854775807 + 1", r"column 21: 64-bit integer overflow"),
        ("-9223372036854775807 - 2", r"64-bit integer overflow"),
        ("4294967296 * 4294967296", r"64-bit integer overflow"),
        ("(-9223372036854775807 - 1) / -1", r"64-bit integer overflow"),
        ("-(-9223372036854775807 - 1)", r"64-bit integer overflow"),
        ("numel(x)", r"numel\(\) is not available here"),
    ],
)
def test_evaluation_errors(text, match):
    check(text)  # syntax is fine
    with pytest.raises(ExprError, match=match):
        evaluate(text, NAMES)


def test_int64_min_remainder_is_zero_not_overflow():
    assert evaluate("(-9223372036854775807 - 1) % -1", {}) == 0
    assert evaluate("-9223372036854775807 - 1", {}) == INT64_MIN


def test_callback_errors_become_expr_errors():
    def numel(name):
        raise KeyError(name)

    def first(name):
        raise ValueError("x.tdat: first element wanted from a fp32 tensor")

    with pytest.raises(ExprError, match=r"numel\(c\): unknown argument 'c'"):
        evaluate("numel(c)", {}, numel=numel)
    with pytest.raises(ExprError, match=r"first\(c\): x\.tdat: first element wanted from a fp32"):
        evaluate("1 + first(c)", {}, first=first)
    with pytest.raises(ExprError, match="overflow"):
        evaluate("numel(c)", {}, numel=lambda name: 1 << 63)
