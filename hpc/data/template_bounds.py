"""Bounds on what one chat-template rendering may build and do (issue 47), beside the sandbox that
already keeps a template from Python's internals: a template is code from a downloaded folder, and
a few lines of Jinja double a string past GBs (``{% set x = x ~ x %}`` in a loop), or loop for
hours over nested ranges without printing a character, before the streamed output's own bound sees
anything.

``BoundedEnvironment`` is transformers' sandboxed environment (``hpc.data.chat.environment``) with:

- a string, list or tuple that an operator, a concatenation (``~``), a filter or a method call would
  build past ``Budget.chars`` characters (elements) refused *before* it is built (``*``, ``+``,
  ``%``, ``~``, ``join``, ``replace``, ``center``, ``indent``, ``format``, ``wordwrap``, the string
  methods that pad or repeat; integers past ``chars`` as widths; ``**`` past 2¹⁰⁰⁰⁰ ),
- every loop iteration, every call and every element a ``range`` makes counted against
  ``Budget.steps`` (one rendering of a real template takes about ten per message; a recursive
  loop's ``loop(...)`` counts as ``RECURSE_STEPS``),
- recursion (``loop(...)`` of a recursive loop, a macro calling itself) bounded by Python's own
  recursion limit, which raises RecursionError, a refusal like any exception of the template.

A rendering past either bound raises ``TemplateBomb`` with a line saying which; ``Budget.reset``
starts each rendering afresh. Deterministic: nothing here reads a clock.
"""

from __future__ import annotations

import functools
import math
import re
import typing as tp

import jinja2.nodes as nodes
from jinja2 import Environment
from jinja2.nodes import EvalContext
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

STEPS = 200_000  # loop iterations, calls and range elements of one rendering (a real one: ~10 per message)
RECURSE_STEPS = 20  # the steps one ``loop(...)`` of a recursive loop counts for (it costs ~20 plain steps)
WIDTH = re.compile(r"\d{7,}")  # a width of millions of characters in a format string
POW_BITS = 10_000  # ``a ** b`` whose result would have more bits


class TemplateBomb(Exception):
    """A rendering past its bounds (the message says which, for the one-line refusal)."""


class Budget:
    """What one rendering may still build and do."""

    def __init__(self, chars: int, steps: int = STEPS):
        self.chars, self.steps, self.spent = chars, steps, 0

    def reset(self) -> None:
        self.spent = 0

    def step(self, n: int = 1) -> None:
        self.spent += n
        if self.spent > self.steps:
            raise TemplateBomb(f"the chat template runs past {self.steps:,} loop iterations and calls in one "
                               "rendering (a loop that never ends, or ranges nested too deep)")

    def size(self, n: int, what: str) -> None:
        """Refuse a value of ``n`` characters or elements before it is built."""
        if n > self.chars:
            raise TemplateBomb(f"the chat template builds {what} of {n:,} characters or elements, past the "
                               f"rendering's bound of {self.chars:,}")


