"""Float module attributes that change between calls, followed through a recorded call.

DUA sets every BatchNorm's momentum before each call (`bn.momentum_now = m`), and the forward
passes `1 - m` and `alpha=m` to its ops: the graph takes them as scalar inputs
(recording/scalars.py), but a replay skips the Python that computed them, so no such call
replayed. An attribute set to another float between calls is *dynamic* (replay/watch.py): while a
call is recorded it holds a `Tracked` float, which remembers how each value computed from it was
made (`1 - m` is `rsub(m, 1)`) and records every comparison and conversion Python makes of one
as a check. A graph's float input whose value is one of those is, in the trace,
that expression; a replay evaluates it on the attributes as they are now (the same float
operations in the same order: the same bits), and runs only if every check holds again.

Python that reads a tracked float in C (`math.exp(m)`, `np.float32(m)`) gets a plain float this
cannot follow: a graph input made of it matches no expression, and the call does not replay. A
replay needs two calls in a row to give the same trace, so a value that only happened to equal an
expression once does not replay either; and an attribute replays at a new value only once two
such calls had it at different values (else a constant made of it, `torch.tensor(m)`, could be
stale). What this cannot see: a *branch* decided by C code reading the value (`math.isclose(m,
0.1)`, `"%.1f" % m`), which the two calls took the same way; Python's own comparisons are checked.
"""
from __future__ import annotations

import math
import operator
import threading
import weakref
from typing import Any, Callable

_local = threading.local()


class Calc:
    """One recorded call's tracked floats: value -> the expressions that made it, and the checks."""

    def __init__(self) -> None:
        self.made: dict[tuple, dict] = {}  # (value, its sign: 0.0 and -0.0 are one key) -> its expressions, in order
        self.checks: list[tuple] = []  # (fn, (expr, ...), result): fn on the values gave result
        self.attrs: tuple = ()  # (weakref of the module, name, value) of each attribute followed
        self.agreed: set = set()  # pairs of expressions checked to agree

    def value(self, v: float, expr: tuple) -> "Tracked":
        self.made.setdefault((v, math.copysign(1.0, v)), {})[expr] = None
        return Tracked(v, expr)

    def expression(self, v: Any) -> tuple | None:
        """An expression the plain float `v` of the call was made by, or None. Where several made
        its value (DUA sets one momentum on every BatchNorm), the first, and a check that the
        others still equal it: whichever Python used, the replay's value is the same."""
        exprs = self.made.get((v, math.copysign(1.0, v))) if type(v) is float else None
        if not exprs:
            return None
        first, *others = exprs
        for other in others:
            if (first, other) not in self.agreed:  # once per pair: every BatchNorm's two updates read it
                self.agreed.add((first, other))
                self.checks.append((operator.eq, (first, other), True))
        return first

    def check(self, fn: Callable, operands: tuple, result: Any) -> Any:
        self.checks.append((fn, tuple(map(expression_of, operands)), result))
        return result


def expression_of(x: Any) -> tuple:
    return x.expr if isinstance(x, Tracked) else ("const", x)


def evaluate(expr: tuple) -> Any:
    """The expression's value now; a `LookupError` when an attribute it reads is gone or no float."""
    kind = expr[0]
    if kind == "const":
        return expr[1]
    if kind == "attr":
        module = expr[1]()
        value = module.__dict__.get(expr[2]) if module is not None else None
        if type(value) is not float:
            raise LookupError(expr[2])
        return value
    return expr[1](*map(evaluate, expr[2]))


def values_hold(attrs: tuple, varied: frozenset) -> bool:
    """Does every attribute the trace was recorded with, except those `varied` between the two
    recorded calls that made it replay, hold its value then? Only a change seen between two
    recorded calls with the same trace shows that nothing Python made of the attribute outside
    the expressions (a constant `math.exp(m)` in a graph, a `torch.tensor(m)`) depends on it."""
    for ref, name, value in attrs:
        if (ref, name) not in varied:
            module = ref()
            now = module.__dict__.get(name) if module is not None else None
            if type(now) is not float or not _same(now, value):
                return False
    return True


def varied(before: tuple, after: tuple, known: frozenset) -> frozenset:
    """The attributes whose values differ between two recorded calls' `attrs`, and `known`."""
    was = {(ref, name): value for ref, name, value in before}
    return known | {(ref, name) for ref, name, value in after if (ref, name) in was and not _same(was[ref, name], value)}


def checks_hold(checks: tuple) -> bool:
    try:
        return all(_same(fn(*map(evaluate, operands)), result) for fn, operands, result in checks)
    except (LookupError, ArithmeticError, ValueError):
        return False


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _current() -> Calc | None:
    return getattr(_local, "calc", None)


def _number(x: Any) -> bool:
    return type(x) in (int, float, bool) or isinstance(x, Tracked)


