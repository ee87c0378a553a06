"""Which of the project's modules each root module reaches through its imports (direct or not), read from the
source (nothing is imported):

    python bench/imports.py [MODULE ...]      (default: every root module, fewest reached first)

docs/forking.md keeps the figures: the core (the grids, the bridge, the data) reaches no planner, checkpoint or
failure handling.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imports():
    """{module: the root modules its source imports}, for every root .py file."""
    mods = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    out = {}
    for m in mods:
        names = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, m + ".py")).read())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        out[m] = (names & mods) - {m}
    return out


def reach(graph, module):
    """The modules `module` reaches through `graph`."""
    seen, todo = set(), [module]
    while todo:
        for d in graph[todo.pop()] - seen:
            seen.add(d)
            todo.append(d)
    return seen - {module}


if __name__ == "__main__":
    graph = imports()
    for m in sorted(sys.argv[1:] or graph, key=lambda m: (len(reach(graph, m)), m)):
        r = reach(graph, m)
        print(f"{m}: {len(r)}{': ' + ' '.join(sorted(r)) if r else ''}")
