"""The project's shape: the scripts a user runs at the top, everything else in one package, model.py
a leaf, and imports (those inside functions too) that go one way."""
import ast
import sys

from conftest import ROOT

PACKAGE = "toolkit"


def modules() -> dict[str, ast.Module]:
    """{module name: its syntax tree} of the scripts and the package (not the tests or
    benchmarks)."""
    files = {path.stem: path for path in ROOT.glob("*.py")}
    files |= {f"{PACKAGE}.{path.stem}": path for path in (ROOT / PACKAGE).glob("*.py")
              if path.stem != "__init__"}
    return {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The project's modules a module imports anywhere in its code, functions included."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            # from toolkit import cli
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found & known


def third_party(tree: ast.Module) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots - set(sys.stdlib_module_names)


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None."""
    state, path = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_imports_go_one_way():
    trees = modules()
    graph = {name: imports(tree, set(trees)) - {name} for name, tree in trees.items()}
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_model_is_a_leaf_of_torch_and_the_standard_library():
    tree = modules()["model"]
    assert third_party(tree) == {"torch"}
    assert not imports(tree, set(modules()))


def test_no_script_imports_another_script_and_the_package_imports_none():
    trees = modules()
    scripts = {name for name in trees if "." not in name} - {"model"}
    for name, tree in trees.items():
        assert not imports(tree, scripts), (name, imports(tree, scripts))


def test_the_top_level_holds_the_scripts_and_every_module_says_what_it_owns():
    assert len(list(ROOT.glob("*.py"))) <= 12
    for name, tree in modules().items():
        assert ast.get_docstring(tree), f"{name} has no docstring"


def test_the_cycle_finder_finds_cycles():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_is_over_480_lines_and_the_model_of_two_families_over_600():
    for path in [*ROOT.glob("*.py"), *(ROOT / PACKAGE).glob("*.py")]:
        # as nanochat's gpt.py (555, at up to 120 characters a line): both families in one file
        limit = 600 if path.name == "model.py" else 480
        assert len(path.read_text().splitlines()) <= limit, path.name


def test_engines_and_objectives_implement_the_declared_parts():
    """Every engine and objective has each method of its Protocol (toolkit/training.py), taking its
    parameters (an objective may name its batch for what it holds)."""
    import inspect

    from toolkit.sft import ChatObjective
    from toolkit.deepspeed_engine import DeepSpeedEngine
    from toolkit.contrastive import Contrastive
    from toolkit.finetuning import TaskObjective
    from toolkit.pretraining import LanguageModeling
    from toolkit.training import Engine, Objective, TorchEngine

    def parameters(function) -> list[str]:
        return [name for name in inspect.signature(function).parameters if name != "self"]

    for protocol, classes in ((Engine, (TorchEngine, DeepSpeedEngine)),
                              (Objective, (LanguageModeling, TaskObjective, ChatObjective,
                                           Contrastive))):
        declared = {name: parameters(member) for name, member in vars(protocol).items()
                    if inspect.isfunction(member) and not name.startswith("_")}
        assert len(declared) >= 6
        for cls in classes:
            for name, wanted in declared.items():
                assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name}"
                found = parameters(getattr(cls, name))
                assert len(found) >= len(wanted) and found[:1] == wanted[:1], \
                    (cls.__name__, name, found)


def test_every_file_the_toolkit_ships_is_never_an_output():
    """files.check_output refuses the shipped files by name: a file added beside the scripts (or a
    folder) must join SHIPPED_FILES or SHIPPED_FOLDERS."""
    import subprocess

    from toolkit.files import is_shipped
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert len(tracked) > 100
    unprotected = [path for path in tracked
                   if not path.startswith("ckpt/") and not is_shipped(str(ROOT / path))]
    assert not unprotected
    assert not is_shipped(str(ROOT / "ckpt" / "ckpt.pt"))
    assert not is_shipped(str(ROOT / "samples.jsonl"))
