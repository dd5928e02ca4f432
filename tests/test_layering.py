"""floorline's modules import downward only: each top-level module or package has a place in
LAYERS, imports only from places below its own, and no module imports itself back in a loop."""

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
PACKAGE = SRC / "floorline"

# Bottom first. A module or package may import only those listed before it.
LAYERS = ["__init__", "errors", "stats", "localcache", "hardware", "interruptions", "timing",
          "graphs", "records",
          "study",
          "models", "traffic", "layouts", "engine", "paths", "store", "forecast", "measure",
          "report", "serve", "cli", "__main__"]
# Within the command line (the package cli/) the same: what prints and what parses, then the
# apps and how a command ends, then the commands; last the package itself, which registers them.
CLI_LAYERS = ["render", "options", "app", "commands", "__init__"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """(module imported, line) for every floorline import in the file, nested ones included; a
    name imported from a package counts as its submodule where there is one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("floorline")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("floorline"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = any((SRC / sub.replace(".", "/")).with_suffix(s).exists()
                                for s in (".py", ""))
                found.append((sub if is_module else node.module, node.lineno))
    return found


def unit(module: str) -> str:
    """The place in LAYERS of a module: its top-level module or package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, list[tuple[str, int]]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer():
    assert {unit(m) for m in graph()} <= set(LAYERS)


def test_imports_run_downward():
    upward = [f"{m}:{line} imports {target}" for m, targets in graph().items()
              for target, line in targets
              if unit(target) != unit(m) and LAYERS.index(unit(target)) > LAYERS.index(unit(m))]
    assert upward == []


def cli_unit(module: str) -> str:
    """The place in CLI_LAYERS of a module of the command line."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_the_command_line_imports_downward():
    cli = {m: targets for m, targets in graph().items() if unit(m) == "cli"}
    assert {cli_unit(m) for m in cli} <= set(CLI_LAYERS)
    upward = [f"{m}:{line} imports {target}" for m, targets in cli.items()
              for target, line in targets
              if unit(target) == "cli" and cli_unit(target) != cli_unit(m)
              and CLI_LAYERS.index(cli_unit(target)) > CLI_LAYERS.index(cli_unit(m))]
    assert upward == []


def test_no_import_cycles():
    edges = {m: {t for t, _ in targets if t != m} for m, targets in graph().items()}
    done, cycles = set(), []

    def visit(m, stack):
        if m in stack:
            cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        if m in done:
            return
        for t in sorted(edges.get(m, ())):
            visit(t, stack + [m])
        done.add(m)

    for m in sorted(edges):
        visit(m, [])
    assert cycles == []
