"""What an inference bundle holds (python -m bundle): the project's modules python -m predict imports, and
the distributions it needs installed, found from the code and the installed packages' metadata, so the
bundle holds exactly what predicting needs and nothing a change elsewhere in the project would miss."""
import ast
import importlib.metadata
import re
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Left to the machine that predicts: Kaggle's and Colab's images hold a CUDA build of torch, and a wheel of
# it (several GB) would replace theirs with one the bundle's maker happened to have (a CPU build, say).
PROVIDED = {"torch"}


def imported_names(source):
    """The absolute module names that a module's import statements name, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def module_file(root, name):
    """The file of a project module (a .py file; a package is a folder of them), or None."""
    path = root / Path(*name.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def needed_code(root, entry="predict"):
    """(the project's files `entry` imports, transitively, relative to root; the top-level names of what else
    they import, the standard library left out)."""
    files, others, todo = set(), set(), [entry]
    while todo:
        path = module_file(root, todo.pop())
        if path is None or path in files:
            continue
        files.add(path)
        for name in imported_names(path.read_text(encoding="utf-8")):
            if module_file(root, name):
                todo.append(name)
            elif not (root / name.split(".")[0]).is_dir() and name.split(".")[0] not in sys.stdlib_module_names:
                others.add(name.split(".")[0])
    return sorted(p.relative_to(root) for p in files), sorted(others)


def distributions_of(top_level_names):
    """The installed distributions that provide these importable names (numpy -> numpy, yaml -> PyYAML)."""
    providers = importlib.metadata.packages_distributions()
    return sorted({canonicalize_name(d) for name in top_level_names for d in providers.get(name, [])})


def target_environment(python):
    """The marker environment of the machine that predicts: Linux on x86-64 with CPython `python` ("3.11")."""
    return {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def requirement_closure(roots, python, provided=PROVIDED):
    """{distribution: installed version} of `roots` and everything they require on the target (no extras),
    installed here; what `provided` names, and what only it requires, left out."""
    environment, found, todo = target_environment(python), {}, list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or name in provided:
            continue
        dist = importlib.metadata.distribution(name)
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": ""}):
                todo.append(requirement.name)
    return dict(sorted(found.items()))


def platform_tags(platform):
    """pip download's --platform values for a manylinux platform: the one named and every older glibc's
    (pip takes only the tags it is given; numpy ships manylinux_2_28 wheels, tokenizers manylinux_2_17)."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match[1]), match[2]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return [tag for minor in range(glibc, 4, -1)
            for tag in [f"manylinux_2_{minor}_{arch}", *([f"{legacy[minor]}_{arch}"] if minor in legacy else [])]]