def _arithmetic(fn: Callable, reflected: bool = False) -> Callable:
    def method(self: "Tracked", other: Any = None) -> Any:
        plain = float(self)
        if other is None and fn in _UNARY:
            operands: tuple = (self,)
            result = fn(plain)
        else:
            if not _number(other):
                return NotImplemented
            operands = (other, self) if reflected else (self, other)
            result = fn(*(float(o) if isinstance(o, Tracked) else o for o in operands))
        calc = _current()
        if calc is None or type(result) is not float:
            return result
        return calc.value(result, (fn.__name__, fn, tuple(map(expression_of, operands))))
    return method


def _checked(fn: Callable) -> Callable:
    def method(self: "Tracked", *others: Any) -> Any:
        if any(not (_number(o) or o is None) for o in others):  # None: round(m, None)
            return NotImplemented if fn in _COMPARISONS else fn(float(self), *others)
        plain = (float(self), *(float(o) if isinstance(o, Tracked) else o for o in others))
        result = fn(*plain)
        calc = _current()
        return calc.check(fn, (self, *others), result) if calc is not None else result
    return method


def _pinned(name: str) -> Callable:
    # what Python makes of the value that no expression follows (its text, its hash): the value itself is checked
    def method(self: "Tracked", *args: Any) -> Any:
        calc = _current()
        if calc is not None:
            calc.check(operator.eq, (self, float(self)), True)
        return getattr(float(self), name)(*args)
    return method


_UNARY = (operator.neg, operator.pos, abs)
_COMPARISONS = (operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne)


class Tracked(float):
    """A dynamic attribute's float (or one computed from it) while a call is recorded."""
    expr: tuple

    def __new__(cls, value: float, expr: tuple) -> "Tracked":
        self = super().__new__(cls, value)
        self.expr = expr
        return self

    def __float__(self) -> float:
        return float.__float__(self)

    __add__, __radd__ = _arithmetic(operator.add), _arithmetic(operator.add, True)
    __sub__, __rsub__ = _arithmetic(operator.sub), _arithmetic(operator.sub, True)
    __mul__, __rmul__ = _arithmetic(operator.mul), _arithmetic(operator.mul, True)
    __truediv__, __rtruediv__ = _arithmetic(operator.truediv), _arithmetic(operator.truediv, True)
    __floordiv__, __rfloordiv__ = _arithmetic(operator.floordiv), _arithmetic(operator.floordiv, True)
    __mod__, __rmod__ = _arithmetic(operator.mod), _arithmetic(operator.mod, True)
    __pow__, __rpow__ = _arithmetic(operator.pow), _arithmetic(operator.pow, True)
    __neg__, __pos__, __abs__ = _arithmetic(operator.neg), _arithmetic(operator.pos), _arithmetic(abs)
    __lt__, __le__ = _checked(operator.lt), _checked(operator.le)
    __gt__, __ge__ = _checked(operator.gt), _checked(operator.ge)
    __eq__, __ne__ = _checked(operator.eq), _checked(operator.ne)
    __bool__, __int__ = _checked(bool), _checked(int)
    __trunc__, __floor__, __ceil__ = _checked(math.trunc), _checked(math.floor), _checked(math.ceil)
    __round__ = _checked(round)
    __divmod__, __rdivmod__ = _checked(divmod), _checked(lambda m, other: divmod(other, m))
    __hash__ = _pinned("__hash__")
    __repr__, __str__, __format__ = _pinned("__repr__"), _pinned("__str__"), _pinned("__format__")
    is_integer, as_integer_ratio, hex = _pinned("is_integer"), _pinned("as_integer_ratio"), _pinned("hex")

    def __reduce__(self) -> tuple:
        return float, (float(self),)


class Following:
    """While a call is recorded: each dynamic float attribute of `modules` holds a `Tracked`, and
    the call's `Calc` collects what Python made of them. Put back as plain floats at the end."""

    def __init__(self, modules: list, dynamic: Callable[[Any], frozenset]) -> None:
        self.calc = Calc()
        self.swapped: list[tuple] = []
        for m in modules:
            for name in dynamic(m):
                v = m.__dict__.get(name)
                if type(v) is float:
                    self.swapped.append((m, name, v))

    def __enter__(self) -> Calc:
        self.outer = _current()
        _local.calc = self.calc
        attrs = []
        for m, name, v in self.swapped:
            ref = weakref.ref(m)
            m.__dict__[name] = self.calc.value(v, ("attr", ref, name))
            attrs.append((ref, name, v))
        self.calc.attrs = tuple(attrs)
        return self.calc

    def __exit__(self, *exc: Any) -> None:
        _local.calc = self.outer
        for m, name, v in self.swapped:
            now = m.__dict__.get(name)
            if isinstance(now, Tracked):  # the call left it as it was (one that set it counted a change)
                m.__dict__[name] = float(now)
