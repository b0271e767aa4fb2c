"""What a new user installs: the wheel carries the trained model, the README's notebook install runs every
notebook, and environment.yml lists what pyproject.toml lists. pyproject.toml, the README and
environment.yml are parsed here, never restated."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PARITY_NPZ = Path(__file__).parent / "data" / "trained_tiny_logits.npz"


def requirements(extras) -> list[Requirement]:
    """The core dependencies plus those of `extras`, as pyproject.toml declares them."""
    optional = PROJECT["optional-dependencies"]
    return [Requirement(r) for r in PROJECT["dependencies"] + [r for e in extras for r in optional[e]]]


# ---------------------------------------------------------------- the wheel


def test_a_wheel_installed_outside_the_repo_runs_the_trained_model(tmp_path):
    """`pip install .` as a new user does it (a wheel, not editable), run from a directory outside the repo."""
    src = tmp_path / "src"  # the files a build reads, without this checkout's build outputs (build/, *.so)
    shutil.copytree(ROOT / "kimi_explore", src / "kimi_explore", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = dict(capture_output=True, text=True, timeout=300)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-w", str(tmp_path / "dist")], **pip)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("kimi_explore-*.whl")
    venv = tmp_path / "venv"  # numpy and the other dependencies come from this interpreter's site-packages
    inside_a_venv = sys.prefix != sys.base_prefix  # (--system-site-packages would give the base Python's instead)
    subprocess.run([sys.executable, "-m", "venv", *([] if inside_a_venv else ["--system-site-packages"]), str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    if inside_a_venv:  # this venv's site-packages after the new one's (path lines: their own .pth files are not run)
        inner = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        (inner / "outer_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    r = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], **pip)
    assert r.returncode == 0, r.stdout + r.stderr
    away = tmp_path / "elsewhere"
    away.mkdir()
    script = textwrap.dedent(f"""
        import json, sys, warnings
        warnings.simplefilter("error")  # a fallback would warn: here it fails
        from pathlib import Path
        import numpy as np
        import kimi_explore as ke
        from kimi_explore.weights.tiny_model import describe_checkpoint

        package = Path(ke.__file__).parent
        path = ke.tiny_checkpoint()
        weights = ke.from_pretrained(path, device="cpu")
        with np.load({str(PARITY_NPZ)!r}) as z:
            ids, expected = z["ids"], z["logits"]
        state = ke.KimiDecodeState.new(weights)
        got = np.stack([np.asarray(ke.kimi_forward_token(weights, state, int(t))) for t in ids])
        print(json.dumps({{"package": str(package), "path": str(path), "cwd": str(Path.cwd()),
                          "described": describe_checkpoint(path), "max_diff": float(np.abs(got - expected).max())}}))
    """)
    r = subprocess.run([str(python), "-c", script], cwd=away, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = json.loads(r.stdout)
    package = Path(out["package"])
    assert package.is_relative_to(venv) and not package.is_relative_to(ROOT), out  # the installed copy, not this checkout
    assert Path(out["path"]) == package / "data" / "tiny_k3_pydoc"
    assert "trained on" in out["described"] and "random" not in out["described"]
    assert out["max_diff"] <= 1e-3, out  # the trainer's logits, as tests/test_trained_model.py checks them in the repo
    r = subprocess.run([str(venv / "bin" / "kimi-explore"), "--ids", "72"], cwd=away, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "trained on Python's pydoc_data.topics" in r.stdout.splitlines()[0] and str(package) in r.stdout


# ---------------------------------------------------------------- notebooks: only what the README installs


def readme_notebook_extras() -> list[str]:
    """The extras of the README's notebook command (`pip install -e ".[notebook]" && jupyter lab ...`)."""
    (line,) = [ln for ln in (ROOT / "README.md").read_text().splitlines() if "pip install" in ln and "jupyter lab" in ln]
    match = re.search(r"\.\[([\w,-]+)\]", line)
    return match.group(1).split(",") if match else []


def importable_names(reqs: list[Requirement]) -> set[str]:
    """Top-level module names the requirements provide, with everything they pull in (installed metadata);
    a requirement that is not installed here counts by its own name."""
    provided = {}
    for module, dists in md.packages_distributions().items():
        for d in dists:
            provided.setdefault(canonicalize_name(d), set()).add(module)
    seen, names, todo = set(), set(), [(r, r.extras) for r in reqs]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        names |= provided.get(name, {name.replace("-", "_")})
        try:
            sub = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, sub):
            envs = [{"extra": e} for e in extras or {""}]
            if r.marker is None or any(r.marker.evaluate(env) for env in envs):
                todo.append((r, r.extras))
    return names


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _walk(node, functions: bool):
    """ast.walk, without entering function bodies unless `functions` (their imports run only when called)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if functions or not isinstance(child, FUNCTIONS):
            yield from _walk(child, functions)


def _imports(tree, functions: bool = True) -> set[str]:
    """Absolute names imported in `tree` (a module's name and, for `from m import a`, `m.a` too)."""
    out = set()
    for node in _walk(tree, functions):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """Absolute names of a relative import inside `module` (a module or a module's attribute)."""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if module_path(module).name == "__init__.py" else 0)]
    head = ".".join(base + ([node.module] if node.module else []))
    return [head] + [f"{head}.{a.name}" for a in node.names]