def _len(x: tp.Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else len(str(x))


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with ``budget`` checked by every operator, loop, call and filter that may grow."""

    intercepted_binops = frozenset(["*", "+", "%", "**"])

    def __init__(self, *args: tp.Any, budget: Budget | None = None, **kwargs: tp.Any):
        super().__init__(*args, **kwargs)
        self.budget = budget or Budget(1 << 24)
        self.globals["range"] = self._range
        self.globals["__bounded_iter"] = self._iter
        self.globals["__bounded_concat"] = self._concat
        for name in ("replace", "center", "indent", "format", "join", "wordwrap"):
            self.filters[name] = _checked_filter(self.filters[name], name, self.budget)

    # ------------------------------------------------------------------ the template's code

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The parsed template with every loop's iterable and every ``~`` routed through the bounds."""
        tree = super()._parse(source, name, filename)
        for node in [tree, *tree.find_all(nodes.Node)]:
            if isinstance(node, nodes.For):
                node.iter = _call("__bounded_iter", [node.iter])
            for field in node.fields:  # a Concat's own parts are routed when it is visited (the list is shared)
                value = getattr(node, field, None)
                if isinstance(value, nodes.Concat):
                    setattr(node, field, _call("__bounded_concat", value.nodes))
                elif isinstance(value, list):
                    value[:] = [_call("__bounded_concat", v.nodes) if isinstance(v, nodes.Concat) else v
                                for v in value]
        return tree

    def _iter(self, iterable: tp.Any) -> tp.Iterator[tp.Any]:
        for item in iterable:
            self.budget.step()
            yield item

    def _concat(self, *parts: tp.Any) -> str:
        self.budget.size(sum(_len(p) for p in parts), "a string")
        return "".join(map(str, parts))

    def _range(self, *args: int) -> range:
        r = range(*args)
        self.budget.step(len(r))  # a range is made to be walked: its elements count when it is made
        self.budget.size(len(r), "a range")
        return r

    # ------------------------------------------------------------------ operators and calls

    def call_binop(self, context: tp.Any, op: str, left: tp.Any, right: tp.Any) -> tp.Any:
        self.budget.step()
        if op == "*":
            seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                self.budget.size(len(seq) * max(n, 0), "a repeated value")
        elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            self.budget.size(len(left) + len(right), "a joined value")
        elif op == "%" and isinstance(left, str):
            _check_format(left, right if isinstance(right, tuple) else (right,), {}, self.budget)
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > POW_BITS:
                raise TemplateBomb(f"the chat template computes {left} ** {right}, a number of more than "
                                   f"{POW_BITS:,} bits")
        return super().call_binop(context, op, left, right)

    def call(__self, __context: tp.Any, __obj: tp.Any, *args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        # a recursive loop's ``loop(...)`` costs a new loop context and generator: weighed as much
        __self.budget.step(RECURSE_STEPS if isinstance(__obj, LoopContext) else 1)
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, (str, list, tuple)):
            _check_method(owner, name, args, kwargs, __self.budget)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: tp.Any) -> tp.Callable[..., str] | None:
        """``str.format`` / ``format_map`` as the sandbox wraps them, with the result's size bounded."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        owner, mapping = value.__self__, value.__name__ == "format_map"

        def checked(*args: tp.Any, **kwargs: tp.Any) -> str:
            values = args[0] if mapping and args and isinstance(args[0], dict) else kwargs
            _check_format(owner, () if mapping else args, values, self.budget)
            return wrapped(*args, **kwargs)
        return checked


def _call(name: str, args: list[tp.Any]) -> nodes.Call:
    return nodes.Call(nodes.Name(name, "load"), args, [], None, None)


def _check_ints(args: tp.Iterable[tp.Any], budget: Budget, what: str) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool):
            budget.size(abs(a), what)


def _check_format(fmt: str, args: tp.Sequence[tp.Any], kwargs: tp.Mapping[str, tp.Any], budget: Budget) -> None:
    """A format string's result bounded: no width of millions, and at most its fields × its longest argument."""
    if WIDTH.search(fmt):
        raise TemplateBomb(f"the chat template formats with a width of {WIDTH.search(fmt).group()} characters")  # type: ignore[union-attr]
    _check_ints([*args, *kwargs.values()], budget, "a format width")
    values = [*args, *kwargs.values()]
    longest = max((_len(v) for v in values), default=0)
    budget.size(len(fmt) + (fmt.count("%") + fmt.count("{")) * longest, "a formatted string")


def _check_method(owner: tp.Any, name: str, args: tuple, kwargs: dict, budget: Budget) -> None:
    """The string methods that grow a string: their widths and results bounded before they run."""
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        _check_ints([*args, *kwargs.values()], budget, f"a {name} width")
        if name == "expandtabs" and isinstance(owner, str):
            budget.size(len(owner) + owner.count("\t") * int(args[0] if args else 8), "an expanded string")
    elif name == "replace" and isinstance(owner, str) and len(args) >= 2:
        budget.size(_replaced_len(owner, str(args[0]), str(args[1])), "a replaced string")
    elif name == "join" and isinstance(owner, str) and args:
        items = list(args[0]) if not isinstance(args[0], (list, tuple)) else args[0]
        budget.size(sum(_len(i) for i in items) + len(owner) * len(items), "a joined string")


def _replaced_len(s: str, old: str, new: str) -> int:
    count = s.count(old) if old else len(s) + 1
    return len(s) + count * (len(new) - len(old))


def _checked_filter(fn: tp.Callable, name: str, budget: Budget) -> tp.Callable:
    """The filter ``fn`` with its result's size bounded before it runs."""
    @functools.wraps(fn)
    def checked(*args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        budget.step()
        plain = [a for a in args if not isinstance(a, (EvalContext, Environment))]  # what some filters take first
        _check_ints([*plain[1:], *kwargs.values()], budget, f"a {name} width")
        value = plain[0] if plain else ""
        if name == "replace" and len(plain) >= 3:
            budget.size(_replaced_len(str(value), str(plain[1]), str(plain[2])), "a replaced string")
        elif name == "indent" and isinstance(value, str):
            width = plain[1] if len(plain) > 1 else kwargs.get("width", 4)
            budget.size(len(value) + (value.count("\n") + 1) * _len(width if isinstance(width, str) else " " *
                                                                     min(int(width), budget.chars + 1)),
                        "an indented string")
        elif name == "format" and isinstance(value, str):
            _check_format(value, plain[1:], kwargs, budget)
        elif name == "join" and not isinstance(value, str):
            items = list(value)
            sep = plain[1] if len(plain) > 1 else kwargs.get("d", "")
            budget.size(sum(_len(i) for i in items) + _len(sep) * len(items), "a joined string")
            args = tuple(items if a is value else a for a in args)
        elif name == "wordwrap" and isinstance(value, str):
            budget.size(2 * len(value), "a wrapped string")
        return fn(*args, **kwargs)
    return checked

