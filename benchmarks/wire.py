"""Wire-codec benchmark: one realistic GRPO fwd-bwd batch through each codec, in one process.

    python benchmarks/wire.py [--batch 512] [--seq 4096] [--repeats 20] [--threads 1]

Codecs: (a) DSSST1 (:mod:`arctic_rl.dssst1`) decoding the bytearray it produced (zero-copy) and
decoding ``bytes`` (what ``requests``/``httpx`` ``.content`` hand over: one copy; the bytes are
made outside the timed region); (b) torch.save + torch.load(weights_only=True) through BytesIO,
the v1 wire; (c) safetensors.torch save + load; (d) the vendor's DSSST1 codec, only if importable
(never vendored here); (e) a raw memcpy of the same bytes, ``bytearray(frame)`` once per
direction: what one plain copy into a fresh buffer costs (DSSST1 can beat it, as its buffers skip
the zero-fill and ask for huge pages). Each codec makes ``--repeats`` consecutive round trips
(encode, then decode, then drop both, as a caller does) after one warm-up, in one process: the
table gives the median encode, decode and round-trip times and the slowest round trip (the worst
case is what a training step waits for now and then); GB/s is batch tensor bytes / median round
trip; "vs torch" compares median and max round trips with torch.save+load. On a shared machine,
look at the printed load average.
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
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from arctic_rl import dssst1

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

    same = lambda frame: frame
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


class Timing(NamedTuple):
    encode_s: float  # medians
    decode_s: float
    round_s: float
    round_max_s: float  # the slowest round trip
    wire_bytes: int


def time_round_trips(codec: Codec, source: Any, repeats: int, check_against: dict[str, Any] | None) -> Timing:
    """One warm-up round trip (checked), then ``repeats`` timed ones; each result is dropped before the next."""
    encode, received_as, decode = codec
    frame = received_as(encode(source))
    wire_bytes = len(frame)
    decoded = decode(frame)
    if check_against is not None:
        check(check_against, decoded)
    del frame, decoded
    enc, dec, rounds = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        frame = encode(source)
        encoded = time.perf_counter()
        frame = received_as(frame)  # what the receiver is handed (not timed)
        received = time.perf_counter()
        decoded = decode(frame)
        done = time.perf_counter()
        del frame, decoded
        enc.append(encoded - start)
        dec.append(done - received)
        rounds.append(enc[-1] + dec[-1])
    return Timing(statistics.median(enc), statistics.median(dec), statistics.median(rounds), max(rounds), wire_bytes)


def check(obj: dict[str, Any], decoded: Any) -> None:
    tensors = decoded.get("batch", decoded)
    for key, expected in obj["batch"].items():
        if not torch.equal(tensors[key], expected):
            raise SystemExit(f"{key} did not round-trip")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=512, help="rows B (default 512)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per row T (default 4096)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed round trips per codec: median and max reported (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    obj = grpo_batch(args.batch, args.seq)
    nbytes = sum(t.numel() * t.element_size() for t in obj["batch"].values())
    memcpy_frame = dssst1.dumps(obj)
    print(
        f"GRPO batch B={args.batch} T={args.seq}: 3 x int64 + 3 x fp32 [B, T] = {nbytes / 1e6:.1f} MB; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.repeats} round trips per codec, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    header = (f"{'codec':34} {'encode s':>9} {'decode s':>9} {'round s':>9} {'max s':>8} {'GB/s':>7} {'wire MB':>8} "
              f"{'vs torch':>9} {'max vs':>7}")
    print(header)
    print("-" * len(header))
    rows: dict[str, Timing] = {}
    for name, codec in codecs().items():
        if isinstance(codec, str):
            print(f"{name:34} {codec}")
            continue
        memcpy = name.startswith("raw memcpy")
        try:
            rows[name] = time_round_trips(codec, memcpy_frame if memcpy else obj, args.repeats, None if memcpy else obj)
        except SystemExit as exc:
            raise SystemExit(f"{name}: {exc}") from None
    torch_row = rows["torch.save+load"]
    for name, t in rows.items():
        print(
            f"{name:34} {t.encode_s:9.4f} {t.decode_s:9.4f} {t.round_s:9.4f} {t.round_max_s:8.4f} "
            f"{nbytes / t.round_s / 1e9:7.2f} {t.wire_bytes / 1e6:8.1f} {torch_row.round_s / t.round_s:8.2f}x "
            f"{torch_row.round_max_s / t.round_max_s:6.2f}x"
        )
    print(
        "encode = object -> wire bytes; decode = wire bytes -> tensors; round = encode + decode (medians); "
        "max = slowest round trip; GB/s = tensor bytes / median round; vs torch / max vs = torch.save+load's "
        "median / max round trip over this codec's."
    )


if __name__ == "__main__":
    main()
