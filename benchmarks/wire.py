"""Wire-codec benchmark: one realistic GRPO fwd-bwd batch through each codec, in one process.

    python benchmarks/wire.py [--batch 512] [--seq 4096] [--repeats 5] [--threads 1]

Codecs: (a) DSSST1 (:mod:`arctic_rl.dssst1`) decoding the bytearray it produced (zero-copy) and
decoding ``bytes`` (what ``requests``/``httpx`` ``.content`` hand over: one copy; the bytes are
made outside the timed region); (b) torch.save + torch.load(weights_only=True) through BytesIO,
the v1 wire; (c) safetensors.torch save + load; (d) the vendor's DSSST1 codec, only if importable
(never vendored here); (e) a raw memcpy of the same bytes, ``bytearray(frame)`` once per
direction: what one plain copy into a fresh buffer costs (DSSST1 can beat it, as its buffers skip
the zero-fill and ask for huge pages). Times are medians over ``--repeats`` runs after one
warm-up; GB/s is batch tensor bytes / round-trip seconds; "vs torch" compares round-trip
throughput with torch.save+load. On a shared machine, look at the printed load average.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from arctic_rl import dssst1  # noqa: E402

Codec = tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[Any], Any]]  # encode, received as, decode


def grpo_batch(batch: int, seq: int) -> dict[str, Any]:
    """The dense tensors of one fwd-bwd request, plus its small JSON meta."""
    gen = torch.Generator().manual_seed(0)
    ids_B_T = torch.randint(0, 150_000, (batch, seq), generator=gen)
    return {
        "batch": {
            "input_ids": ids_B_T,
            "attention_mask": torch.ones(batch, seq, dtype=torch.int64),
            "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
            "response_mask": torch.ones(batch, seq),
            "old_log_probs": -torch.rand(batch, seq, generator=gen),
            "advantages": torch.randn(batch, seq, generator=gen),
        },
        "meta": {"rollout_n": 8, "temperature": 1.0, "max_prompt_len": seq // 4, "global_batch_size": batch},
    }


def codecs() -> dict[str, Codec | str]:
    def torch_save(obj: Any) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    same = lambda frame: frame  # noqa: E731
    result: dict[str, Codec | str] = {
        "dssst1 (bytearray in)": (dssst1.dumps, same, dssst1.loads),
        "dssst1 (bytes in, 1 copy)": (dssst1.dumps, bytes, dssst1.loads),
        "torch.save+load": (torch_save, same, lambda data: torch.load(io.BytesIO(data), weights_only=True)),
    }
    try:
        import safetensors.torch as st

        result["safetensors save+load"] = (lambda obj: st.save(obj["batch"]), same, st.load)
    except ImportError:
        result["safetensors save+load"] = "not installed"
    try:
        from arctic_platform import wire as vendor  # type: ignore[import-not-found]

        result["vendor dssst1 (arctic_platform)"] = (vendor.dumps, same, vendor.loads)
    except ImportError:
        result["vendor dssst1 (arctic_platform)"] = "not installed"
    result["raw memcpy bytearray(frame)"] = (bytearray, same, bytearray)
    return result


def median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    out = fn()  # warm-up (and the value we check)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def check(name: str, decoded: Any, obj: dict[str, Any]) -> None:
    tensors = decoded["batch"] if "batch" in decoded else decoded
    for key, expected in obj["batch"].items():
        if not torch.equal(tensors[key], expected):
            raise SystemExit(f"{name}: {key} did not round-trip")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=512, help="rows B (default 512)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per row T (default 4096)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per codec, median reported (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    obj = grpo_batch(args.batch, args.seq)
    nbytes = sum(t.numel() * t.element_size() for t in obj["batch"].values())
    memcpy_frame = dssst1.dumps(obj)
    print(
        f"GRPO batch B={args.batch} T={args.seq}: 3 x int64 + 3 x fp32 [B, T] = {nbytes / 1e6:.1f} MB; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    header = f"{'codec':34} {'encode s':>9} {'decode s':>9} {'round s':>9} {'GB/s':>7} {'wire MB':>8} {'vs torch':>9}"
    print(header)
    print("-" * len(header))
    rows: list[tuple[str, float, float, int]] = []
    for name, codec in codecs().items():
        if isinstance(codec, str):
            print(f"{name:34} {codec}")
            continue
        encode, received_as, decode = codec
        source = memcpy_frame if name.startswith("raw memcpy") else obj
        enc_s, frame = median_seconds(lambda: encode(source), args.repeats)
        frame = received_as(frame)
        dec_s, decoded = median_seconds(lambda: decode(frame), args.repeats)
        if not name.startswith("raw memcpy"):
            check(name, decoded, obj)
        rows.append((name, enc_s, dec_s, len(frame)))
        del frame, decoded
    torch_round = next(enc + dec for name, enc, dec, _ in rows if name == "torch.save+load")
    for name, enc_s, dec_s, wire in rows:
        round_s = enc_s + dec_s
        print(
            f"{name:34} {enc_s:9.4f} {dec_s:9.4f} {round_s:9.4f} {nbytes / round_s / 1e9:7.2f} "
            f"{wire / 1e6:8.1f} {torch_round / round_s:8.2f}x"
        )
    print(
        "encode = object -> wire bytes; decode = wire bytes -> tensors; round = encode + decode; "
        "GB/s = tensor bytes / round; vs torch = round-trip speed-up over torch.save+load."
    )


if __name__ == "__main__":
    main()
