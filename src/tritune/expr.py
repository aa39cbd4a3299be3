"""The integer expression language of AOT run specs (docs/AOT.md) and user-kernel grids: a hand-written tokenizer
and recursive-descent parser. A leaf: it imports nothing of tritune, so `aot/` and the user-kernel API both use it.

`csrc/expr.c` evaluates the same language in the bundle's executables, so the semantics are pinned down
here: 64-bit signed arithmetic (overflow is an error, not a wrap), floor `/` and `%` as Python's `//` and
`%`, unary minus binding tighter than `* / %`, and no other syntax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

FUNCTIONS = ("cdiv", "min", "max", "numel", "first")
_ARG_FUNCTIONS = ("numel", "first")  # take an argument's name, not an expression
MAX_DEPTH = 64  # nesting limit, shared with expr.c whose parser recurses on the C stack
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


class ExprError(ValueError):
    """An expression that does not parse or cannot be evaluated; the message quotes it and the column."""


@dataclass(frozen=True)
class _Node:
    kind: str  # num name neg bin call
    pos: int  # 0-based offset of the node's first character, for messages
    value: int = 0  # num
    text: str = ""  # name, operator, or function name
    children: tuple[_Node, ...] = ()


def _fail(text: str, pos: int, message: str) -> ExprError:
    return ExprError(f'expression "{text}", column {pos + 1}: {message}')


def _is_ident_start(ch: str) -> bool:
    return ch == "_" or ("a" <= ch <= "z") or ("A" <= ch <= "Z")


def _is_digit(ch: str) -> bool:
    # Not str.isdigit(): that accepts non-ASCII digits, which expr.c does not.
    return "0" <= ch <= "9"


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, pos) tokens; kind is num, name, op or end."""
    tokens = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch in " \t":
            i += 1
        elif _is_digit(ch):
            j = i
            while j < len(text) and _is_digit(text[j]):
                j += 1
            tokens.append(("num", text[i:j], i))
            i = j
        elif _is_ident_start(ch):
            j = i
            while j < len(text) and (_is_ident_start(text[j]) or _is_digit(text[j])):
                j += 1
            tokens.append(("name", text[i:j], i))
            i = j
        elif ch in "+-*/%(),":
            tokens.append(("op", ch, i))
            i += 1
        else:
            raise _fail(text, i, f"unexpected character {ch!r}")
    tokens.append(("end", "", len(text)))
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)*; term := unary (('*'|'/'|'%') unary)*; unary := '-' unary | primary."""

    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.i]

    def take(self) -> tuple[str, str, int]:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def expect(self, op: str) -> None:
        kind, tok, pos = self.take()
        if kind != "op" or tok != op:
            raise _fail(self.text, pos, f"expected '{op}', got {_describe(kind, tok)}")

    def parse(self) -> _Node:
        node = self.expr()
        kind, tok, pos = self.peek()
        if kind != "end":
            raise _fail(self.text, pos, f"unexpected {_describe(kind, tok)} after the expression")
        return node

    def expr(self) -> _Node:
        node = self.term()
        while self.peek()[0] == "op" and self.peek()[1] in "+-":
            _, op, pos = self.take()
            node = _Node("bin", pos, text=op, children=(node, self.term()))
        return node

    def term(self) -> _Node:
        node = self.unary()
        while self.peek()[0] == "op" and self.peek()[1] in "*/%":
            _, op, pos = self.take()
            node = _Node("bin", pos, text=op, children=(node, self.unary()))
        return node

    def unary(self) -> _Node:
        kind, tok, pos = self.peek()
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _fail(self.text, pos, f"nested more than {MAX_DEPTH} deep")
        try:
            if kind == "op" and tok == "-":
                self.take()
                return _Node("neg", pos, children=(self.unary(),))
            return self.primary()
        finally:
            self.depth -= 1

    def primary(self) -> _Node:
        kind, tok, pos = self.take()
        if kind == "num":
            value = int(tok)
            if value > INT64_MAX:
                raise _fail(self.text, pos, f"number {tok} does not fit in 64 bits")
            return _Node("num", pos, value=value)
        if kind == "name":
            if self.peek()[:2] == ("op", "("):
                return self.call(tok, pos)
            return _Node("name", pos, text=tok)
        if kind == "op" and tok == "(":
            node = self.expr()
            self.expect(")")
            return node
        raise _fail(self.text, pos, f"expected a number, a name or '(', got {_describe(kind, tok)}")

    def call(self, name: str, pos: int) -> _Node:
        if name not in FUNCTIONS:
            raise _fail(self.text, pos, f"unknown function '{name}' (known: {', '.join(FUNCTIONS)})")
        self.take()  # '('
        args: list[_Node] = []
        if name in _ARG_FUNCTIONS:
            kind, tok, arg_pos = self.take()
            if kind != "name" or self.peek()[:2] != ("op", ")"):
                raise _fail(self.text, arg_pos, f"{name}() takes one argument name")
            args.append(_Node("name", arg_pos, text=tok))
        elif self.peek()[:2] != ("op", ")"):
            args.append(self.expr())
            while self.peek()[:2] == ("op", ","):
                self.take()
                args.append(self.expr())
        self.expect(")")
        if name not in _ARG_FUNCTIONS and len(args) != 2:
            raise _fail(self.text, pos, f"{name}() takes 2 arguments, got {len(args)}")
        return _Node("call", pos, text=name, children=tuple(args))


def _describe(kind: str, tok: str) -> str:
    return "the end" if kind == "end" else f"'{tok}'"


def _parse(text: str) -> _Node:
    return _Parser(text).parse()


def check(text: str) -> None:
    """Raise ExprError when `text` is not a well-formed expression (names and functions are not looked up)."""
    _parse(text)


def _walk(node: _Node) -> Iterator[_Node]:
    yield node
    for child in node.children:
        yield from _walk(child)


def names_used(text: str) -> set[str]:
    """Every identifier in `text` that is not a function name (variables and numel()/first() operands)."""
    return {node.text for node in _walk(_parse(text)) if node.kind == "name"}


def args_used(text: str) -> set[str]:
    """The argument names `text` passes to numel() and first()."""
    return {
        node.children[0].text for node in _walk(_parse(text)) if node.kind == "call" and node.text in _ARG_FUNCTIONS
    }


def variables_used(text: str) -> set[str]:
    """The identifiers `text` looks up as integers: `names_used` less the numel()/first() operands."""
    return {node.text for node in _variables(_parse(text))}


def _variables(node: _Node) -> list[_Node]:
    if node.kind == "name":
        return [node]
    if node.kind == "call" and node.text in _ARG_FUNCTIONS:
        return []
    return [found for child in node.children for found in _variables(child)]


class _Evaluator:
    def __init__(
        self,
        text: str,
        names: Mapping[str, int],
        numel: Callable[[str], int] | None,
        first: Callable[[str], int] | None,
    ):
        self.text = text
        self.names = names
        self.functions = {"numel": numel, "first": first}

    def checked(self, value: int, pos: int) -> int:
        if not INT64_MIN <= value <= INT64_MAX:
            raise _fail(self.text, pos, "64-bit integer overflow")
        return value

    def eval(self, node: _Node) -> int:
        if node.kind == "num":
            return node.value
        if node.kind == "name":
            try:
                value = self.names[node.text]
            except KeyError:
                raise _fail(self.text, node.pos, f"unknown name '{node.text}'") from None
            return self.checked(int(value), node.pos)
        if node.kind == "neg":
            return self.checked(-self.eval(node.children[0]), node.pos)
        if node.kind == "bin":
            a, b = (self.eval(child) for child in node.children)
            return self.checked(self.binary(node.text, a, b, node.pos), node.pos)
        return self.call(node)

    def binary(self, op: str, a: int, b: int, pos: int) -> int:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if b == 0:
            raise _fail(self.text, pos, "division by zero")
        return a // b if op == "/" else a % b

    def call(self, node: _Node) -> int:
        name = node.text
        if name in _ARG_FUNCTIONS:
            arg = node.children[0].text
            fn = self.functions[name]
            if fn is None:
                raise _fail(self.text, node.pos, f"{name}() is not available here")
            try:
                value = fn(arg)
            except KeyError:
                raise _fail(self.text, node.pos, f"{name}({arg}): unknown argument '{arg}'") from None
            except ValueError as e:
                raise _fail(self.text, node.pos, f"{name}({arg}): {e}") from None
            return self.checked(int(value), node.pos)
        a, b = (self.eval(child) for child in node.children)
        if name == "min":
            return min(a, b)
        if name == "max":
            return max(a, b)
        if b == 0:
            raise _fail(self.text, node.pos, "division by zero in cdiv()")
        return self.checked(-(-a // b), node.pos)  # ceil(a / b) for every sign, as expr.c


def evaluate(
    text: str,
    names: Mapping[str, int],
    *,
    numel: Callable[[str], int] | None = None,
    first: Callable[[str], int] | None = None,
) -> int:
    """The value of expression `text`, looking identifiers up in `names`.

    `numel(ARG)` and `first(ARG)` call the given callbacks with the argument's name; a callback raising
    KeyError (unknown argument) or ValueError becomes an ExprError quoting the expression. Raises ExprError
    on any syntax error, unknown name or function, division by zero or 64-bit overflow.
    """
    return _Evaluator(text, names, numel, first).eval(_parse(text))
