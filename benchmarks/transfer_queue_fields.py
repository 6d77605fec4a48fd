"""What the forwarder's batch read costs by the fields it fetches: verl's TransferQueue, in one process.

    python benchmarks/transfer_queue_fields.py [--rows 512] [--prompt 64] [--response 256] [--repeats 3]

verl 0.9.1's trainer keeps a step's samples in TransferQueue (its ``SimpleStorage`` backend, the default, started
here in a local Ray cluster), and verl's bridge in the forwarder worker reads the fields a call's meta names
(``verl.remote_backend.workers.tensor_fields``). This puts one batch shaped as verl's is by the update (nested
token ids, position ids and masks; response-padded scores; nested advantages, old log-probs, entropy, returns: 14
tensor fields) and times ``kv_batch_get`` of: every field (the baseline, what a meta naming all of them reads), the
fields the Arctic adapter declares for ``update_actor`` and for ``compute_log_prob`` (present in the batch), and
each field alone. Medians of ``--repeats`` reads, after one warm-up read; the load average is printed (a shared
machine reads slower).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch


def verl_like_fields(rows: int, prompt: int, response: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensor fields of a batch at ``update_actor`` time, with random lengths and values."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(max(1, response // 4), response + 1, (rows,), generator=g)
    seq = torch.randint(max(1, prompt // 2), prompt + 1, (rows,), generator=g) + resp

    def nested(lengths: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.nested.as_nested_tensor(
            [torch.randint(0, 1000, (int(n),), generator=g).to(dtype) for n in lengths], layout=torch.jagged)

    return {
        "input_ids": nested(seq), "position_ids": nested(seq), "loss_mask": nested(seq),
        "prompts": torch.randint(0, 1000, (rows, prompt), generator=g),
        "responses": torch.randint(0, 1000, (rows, response), generator=g),
        "response_mask": nested(resp), "rm_scores": torch.rand(rows, response, generator=g),
        "rollout_log_probs": torch.rand(rows, response, generator=g), "dummy_tensor": torch.zeros(rows, 1),
        "advantages": nested(resp, torch.float32), "old_log_probs": nested(resp, torch.float32),
        "entropy": nested(resp, torch.float32), "returns": nested(resp, torch.float32),
        "token_level_rewards": torch.rand(rows, response, generator=g),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512, help="samples in the batch (64 prompts x 8)")
    p.add_argument("--prompt", type=int, default=64, help="longest prompt, tokens")
    p.add_argument("--response", type=int, default=256, help="longest response, tokens")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import ray
    from tensordict import TensorDict

    # TransferQueue's controller and storage units are Ray actors of their own: room for them beside this process
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    import transfer_queue as tq

    from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

    tq.init()
    fields = verl_like_fields(args.rows, args.prompt, args.response)
    keys = [f"sample{i}" for i in range(args.rows)]
    t0 = time.perf_counter()
    tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict(fields, batch_size=[args.rows]))
    put_s = time.perf_counter() - t0

    def read(names: list[str]) -> float:
        tq.kv_batch_get(keys=keys, partition_id="train", select_fields=names)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            tq.kv_batch_get(keys=keys, partition_id="train", select_fields=names)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    every = list(fields)
    rows = [("every field (baseline)", every)]
    for method in ("update_actor", "compute_log_prob"):
        declared = ArcticRLClient.tensor_fields_read(method) or set(every)
        rows.append((f"Arctic {method}'s", [f for f in every if f in declared]))
    rows += [(f"  {name} alone", [name]) for name in every]
    print(f"{args.rows} samples, prompts <= {args.prompt} and responses <= {args.response} tokens, "
          f"{len(every)} tensor fields; put {put_s:.3f} s; load average {os.getloadavg()[0]:.1f}")
    base = None
    print(f"{'fields read':<36}{'n':>4}{'median s':>10}{'vs all':>8}")
    for label, names in rows:
        seconds = read(names)
        base = seconds if base is None else base
        print(f"{label:<36}{len(names):>4}{seconds:>10.3f}{seconds / base:>8.2f}")
    tq.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
