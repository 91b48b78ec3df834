"""`--where` expressions: parsed with :mod:`ast` into a whitelist evaluator (no ``eval``).

Grammar (Python syntax, a safe subset): names of record fields and derived values,
numbers, strings, ``True/False/None``, lists/tuples, ``and or not``, comparisons
(``< <= > >= == != in not in``, chained), arithmetic ``+ - * / // % **``, unary ``-``,
``meta.<key>`` / ``meta["key"]``, and the functions ``abs min max len round``.

Names: ``n_atoms energy e_per_atom e_per_atom_z max_force mean_force has_energy
has_forces charge multiplicity elements formula key molecule_id source sampler round
meta``. ``e_per_atom_z`` is the z-score of the energy per atom over the whole input
(its mean and std are read from the shard indices before the filter runs).

>>> w = compile_where("max_force < 20 and n_atoms <= 30 and 'N' not in elements")
>>> w.evaluate(values)  # -> bool
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any

from convergent.core.errors import InputError

NAMES = frozenset({
    "n_atoms", "energy", "e_per_atom", "e_per_atom_z", "max_force", "mean_force", "has_energy",
    "has_forces", "charge", "multiplicity", "elements", "formula", "key", "molecule_id",
    "source", "sampler", "round", "meta",
})
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.Eq: operator.eq, ast.NotEq: operator.ne,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}
_FUNCS = {"abs": abs, "min": min, "max": max, "len": len, "round": round}


class WhereError(InputError):
    """A ``--where`` expression that cannot be parsed or uses something not allowed."""


@dataclass(frozen=True)
class Where:
    """A checked expression; :meth:`evaluate` runs it on one record's values."""

    text: str
    tree: ast.Expression

    @property
    def names(self) -> set[str]:
        return {n.id for n in ast.walk(self.tree) if isinstance(n, ast.Name)}

    def evaluate(self, values: dict[str, Any]) -> bool:
        try:
            return bool(_eval(self.tree.body, values))
        except (TypeError, ValueError, ZeroDivisionError, KeyError, OverflowError) as exc:
            raise WhereError(f"--where {self.text!r}: cannot evaluate on record "
                             f"{values.get('key')!r}: {exc}") from None


def compile_where(text: str) -> Where:
    """Parse and check ``text``; :class:`WhereError` (one line, naming it) if it is bad."""
    if not text or not text.strip():
        raise WhereError("--where: empty expression", hint="e.g. --where \"max_force < 20 and n_atoms <= 30\"")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise WhereError(f"--where {text!r}: not a valid expression ({exc.msg} at column {exc.offset})",
                         hint="e.g. --where \"max_force < 20 and n_atoms <= 30\"") from None
    for node in ast.walk(tree):
        _check(node, text)
    return Where(text, tree)


def _bad(text: str, what: str) -> WhereError:
    return WhereError(f"--where {text!r}: {what}",
                      hint="allowed names: " + ", ".join(sorted(NAMES)) + "; functions: " + ", ".join(_FUNCS))


def _check(node: ast.AST, text: str) -> None:
    ok = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
          ast.Compare, ast.BinOp, ast.Constant, ast.Name, ast.Load, ast.List, ast.Tuple, ast.Call,
          ast.Attribute, ast.Subscript, *tuple(_CMP), *tuple(_BIN))
    if not isinstance(node, ok):
        raise _bad(text, f"{type(node).__name__.lower()} is not allowed")
    if isinstance(node, ast.Name) and node.id not in NAMES and node.id not in _FUNCS:
        raise _bad(text, f"unknown name {node.id!r}")
    if isinstance(node, ast.Name) and node.id in _FUNCS:
        return  # checked as the callee of a Call below
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS or node.keywords:
            raise _bad(text, "only abs(), min(), max(), len(), round() can be called")
    if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id == "meta"):
        raise _bad(text, f"attribute .{node.attr} is allowed only on meta")
    if isinstance(node, ast.Subscript) and not (
            isinstance(node.value, ast.Name) and node.value.id == "meta"
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
        raise _bad(text, "indexing is allowed only as meta['key']")
    if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool, type(None))):
        raise _bad(text, f"constant {node.value!r} is not allowed")


def _eval(node: ast.AST, v: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return v[node.id]
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_eval(x, v) for x in node.values)
        return any(_eval(x, v) for x in node.values)
    if isinstance(node, ast.UnaryOp):
        x = _eval(node.operand, v)
        if isinstance(node.op, ast.Not):
            return not x
        return -x if isinstance(node.op, ast.USub) else +x
    if isinstance(node, ast.Compare):
        left = _eval(node.left, v)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _eval(comp, v)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, v), _eval(node.right, v)
        if isinstance(node.op, ast.Pow) and isinstance(b, (int, float)) and abs(b) > 64:
            raise ValueError("exponent larger than 64")
        return _BIN[type(node.op)](a, b)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(x, v) for x in node.elts]
    if isinstance(node, ast.Call):
        return _FUNCS[node.func.id](*[_eval(a, v) for a in node.args])  # type: ignore[attr-defined]
    if isinstance(node, ast.Attribute):
        return v["meta"].get(node.attr)
    if isinstance(node, ast.Subscript):
        return v["meta"].get(node.slice.value)  # type: ignore[attr-defined]
    raise ValueError(f"unsupported {type(node).__name__}")
