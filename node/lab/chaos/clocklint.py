"""The drills' static clock check: which clock measures durations in the node's code.

Every subtraction, comparison or ordering over wall-clock values (time.time(), the store's
`_wall_clock()`, and names and attributes that hold them, found by propagation) is a finding.
Durations must use time.monotonic(); wall-clock stamps from different hosts must not be ordered
against each other (their clocks differ, and may jump). `WALL_CLOCK_ALLOWED` lists the findings
that are not durations, each with its reason; any other finding is a violation. The clock-jump
drill runs this check, and a test runs it on the whole node package.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

# Findings that are not durations or cross-host orderings, or that only display a wall-clock
# age; each with the reason. Any other finding is a violation of "monotonic for every duration".
WALL_CLOCK_ALLOWED: dict[tuple[str, str, str], str] = {
    ("node/kvshare/explain.py", "explain", "time.time() - m.updated"):
        "display: replica age in Handoff events; the manifest's stamp must survive restarts",
    ("node/kvshare/store/index.py", "_scan", "sorted(found, key=lambda e: e.manifest.updated)"):
        "persisted: LRU order rebuilt at start from stamps that must survive restarts; a jump only reorders evictions",
    ("node/mesh/clusterview.py", "_session_info", "now - rep.store_updated"):
        "display: the cluster view's replica age",
}


def _is_call(n: ast.AST, mod: str | None, name: str) -> bool:
    if not isinstance(n, ast.Call):
        return False
    f = n.func
    if mod is None:
        return isinstance(f, ast.Name) and f.id == name
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == mod and f.attr == name


class _Clocks:
    """Which names and attributes hold wall-clock values (time.time(), store._wall_clock()) and
    which monotonic ones, found by propagation: assignments, keyword and positional (dataclass
    field order) arguments, tuple returns. An attribute name given both kinds in different
    classes is ambiguous and counts as neither."""

    def __init__(self, trees: dict[Path, ast.Module]) -> None:
        self.wall_attrs: set[str] = set()
        self.mono_attrs: set[str] = set()
        self.returns: dict[str, set[int]] = {}  # function name -> tuple positions holding wall time
        self.fields: dict[str, list[str]] = {}  # class name -> annotated fields in order
        for t in trees.values():
            for c in (n for n in ast.walk(t) if isinstance(n, ast.ClassDef)):
                self.fields[c.name] = [b.target.id for b in c.body
                                       if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]
        for _ in range(6):
            before = (len(self.wall_attrs), len(self.mono_attrs), sum(len(v) for v in self.returns.values()))
            for t in trees.values():
                self._learn(t)
            if (len(self.wall_attrs), len(self.mono_attrs), sum(len(v) for v in self.returns.values())) == before:
                break

    def _attr(self, name: str, wall: bool) -> bool:
        mine, theirs = (self.wall_attrs, self.mono_attrs) if wall else (self.mono_attrs, self.wall_attrs)
        return name in mine and name not in theirs

    def is_wall(self, n: ast.AST, names: set[str]) -> bool:
        if _is_call(n, "time", "time") or _is_call(n, None, "_wall_clock"):
            return True
        if isinstance(n, ast.Name):
            return n.id in names
        if isinstance(n, ast.Attribute):
            return self._attr(n.attr, True)
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)):
            left, right = self.is_wall(n.left, names), self.is_wall(n.right, names)
            return left != right if isinstance(n.op, ast.Sub) else (left or right)
        if isinstance(n, ast.IfExp):
            return self.is_wall(n.body, names) or self.is_wall(n.orelse, names)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("max", "min", "round", "float"):
            return any(self.is_wall(a, names) for a in n.args)
        return False

    def is_mono(self, n: ast.AST) -> bool:
        return any(_is_call(s, "time", "monotonic") or _is_call(s, "time", "perf_counter")
                   or (isinstance(s, ast.Attribute) and self._attr(s.attr, False)) for s in ast.walk(n))

    def local_names(self, fn: ast.AST) -> set[str]:
        names: set[str] = set()
        for _ in range(3):
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    if self.is_wall(n.value, names):
                        names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
                    elif isinstance(n.value, ast.Call) and isinstance(n.targets[0], ast.Tuple):
                        f = n.value.func
                        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                        for k in self.returns.get(fname, ()):
                            elts = n.targets[0].elts
                            elt = elts[k] if k < len(elts) else None
                            if isinstance(elt, ast.Name):
                                names.add(elt.id)
        return names

    def _mark(self, attr: str, value: ast.AST, names: set[str]) -> None:
        if self.is_wall(value, names):
            self.wall_attrs.add(attr)
        elif self.is_mono(value) and not isinstance(value, ast.Attribute):
            self.mono_attrs.add(attr)

    def _learn(self, tree: ast.Module) -> None:
        for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            names = self.local_names(fn)
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    for tgt in n.targets:
                        for t in ast.walk(tgt):
                            if isinstance(t, ast.Attribute):
                                self._mark(t.attr, n.value, names)
                elif isinstance(n, ast.Call):
                    for kw in n.keywords:
                        if kw.arg:
                            self._mark(kw.arg, kw.value, names)
                    order = self.fields.get(n.func.id, []) if isinstance(n.func, ast.Name) else []
                    for k, arg in enumerate(n.args[: len(order)]):
                        self._mark(order[k], arg, names)
                elif isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple) and isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    pos = {k for k, e in enumerate(n.value.elts) if self.is_wall(e, names)}
                    if pos:
                        self.returns.setdefault(fn.name, set()).update(pos)


def _kind(n: ast.AST, clocks: _Clocks, names: set[str]) -> str | None:
    """"duration" or "ordering" when `n` subtracts, compares or orders wall-clock values; else None."""
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub):
        lw, rw = clocks.is_wall(n.left, names), clocks.is_wall(n.right, names)
        other = n.left if rw and not lw else n.right if lw and not rw else None
        # wall - monotonic age = a wall timestamp (a conversion), unless time.time() is in it.
        mixed = other is not None and clocks.is_mono(other) and not any(
            _is_call(x, "time", "time") for x in ast.walk(n))
        return "duration" if (lw or rw) and not mixed else None
    if isinstance(n, ast.Compare) and len(n.comparators) == 1 \
            and not isinstance(n.ops[0], (ast.Is, ast.IsNot, ast.In, ast.NotIn)):
        # A wall stamp against anything but a constant (0 = "never") or a monotonic value.
        sides = (n.left, n.comparators[0])
        walls = [clocks.is_wall(x, names) for x in sides]
        other = sides[1] if walls[0] else sides[0]
        if any(walls) and (all(walls) or not (isinstance(other, ast.Constant) or clocks.is_mono(other))):
            return "ordering"
        return None
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("max", "min", "sorted") \
            and any(kw.arg == "key" and isinstance(kw.value, ast.Lambda) and clocks.is_wall(kw.value.body, set())
                    for kw in n.keywords):
        return "ordering"
    return None


def wall_clock_findings(pkg: Path) -> list[dict[str, Any]]:
    """Every subtraction, comparison or ordering over wall-clock values in the package.

    Durations must use time.monotonic(); wall-clock stamps from different hosts must not be
    ordered against each other (their clocks differ, and may jump)."""
    base = pkg.parent
    # The lab (drills, soak, benches) is not node code: it measures, and reads, wall clocks.
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(pkg.rglob("*.py"))
             if p.relative_to(pkg).parts[0] != "lab"}
    clocks = _Clocks(trees)
    out: list[dict[str, Any]] = []
    for p, tree in trees.items():
        src = p.read_text()
        rel = str(p.relative_to(base))
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            names = clocks.local_names(fn)
            for n in ast.walk(fn):
                kind = _kind(n, clocks, names)
                if kind is None or not isinstance(n, ast.expr):  # every kind above is an expression
                    continue
                expr = ast.get_source_segment(src, n) or ""
                why = WALL_CLOCK_ALLOWED.get((rel, fn.name, expr))
                out.append({"file": rel, "line": n.lineno, "function": fn.name, "kind": kind, "expr": expr[:120],
                            "allowed": why is not None, "why": why or "wall clock used for a duration or a cross-host order"})
    return sorted(out, key=lambda f: (f["file"], f["line"]))
