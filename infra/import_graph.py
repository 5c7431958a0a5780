"""Print DroidMesh's package dependency graph and any cycle between its packages.

A package is a folder of `shared/` or `services/` (`shared/kv`, `shared/tools/bench`,
`services/receiver`); a top-level module of `shared/` (`shared/report.py`) counts as its own
package. The graph is grimp's (the import graph `lint-imports` checks the layer contracts of
`pyproject.toml` on), folded from modules to packages; cycles are its strongly connected
components of more than one package.

Usage: python infra/import_graph.py [--dot]   (exit status 1 if any cycle)
"""

from __future__ import annotations

import sys
from collections import defaultdict

import grimp
import networkx as nx

ROOTS = ("droidmesh.shared", "droidmesh.services")
NESTED = "droidmesh.shared.tools"  # a container: its children are the packages


def package_of(module: str) -> str:
    """`droidmesh.shared.kv.plan` -> `droidmesh.shared.kv`; a container's child one level deeper."""
    parts = module.split(".")
    return ".".join(parts[:4 if module.startswith(NESTED + ".") or module in NESTED else 3])


def package_graph() -> nx.DiGraph:
    graph = grimp.build_graph(*ROOTS)
    folded = nx.DiGraph()
    for module in graph.modules:
        if module in ROOTS:
            continue
        a = package_of(module)
        folded.add_node(a)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported in ROOTS:
                continue  # the root's data folders (`ZOO_DIR`, `NATS_CONFIG_DIR`), not a package
            b = package_of(imported)
            if a != b:
                folded.add_edge(a, b)
    return folded


def main() -> int:
    g = package_graph()
    short = {n: n.removeprefix("droidmesh.") for n in g}
    if "--dot" in sys.argv:
        print("digraph droidmesh {\n  rankdir=TB;")
        for a, b in sorted(g.edges):
            print(f'  "{short[a]}" -> "{short[b]}";')
        print("}")
    else:
        deps: dict[str, list[str]] = defaultdict(list)
        for a, b in g.edges:
            deps[a].append(short[b])
        for n in sorted(g.nodes):
            print(f"{short[n]} -> {', '.join(sorted(deps[n])) or '(nothing of ours)'}")
    cycles = [sorted(short[n] for n in c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    print(f"cycles between packages: {len(cycles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in cycles))
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
