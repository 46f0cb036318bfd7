"""The layout: stages/ holds the stages dvc.yaml runs and nothing else, the shared code sits in folders by
concern that never import a stage nor each other in a circle, and each stage's code deps in dvc.yaml (its own
module and the shared code's folders) cover exactly the project modules its command imports, transitively. A
helper edited without its stage rerunning would leave stale cached results that nobody notices: the deps test
is what prevents that."""
import ast
import os
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
LIBRARY = ("pipeline", "fetching", "reading", "tasks", "training", "predicting", "modeling", "baselines")  # the shared code's folders


def module_file(root, module):
    """The file of a project module (a .py file or a package's __init__.py) under root, or None."""
    path = root / Path(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(source):
    """Every module an import statement in `source` names, at the top or inside a function, with the
    modules that `from package import name` reaches when name is a module itself (as candidates)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def import_closure(root, module):
    """The project files (relative to root) that `python -m module` imports, itself included, following
    imports transitively; a package's __init__.py counts when it has code."""
    seen, todo = set(), [module]
    while todo:
        path = module_file(root, todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        todo += sorted(imported_modules(path.read_text(encoding="utf-8")))
        parts = path.relative_to(root).parts[:-1]  # a module imports its packages' __init__ first
        todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return {p.relative_to(root).as_posix() for p in seen if p.name != "__init__.py" or p.read_text().strip()}


def stage_commands(dvc_yaml):
    """{stage: (module, deps)} for each stage of dvc.yaml whose command is `python -m <module> ...`."""
    stages = {}
    for name, stage in yaml.safe_load(dvc_yaml.read_text(encoding="utf-8"))["stages"].items():
        stage = stage.get("do", stage)  # foreach: the template every item runs
        found = re.match(r"python -m (\S+)", stage["cmd"])
        if found:
            stages[name] = found[1], [str(d) for d in stage.get("deps", [])]
    return stages


def deps_mismatches(root):
    """Lines naming each stage whose code deps (.py files, and folders of the shared code, which DVC hashes
    whole) do not cover its command's import closure, or name code it never imports (empty: all exact)."""
    problems = []
    for name, (module, deps) in stage_commands(root / "dvc.yaml").items():
        files = {d for d in deps if d.endswith(".py")}
        folders = {d.rstrip("/") for d in deps if d.rstrip("/") in LIBRARY}
        imported = import_closure(root, module)
        uncovered = sorted(f for f in imported if f not in files and f.split("/")[0] not in folders)
        unused = sorted(files - imported) + sorted(d for d in folders if not any(f.startswith(f"{d}/") for f in imported))
        if uncovered or unused:
            problems.append(f"{name}: imports but does not declare {uncovered}; declares but does not import {unused}")
    return problems


def test_each_stage_declares_exactly_the_modules_it_imports():
    assert deps_mismatches(REPO) == []


def test_the_deps_check_fails_when_a_stage_imports_a_module_it_does_not_declare(tmp_path):
    # a copy of the project's code, one stage given one more import: the check must name it
    for path in [REPO / "dvc.yaml", *REPO.glob("*/*.py"), *REPO.glob("*.py")]:
        target = tmp_path / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    assert deps_mismatches(tmp_path) == []
    split = tmp_path / "stages/split.py"
    split.write_text(split.read_text() + "\n\ndef late():\n    from training import checkpoint  # noqa: F401\n")
    problems = deps_mismatches(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("split: imports but does not declare ['training/checkpoint.py'")
    split.write_text(split.read_text().replace("\n\ndef late():\n    from training import checkpoint  # noqa: F401\n", ""))
    assert deps_mismatches(tmp_path) == []
    helper = tmp_path / "training/checkpoint.py"  # through a helper, into a folder the train stage does not declare
    helper.write_text("from baselines import tfidf  # noqa: F401\n" + helper.read_text())
    problems = deps_mismatches(tmp_path)
    assert any(p.startswith("train: imports but does not declare ['baselines/tfidf.py'") for p in problems), problems
    helper.write_text(helper.read_text().replace("from baselines import tfidf  # noqa: F401\n", ""))
    dvc_yaml = tmp_path / "dvc.yaml"  # a folder declared that the stage never imports
    dvc_yaml.write_text(dvc_yaml.read_text().replace("      - stages/split.py\n", "      - stages/split.py\n      - fetching\n"))
    assert deps_mismatches(tmp_path) == ["split: imports but does not declare []; declares but does not import ['fetching']"]


def test_stages_holds_the_stages_of_dvc_yaml_and_nothing_else():
    run = {module for module, _ in stage_commands(REPO / "dvc.yaml").values() if module.startswith("stages.")}
    present = {f"stages.{p.stem}" for p in (REPO / "stages").glob("*.py") if p.name != "__init__.py"}
    assert present == run
    assert not [p for p in (REPO / "stages").iterdir() if p.is_dir() and p.name != "__pycache__"]
    for name, (module, _) in stage_commands(REPO / "dvc.yaml").items():
        assert module == f"stages.{name}"  # the stage, its module and its params section share one name


def library_imports(module_path):
    """The project packages (top-level names) a module imports."""
    return {name.split(".")[0] for name in imported_modules(module_path.read_text(encoding="utf-8"))}


def test_the_shared_code_never_imports_a_stage_or_a_tool_and_its_folders_form_no_circle():
    graph = {}
    for folder in LIBRARY:
        files = sorted((REPO / folder).glob("*.py"))
        assert len([f for f in files if f.name != "__init__.py"]) >= 2, f"{folder}/ is a folder of one file"
        for path in files:
            used = library_imports(path)
            assert not used & {"stages", "tune", "predict", "bench", "tests"}, f"{path.relative_to(REPO)} imports {used}"
            if path.name == "__init__.py":
                assert not path.read_text().strip(), f"{path.relative_to(REPO)}: packages here are namespaces only"
        graph[folder] = {u for f in files for u in library_imports(f)} & set(LIBRARY) - {folder}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph[start])

    circles = [f for f in LIBRARY if reaches(f, f)]
    assert not circles, f"folders importing each other in a circle: {circles}; {graph}"


@pytest.mark.parametrize("folder", LIBRARY)
def test_no_shared_module_is_past_what_one_reads_in_a_sitting(folder):
    long = {p.name: n for p in (REPO / folder).glob("*.py") if (n := len(p.read_text().splitlines())) > 320}
    assert not long, f"{folder}/: split these by concern: {long}"


def project_files(*suffixes):
    """The project's own files with these suffixes: not in hidden folders (the virtualenv's, git's, DVC's)."""
    found = []
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        found += [Path(folder, name) for name in files if Path(name).suffix in suffixes]
    return found


def test_every_document_the_project_points_to_exists():
    """The README's and the docs' relative links, and every docs/<name>.md that code, settings or docs name
    (a docstring's "docs/speed.md, The memory allocator"), are files in the repository: docs split or
    renamed leave no reader at a missing page."""
    missing = []
    for markdown in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", markdown.read_text()):
            if re.match(r"[a-z]+:|#", target):  # a web address or an anchor in the same page
                continue
            if not (markdown.parent / target.split("#")[0]).exists():
                missing.append(f"{markdown.relative_to(REPO)} links to {target}")
    for source in project_files(".py", ".md", ".yaml", ".sh", ".ipynb"):
        for name in set(re.findall(r"\bdocs/[\w.-]+\.md\b", source.read_text(errors="replace"))):
            if not (REPO / name).is_file():
                missing.append(f"{source.relative_to(REPO)} names {name}")
    assert not missing, missing