def module_path(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def package_modules_used(modules: set[str]) -> set[str]:
    """`modules` and every kimi_explore module they import at module level, transitively."""
    done, todo = set(), [m for m in modules if module_path(m).is_file()]
    while todo:
        m = todo.pop()
        if m in done:
            continue
        done.add(m)
        for node in _walk(ast.parse(module_path(m).read_text()), functions=False):
            if isinstance(node, ast.ImportFrom) and node.level:
                names = _resolve(m, node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imports(node)
            else:
                continue
            todo += [n for n in names if n.startswith("kimi_explore") and module_path(n).is_file() and n not in done]
    return done


def third_party(names) -> set[str]:
    tops = {n.split(".")[0] for n in names}
    return {t for t in tops if t not in sys.stdlib_module_names and t != "kimi_explore"}


def function_imports() -> dict[str, set[str]]:
    """{function or method name: third-party modules it imports inside its body}, over the whole package."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / "kimi_explore").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, FUNCTIONS[:2]) and (mods := third_party(_imports(node))):
                out.setdefault(node.name, set()).update(mods)
    return out


def notebook_code(path: Path) -> ast.Module:
    cells = json.loads(path.read_text())["cells"]
    return ast.parse("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code"))


def test_every_notebook_runs_with_the_extras_the_readme_installs():
    """Every import of every notebook, the modules of the package they use, and the optional imports of
    the package functions they call by name (`Attribution.to_pandas` needs pandas) are provided by the
    core dependencies plus the extras of the README's notebook command."""
    extras = readme_notebook_extras()
    assert extras, "the README's notebook command installs no extra"
    available = importable_names(requirements(extras))
    lazy = function_imports()
    import kimi_explore

    missing = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        tree = notebook_code(nb)
        imported = _imports(tree)
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                   if a.name == "kimi_explore"}
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        top = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id in aliases}
        top |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "kimi_explore"
                for a in n.names}
        modules = {n for n in imported if n.startswith("kimi_explore")}
        for name in top:  # `ke.Session`, `from kimi_explore import plots`: the module that defines it
            obj = getattr(kimi_explore, name)
            modules.add(obj.__name__ if isinstance(obj, type(kimi_explore)) else obj.__module__)
        needs = {m: "imported" for m in third_party(imported)}
        for m in package_modules_used(modules):
            needs.update({t: f"imported by {m}" for t in third_party(_imports(ast.parse(module_path(m).read_text()), False))})
        for name in used & set(lazy):
            needs.update({t: f"imported by the package's {name}()" for t in lazy[name]})
        bad = {t: why for t, why in needs.items() if t not in available}
        if bad:
            missing[nb.name] = bad
    assert missing == {}, (f"not provided by the core dependencies + {extras} (pyproject.toml): {missing}; "
                           "add them to that extra, or make the notebook not need them")


def test_the_notebook_check_sees_an_optional_import():
    """The check above is not vacuous: to_pandas's pandas import is found, and a notebook importing a
    package the extras lack would be reported."""
    assert "pandas" in function_imports()["to_pandas"]
    assert "ray" not in importable_names(requirements(readme_notebook_extras()))
    assert {"numpy", "matplotlib", "ipywidgets"} <= importable_names(requirements([]))


# ---------------------------------------------------------------- environment.yml


CONDA_NAMES = {"matplotlib-base": "matplotlib"}  # conda-forge spells these differently from PyPI


def environment_yml() -> tuple[list[str], dict[str, str], list[str]]:
    """(the extras its header claims, {requirement name: version spec}, pip-section lines) of environment.yml."""
    text = (ROOT / "environment.yml").read_text()
    (claim,) = re.findall(r'pip install -e "\.\[([\w,-]+)\]"', text)
    deps, pip, in_pip, section = {}, [], False, None
    for line in text.splitlines():
        if re.match(r"^\w+:", line):  # a top-level key: channels, dependencies, ...
            section = line.split(":")[0]
        entry = re.match(r"^(\s*)- (.+?)\s*(#.*)?$", line)
        if not entry or section != "dependencies":
            continue
        indent, value = len(entry.group(1)), entry.group(2)
        if value == "pip:":
            in_pip = True
            continue
        in_pip = in_pip and indent > 2
        if in_pip:
            pip.append(value)
            if value.startswith("-"):  # `-e .`
                continue
        if value == "pip":
            continue
        req = Requirement(value.replace(" ", ""))
        name = CONDA_NAMES.get(canonicalize_name(req.name), canonicalize_name(req.name))
        deps[name] = str(req.specifier)
    return claim.split(","), deps, pip


def test_environment_yml_lists_what_pyproject_lists():
    extras, deps, pip = environment_yml()
    want = {canonicalize_name(r.name): str(r.specifier) for r in requirements(extras)}
    assert {n: deps.get(n) for n in want if deps.get(n) != want[n]} == {}, "missing or with another version"
    extra = set(deps) - set(want) - {"python", "c-compiler"}
    assert extra == set(), f"environment.yml lists {sorted(extra)}, which pyproject.toml's {extras} do not"
    assert "-e ." in pip  # the package itself, editable, as the README's commands install it
    text = (ROOT / "environment.yml").read_text()
    for path in re.findall(r"kimi_explore/[\w/]+\.c\b", text):  # the C kernels it names exist
        assert (ROOT / path).is_file(), path
