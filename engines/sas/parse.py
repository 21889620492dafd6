"""Text form of SAS patterns (profiles' `pattern:` key): a small recursive-descent parser, no `eval`.

    pattern := term ('+' term)*                  or
    term    := unary ('*' unary)*                and
    unary   := ('~' | '!') unary | spread        not
    spread  := atom ('>>' spread)?              tile >> pattern (right-associative)
    atom    := NAME '(' [arg (',' arg)*] ')' | '(' pattern ')'
    arg     := NAME '=' (INT | [INT] ':' [INT] | '[' INT ',' INT ']' | true | false | NAME ('.' NAME ['(' INT ')'])*)

e.g. "Rect(keys=0:32) + Diag(window=1024)" (StreamingLLM), "Rect(size=[128, 128]) >> Diag(window=3)" (three
local blocks), "Diag(window=1024) + Dynamic(budget=512)" (sliding window + H2O). Every error is one line that
names the column and the offending text.
"""

from __future__ import annotations

import re

from engines.sas.pattern import Diag, Dynamic, Not, Pattern, Rect, Span

_TOKEN = re.compile(r"\s*(?:(?P<num>-?\d+)|(?P<name>[A-Za-z_]\w*)|(?P<op>>>|[-+*~!()=,:\[\].]))")
_PRIMITIVES = ("Rect", "Diag", "Dynamic")
# Integers a pattern may hold (positions, sizes: far below int64, whose overflow would surface much later) and
# how deeply it may nest (deeper patterns are not written by hand, and the tree is walked recursively).
MAX_INT = 1 << 48
MAX_DEPTH = 64


def _clip(text: str, limit: int = 40) -> str:
    """A piece of the user's pattern for an error message, capped (a 100 KB token is not echoed whole)."""
    return repr(text) if len(text) <= limit else repr(text[:limit - 10] + "…" + text[-6:])
_ARGS = {"Rect": ("queries", "keys", "size", "stride", "offset"), "Diag": ("window", "size", "offset", "stride"),
         "Dynamic": ("budget", "refresh", "score")}


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            col = len(text) - len(text[pos:].lstrip())
            raise ValueError(f"bad pattern at column {col + 1}: unexpected character {text[col]!r} in {_clip(text)}")
        kind = m.lastgroup
        if kind == "num" and abs(int(m.group(kind))) > MAX_INT:
            raise ValueError(f"bad pattern at column {m.start(kind) + 1}: integer {_clip(m.group(kind))} is too "
                             f"large (at most {MAX_INT:,})")
        tokens.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    tokens.append(("end", "", len(text)))
    return tokens


