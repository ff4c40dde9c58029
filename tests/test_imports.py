"""Import rules of the mlm_jax package, read from the source with `ast` (nothing is imported):

- model code speaks logical dims only (STYLE.md 1): nothing under mlm_jax/models/ imports
  mlm_jax.parallel, mlm_jax.pipeline or a mesh axis name (the constants of sharding/mesh.py);
- the import graph has no circle. Every import counts, at module level or inside a function
  (a function-level import is how a circle is hidden, not removed); `from mlm_jax.x import y`
  is an edge to the submodule mlm_jax.x.y when y is one, else to mlm_jax.x; relative imports
  resolve against the importing module's package.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = "mlm_jax"
ROOT = Path(__file__).resolve().parent.parent


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of `package` under `root`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, its relative dots resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, str | None]]:
    """(imported module, name taken from it or None) for every import statement in the file,
    at any depth; `from m import y` gives (m.y, None) when m.y is a module of `known`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, None) if sub in known else (base, alias.name))
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = modules(root, package)
    return {m: {target for target, _ in imports(m, p, set(files)) if target in files and target != m}
            for m, p in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def one_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import loop from the component's first module back to it (for the message)."""
    start, members = component[0], set(component)
    previous, queue = {start: None}, collections.deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return [start] + path[::-1][1:] + [start]
            if w not in previous:
                previous[w] = v
                queue.append(w)
    return component


def axis_names(mesh: Path) -> set[str]:
    """Module-level names of mesh.py bound to a string constant, or to a tuple of those."""
    names: set[str] = set()
    for node in ast.parse(mesh.read_text()).body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                     and isinstance(node.value, ast.Tuple) else [(target, node.value)])
            for name, value in pairs:
                if not isinstance(name, ast.Name):
                    continue
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    names.add(name.id)
                elif isinstance(value, ast.Tuple) and value.elts and all(
                        isinstance(e, ast.Name) and e.id in names for e in value.elts):
                    names.add(name.id)
    return names


def model_violations(root: Path, package: str) -> list[str]:
    files = modules(root, package)
    axes = axis_names(root / package / "sharding" / "mesh.py")
    models, forbidden = f"{package}.models", (f"{package}.parallel", f"{package}.pipeline")
    bad = []
    for module, path in files.items():
        if module != models and not module.startswith(models + "."):
            continue
        for target, name in imports(module, path, set(files)):
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                bad.append(f"{module} imports {target}")
            elif name in axes and target.startswith(package):
                bad.append(f"{module} imports the mesh axis name {name} from {target}")
        # An axis read off an imported sharding module: `mesh.DATA`.
        tree = ast.parse(path.read_text())
        sharding = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                sharding |= {a.asname or a.name for a in node.names if a.name.startswith(f"{package}.sharding")}
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, path, node)
                sharding |= {a.asname or a.name for a in node.names
                             if f"{base}.{a.name}" in files and base.startswith(f"{package}.sharding")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in axes and ast.unparse(node.value) in sharding:
                bad.append(f"{module} names the mesh axis {ast.unparse(node)}")
    return list(dict.fromkeys(bad))  # one line per module and name


def test_models_name_no_mesh_axis_and_import_no_parallelism():
    bad = model_violations(ROOT, PACKAGE)
    assert not bad, "model code must speak logical dims only (STYLE.md 1):\n" + "\n".join(bad)


def test_the_import_graph_has_no_circle():
    graph = import_graph(ROOT, PACKAGE)
    found = circles(graph)
    lines = [f"{len(c)} modules: {', '.join(c)}\n    e.g. {' -> '.join(one_loop(graph, c))}" for c in found]
    assert not found, f"{len(found)} import circle(s):\n" + "\n".join(lines)


def test_the_checks_see_every_kind_of_import(tmp_path):
    """The rules are not vacuous: on a made-up package, a circle through a function-level
    import, a relative import and a `from package import submodule` is found, and so is a
    model naming a mesh axis or importing the parallel code."""
    files = {
        "__init__.py": "from pkg import a\n",
        "a.py": "from .b import thing\n",
        "b.py": "def f():\n    from pkg import c\nthing = 1\n",
        "c.py": "import pkg.a\n",
        "d.py": "from . import a\n",  # into the circle, not part of it
        "sharding/__init__.py": "",
        "sharding/mesh.py": 'PIPE, DATA = "pipe", "data"\nAXES = (PIPE, DATA)\nOTHER = 3\n',
        "models/__init__.py": "",
        "models/m1.py": "from pkg.sharding.mesh import DATA, OTHER\n",
        "models/m2.py": "def f():\n    from ..parallel import ctx\n",
        "models/m3.py": "import pkg.sharding.mesh as mesh\nx = mesh.AXES\n",
        "models/m4.py": "from ..sharding import mesh\ny = mesh.PIPE\n",
        "models/ok.py": "from pkg.sharding import mesh_shape\n",
        "parallel/__init__.py": "",
        "parallel/ctx.py": "",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert one_loop(graph, ["pkg.a", "pkg.b", "pkg.c"]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert axis_names(tmp_path / "pkg" / "sharding" / "mesh.py") == {"PIPE", "DATA", "AXES"}
    assert model_violations(tmp_path, "pkg") == [
        "pkg.models.m1 imports the mesh axis name DATA from pkg.sharding.mesh",
        "pkg.models.m2 imports pkg.parallel.ctx",
        "pkg.models.m3 names the mesh axis mesh.AXES",
        "pkg.models.m4 names the mesh axis mesh.PIPE",
    ]


def module_class_assignments(root: Path, package: str) -> list[str]:
    """`module: line` for every assignment to an attribute `__class__` in the package's source
    (the way a module makes itself callable: `sys.modules[__name__].__class__ = ...`)."""
    found = []
    for module, path in modules(root, package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            found += [f"{module}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr == "__class__"]
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == "__class__"):
                found.append(f"{module}:{node.lineno}")
    return found


def test_the_public_face_is_plain_functions_and_classes():
    """`mlm_jax.parallelize(cfg, mesh)` is an ordinary function, not a module made callable:
    no public name of the package is also one of its submodules, and no module swaps a
    module's class."""
    import inspect

    import mlm_jax

    assert inspect.isfunction(mlm_jax.parallelize), type(mlm_jax.parallelize)
    assert mlm_jax.parallelize.__module__ == "mlm_jax.build"
    submodules = set(modules(ROOT, PACKAGE))
    clashes = [name for name in mlm_jax.__all__ if f"{PACKAGE}.{name}" in submodules]
    assert not clashes, f"public names that are also submodules of {PACKAGE}: {clashes}"
    for name in mlm_jax.__all__:
        value = getattr(mlm_jax, name)
        assert inspect.isfunction(value) or inspect.isclass(value), (name, type(value))
    bad = module_class_assignments(ROOT, PACKAGE)
    assert not bad, "a module's class is swapped at:\n" + "\n".join(bad)


def test_the_class_swap_check_sees_it(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text(
        "import sys\nsys.modules[__name__].__class__ = type\nsetattr(sys.modules['x'], '__class__', int)\n"
        "obj.__class__.__name__ = 'fine'\n")
    assert module_class_assignments(tmp_path, "pkg") == ["pkg.a:2", "pkg.a:3"]
