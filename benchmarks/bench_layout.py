"""
The code's shape as a reader meets it: lines and modules, the floors of the import graph (a module
sits one floor above everything it imports), the project's modules each module imports, the imports
inside functions, and the share of lines that carry a comment. The same measure for any Python
project, so that two can be read side by side (tests excluded).

    python benchmarks/bench_layout.py                                   # the scripts and toolkit/
    python benchmarks/bench_layout.py --root ../nanochat --packages nanochat --scripts scripts

Imports anywhere in a module count, those inside functions too; a cycle's back edge does not lift a
floor. Targets (issue 62): at most 9 floors, at most 4 project imports per module on average.
"""
import argparse
import ast
import io
import os
import statistics
import tokenize
from functools import cache


def module_files(root: str, packages: list[str], scripts: list[str]) -> dict[str, str]:
    """{module name: path} of the top-level scripts, the script folders and the packages."""
    files = {}
    for folder, prefix in [(root, ""), *((os.path.join(root, s), s + ".") for s in scripts),
                           *((os.path.join(root, p), p + ".") for p in packages)]:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py") and name != "__init__.py":
                files[prefix + name[:-3]] = os.path.join(folder, name)
    return files


def imported(tree: ast.Module, known: set[str]) -> tuple[set[str], int]:
    """The project's modules a module imports, and how many of its import statements sit inside a
    function."""
    found, local = set(), 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local += sum(isinstance(inner, (ast.Import, ast.ImportFrom))
                         for inner in ast.walk(node))
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found & known, local


def comment_lines(source: str) -> int:
    """The lines that carry a comment (a # comment, on its own or after code)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return len({token.start[0] for token in tokens if token.type == tokenize.COMMENT})


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 for one that imports none of the project, else one above the highest
    of those it imports (an edge that closes a cycle is left out)."""
    on_path = set()

    @cache
    def floor(module: str) -> int:
        on_path.add(module)
        below = [floor(other) for other in graph[module] if other not in on_path]
        on_path.discard(module)
        return 1 + max(below, default=0)

    return {module: floor(module) for module in sorted(graph)}


def measure(root: str, packages: list[str], scripts: list[str]) -> dict:
    files = module_files(root, packages, scripts)
    sources = {name: open(path, encoding="utf-8").read() for name, path in files.items()}
    graph, local = {}, 0
    for name, source in sources.items():
        graph[name], inside = imported(ast.parse(source), set(files))
        graph[name].discard(name)
        local += inside
    fan_out = {name: len(imports) for name, imports in graph.items()}
    lines = sum(source.count("\n") for source in sources.values())
    comments = sum(comment_lines(source) for source in sources.values())
    widest = max(fan_out, key=fan_out.get)
    return {"modules": len(files), "lines": lines, "floors": max(floors(graph).values()),
            "fan_out_mean": statistics.mean(fan_out.values()), "fan_out_max": fan_out[widest],
            "widest": widest, "local_imports": local, "comment_share": comments / lines,
            "floor_of": floors(graph)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--packages", nargs="*", default=["toolkit"])
    p.add_argument("--scripts", nargs="*", default=[], help="folders of scripts beside the top")
    p.add_argument("--floors", action="store_true", help="list the modules of each floor")
    args = p.parse_args()
    m = measure(args.root, args.packages, args.scripts)
    print(f"{os.path.abspath(args.root)}: {m['lines']:,} lines in {m['modules']} modules; "
          f"{m['floors']} floors; project imports per module {m['fan_out_mean']:.1f} on average, "
          f"{m['fan_out_max']} at most ({m['widest']}); {m['local_imports']} imports inside "
          f"functions; {m['comment_share']:.1%} of lines carry a comment")
    if args.floors:
        for level in range(1, m["floors"] + 1):
            print(f"{level}. " + ", ".join(name for name, floor in m["floor_of"].items()
                                           if floor == level))


if __name__ == "__main__":
    main()