class _Parser:
    def __init__(self, text: str):
        self.text, self.tokens, self.i = text, _tokenize(text), 0
        self.depth = 0

    def error(self, message: str, token=None) -> ValueError:
        kind, value, col = token or self.tokens[self.i]
        where = "the end" if kind == "end" else _clip(value)
        return ValueError(f"bad pattern at column {col + 1} ({where}): {message}")

    def peek(self, value: str | None = None, kind: str | None = None) -> bool:
        tk, tv, _ = self.tokens[self.i]
        return (value is None or tv == value) and (kind is None or tk == kind)

    def take(self, value: str | None = None, kind: str | None = None, what: str = ""):
        if not self.peek(value, kind):
            raise self.error(f"expected {what or repr(value)}")
        self.i += 1
        return self.tokens[self.i - 1]

    def pattern(self) -> Pattern:
        node = self.term()
        while self.peek("+", "op"):
            self.i += 1
            node = node + self.term()
        return node

    def term(self) -> Pattern:
        node = self.unary()
        while self.peek("*", "op"):
            self.i += 1
            node = node * self.unary()
        return node

    def unary(self) -> Pattern:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"nested more than {MAX_DEPTH} deep")
        try:
            if self.peek("~", "op") or self.peek("!", "op"):
                self.i += 1
                return Not(self.unary())
            return self.spread()
        finally:
            self.depth -= 1

    def spread(self) -> Pattern:
        token = self.tokens[self.i]
        node = self.atom()
        if not self.peek(">>", "op"):
            return node
        self.i += 1
        if not isinstance(node, Rect):
            raise self.error("the left side of >> must be a Rect (the tile)", token)
        inner = self.spread()
        try:
            return node >> inner
        except ValueError as exc:
            raise self.error(str(exc), token) from None

    def atom(self) -> Pattern:
        if self.peek("(", "op"):
            self.i += 1
            node = self.pattern()
            self.take(")", "op")
            return node
        token = self.tokens[self.i]
        if token[0] != "name":
            raise self.error("expected a primitive (Rect, Diag, Dynamic) or '('")
        if token[1] not in _PRIMITIVES:
            raise self.error("unknown primitive; expected Rect, Diag or Dynamic")
        self.i += 1
        self.take("(", "op")
        args = {}
        while not self.peek(")", "op"):
            if args:
                self.take(",", "op", "',' or ')'")
            key_token = self.take(kind="name", what="an argument name")
            if key_token[1] not in _ARGS[token[1]]:
                raise self.error(f"unknown argument of {token[1]}; expected one of {', '.join(_ARGS[token[1]])}",
                                 key_token)
            if key_token[1] in args:
                raise self.error("argument given twice", key_token)
            self.take("=", "op")
            args[key_token[1]] = (self.value(), key_token)
        self.take(")", "op")
        return self.build(token, args)

    def value(self):
        if self.peek("[", "op"):
            self.i += 1
            first = int(self.take(kind="num", what="an integer")[1])
            self.take(",", "op")
            second = int(self.take(kind="num", what="an integer")[1])
            self.take("]", "op")
            return (first, second)
        if self.peek(kind="num") or self.peek(":", "op"):
            start = int(self.take(kind="num")[1]) if self.peek(kind="num") else None
            if not self.peek(":", "op"):
                return start
            self.i += 1
            stop = int(self.take(kind="num")[1]) if self.peek(kind="num") else None
            return Span(start or 0, stop)
        name = self.take(kind="name", what="a value")[1]
        if name in ("true", "false"):
            return name == "true"
        chain = [name]
        while self.peek(".", "op"):
            self.i += 1
            step = self.take(kind="name", what="a score step")[1]
            if self.peek("(", "op"):
                self.i += 1
                step += f"({self.take(kind='num', what='an integer')[1]})"
                self.take(")", "op")
            chain.append(step)
        return ".".join(chain)

    def build(self, token, args) -> Pattern:
        kind = token[1]
        values = {}
        for key, (value, key_token) in args.items():
            values[key] = _check_arg(kind, key, value, lambda msg, t=key_token: self.error(msg, t))
        try:
            if kind == "Rect":
                if "size" in values:
                    if "queries" in values or "keys" in values:
                        raise ValueError("give size or queries/keys, not both")
                    rows, cols = values.pop("size")
                    values.update(queries=Span(0, rows), keys=Span(0, cols))
                return Rect(**values)
            if kind == "Diag":
                if "size" in values:
                    if "window" in values:
                        raise ValueError("give window or size, not both")
                    values["window"] = values.pop("size")
                return Diag(**values)
            values.update(values.pop("score", {}))
            return Dynamic(**values)
        except (ValueError, TypeError) as exc:
            # Point at the argument the message names, if any.
            text = f" {exc} "
            named = sorted((text.index(f" {key} "), t) for key, (_, t) in args.items() if f" {key} " in text)
            raise self.error(str(exc), named[0][1] if named else token) from None


def _check_arg(kind: str, key: str, value, fail):
    if key in ("queries", "keys"):
        if not isinstance(value, Span):
            raise fail(f"{kind} {key} takes a range start:stop (either side may be left out), got {_clip(str(value))}")
        return value
    if key == "size" and kind == "Rect":
        if not isinstance(value, tuple):
            raise fail(f"Rect size takes [rows, columns], got {_clip(str(value))}")
        return value
    if key == "refresh":
        if not isinstance(value, bool):
            raise fail(f"refresh takes true or false, got {_clip(str(value))}")
        return value
    if key == "score":
        if not isinstance(value, str):
            raise fail(f"score takes a chain like attn.sum.pool(3), got {_clip(str(value))}")
        return _score(value, fail)
    if not isinstance(value, int) or isinstance(value, bool):
        raise fail(f"{kind} {key} takes an integer, got {_clip(str(value))}")
    return value


def _score(chain: str, fail) -> dict:
    steps = chain.split(".")
    if steps[0] != "attn":
        raise fail(f"a score chain starts with attn (attention probabilities), got {_clip(chain)}")
    out = {}
    for step in steps[1:]:
        m = re.fullmatch(r"pool\((\d+)\)", step)
        if m and "pool" not in out:
            out["pool"] = int(m.group(1))
            if out["pool"] < 1 or out["pool"] % 2 == 0:
                raise fail(f"the pool width must be an odd integer >= 1, got {out['pool']} in {_clip(chain)}")
        elif step in ("sum", "mean", "max") and "reduce" not in out and "pool" not in out:
            out["reduce"] = step
        else:
            raise fail(f"bad score step {step!r} in {_clip(chain)}; expected attn[.sum|.mean|.max][.pool(w)]")
    return out


def parse_pattern(text: str) -> Pattern:
    """Pattern text -> Pattern; ValueError with the column of the first problem."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("bad pattern: empty; expected e.g. 'Rect(keys=0:32) + Diag(window=1024)'")
    parser = _Parser(text)
    try:
        node = parser.pattern()
    except RecursionError:
        raise ValueError(f"bad pattern: nested too deeply (at most {MAX_DEPTH} levels)") from None
    if not parser.peek(kind="end"):
        raise parser.error("expected '+', '*', '>>' or the end")
    return node
