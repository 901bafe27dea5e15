"""Import circles in a module graph, for the package's and the benchmarks' layout tests."""

from __future__ import annotations


def import_cycles_in(edges: dict[str, set[str]]) -> list[str]:
    """Every circle of ``edges`` (``{module: modules it imports}``) as ``"a -> b -> a"``, found
    by one depth-first search; a package's ``__init__`` importing its own submodules is not a
    circle through them."""
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}  # 1: on the search's stack, 2: done
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles
