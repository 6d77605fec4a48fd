"""Packaging: the wheel adds files to verl's namespace without owning any of verl's, and
``arctic_rl`` stays importable without verl (it deploys on a GPU box without ray)."""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("verl_remote_backend-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return [n for n in zf.namelist() if ".dist-info/" not in n]


def _verl_owned_files() -> set[str]:
    dist = md.distribution("verl")
    return {str(f).replace("\\", "/") for f in (dist.files or [])}


@pytest.mark.slow  # builds the wheel
def test_wheel_ships_no_file_that_verl_owns(wheel_files):
    owned = _verl_owned_files()
    assert "verl/__init__.py" in owned  # sanity: we are reading verl's RECORD
    clash = sorted(set(wheel_files) & owned)
    assert clash == [], f"these files belong to PyPI verl: {clash}"
    for forbidden in ("verl/__init__.py", "verl/workers/__init__.py", "verl/trainer/__init__.py", "verl/trainer/config/__init__.py"):
        assert forbidden not in wheel_files


@pytest.mark.slow  # builds the wheel
def test_wheel_carries_both_halves_and_the_config_group(wheel_files):
    names = set(wheel_files)
    for required in (
        "verl/remote_backend/__init__.py",
        "verl/remote_backend/base.py",
        "verl/remote_backend/errors.py",
        "arctic_rl/__init__.py",
        "arctic_rl/protocol/__init__.py",
        "arctic_rl/dssst1/__init__.py",
        "arctic_rl/dssst1/decode.py",
    ):
        assert required in names, f"{required} missing from the wheel"
    repo_yaml = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "verl/trainer/config/remote_backend").glob("*.yaml"))
    for y in repo_yaml:
        assert y in names, f"{y} (Hydra option group) missing from the wheel"
    shipped_py = {n for n in names if n.endswith(".py")}
    repo_py = {
        p.relative_to(REPO).as_posix()
        for top in ("arctic_rl", "verl")
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert repo_py <= shipped_py, f"source files not packaged: {sorted(repo_py - shipped_py)}"
    assert not any(n.startswith("tests/") for n in names)


def test_metadata_declares_runtime_dependencies():
    requires = md.requires("verl-remote-backend") or []
    plain = {r.split(";")[0].split("=")[0].split(">")[0].split("<")[0].split("!")[0].strip().lower() for r in requires if "extra ==" not in r}
    for dep in ("verl", "hydra-core", "omegaconf", "ray", "requests", "torch", "transformers", "safetensors",
                "cachetools", "uvicorn", "fastapi", "transferqueue"):
        assert dep in plain, f"{dep} not declared in install_requires"
    extras = md.metadata("verl-remote-backend").get_all("Provides-Extra") or []
    assert {"server", "gpu", "examples", "test"} <= set(extras)
    examples = [r for r in requires if "extra ==" in r and "examples" in r.split("extra ==")[1]]
    assert any(r.lower().startswith("matplotlib") for r in examples), examples


def test_the_readme_install_brings_what_the_main_job_needs():
    """README command #1 runs ``scripts/install.sh`` with no flag; its reward-curve PNG needs matplotlib."""
    script = (REPO / "scripts" / "install.sh").read_text()
    default = next(line for line in script.splitlines() if line.startswith("extras="))
    assert "server" in default and "examples" in default, default


def test_constraints_keep_verls_pins():
    text = (REPO / "constraints.txt").read_text()
    assert "transformers" in text and "<5.11" in text
    assert "tensordict" in text and "<=0.10" in text


@pytest.mark.slow  # a subprocess that imports every arctic_rl module (torch, transformers, deepspeed)
def test_arctic_rl_never_imports_verl():
    code = (
        "import sys, importlib, pkgutil, arctic_rl\n"
        "mods = [m.name for m in pkgutil.walk_packages(arctic_rl.__path__, 'arctic_rl.')]\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'verl' or k.startswith('verl.') or k == 'ray' or k.startswith('ray.'))\n"
        "print(len(mods), bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/", check=False)
    assert res.returncode == 0, res.stdout + res.stderr
