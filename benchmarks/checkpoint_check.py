"""What checking a checkpoint's files costs: the digests recorded at save time and the checks before a resume.

A checkpoint of the size of a ResNet-50 run with Adam (25.6 M parameters: ``model.safetensors`` of 102 MB and an
``optimizer.bin`` of twice that) is written the way accelerate writes it, then timed:

- write: safetensors + ``torch.save`` (what ``accelerator.save_state`` does, for scale);
- digest at save: ``digest_files`` (size and SHA-256 of every file, into ``meta.json``);
- check before a resume / eval: ``checkpoint_problem`` with the record (sizes, then digests);
- structural check of a checkpoint without a record (safetensors header, torch zip CRC-32s);
- load: safetensors + ``torch.load`` of the same files (what a resume reads anyway).

    python -m benchmarks.checkpoint_check                 # ResNet-50 size, 3 repeats
    python -m benchmarks.checkpoint_check --params 2e6    # smaller
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import markdown_table, write_result
from ddp_rank.file_checks import digest_files
from ddp_rank.model.checkpoint_read import FILES_KEY, META_NAME, checkpoint_problem


def make_state(params: int) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The weights and Adam's two moments of ``params`` parameters, in 160 tensors."""
    sizes = [params // 160] * 159 + [params - 159 * (params // 160)]
    weights = {f"layer{i}.weight": torch.randn(n) for i, n in enumerate(sizes)}
    state = {i: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n), "step": torch.tensor(5.0)}
             for i, n in enumerate(sizes)}  # fmt: skip
    return weights, {"state": state, "param_groups": [{"lr": 1e-5, "params": list(range(len(sizes)))}]}


def write_checkpoint(folder: Path, weights: dict[str, torch.Tensor], optimizer: dict[str, object]) -> None:
    """model.safetensors, optimizer.bin and random_states_0.pkl, as accelerate's ``save_state`` writes them."""
    from safetensors.torch import save_file

    save_file(weights, str(folder / "model.safetensors"))
    torch.save(optimizer, folder / "optimizer.bin")
    torch.save({"random_state": torch.get_rng_state()}, folder / "random_states_0.pkl")


def load_checkpoint(folder: Path) -> None:
    from safetensors.torch import load_file

    load_file(str(folder / "model.safetensors"))
    torch.load(folder / "optimizer.bin", weights_only=True)


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=25.6e6, help="parameters of the model")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    parser.add_argument("--no-write", action="store_true", help="print only, write no results file")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    try:
        folder = tmp / "step-00000001"
        folder.mkdir()
        weights, optimizer = make_state(int(args.params))
        write_s = best_of(1, lambda: write_checkpoint(folder, weights, optimizer))
        megabytes = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
        files: dict[str, object] = {}
        digest_s = best_of(args.repeats, lambda: files.update(digest_files(folder)))
        (folder / META_NAME).write_text(json.dumps({"step": 1, FILES_KEY: files}))
        check_s = best_of(args.repeats, lambda: checkpoint_problem(folder))
        (folder / META_NAME).write_text(json.dumps({"step": 1}))
        legacy_s = best_of(args.repeats, lambda: checkpoint_problem(folder))
        load_s = best_of(args.repeats, lambda: load_checkpoint(folder))
    finally:
        shutil.rmtree(tmp)
    rows = [
        ["write (safetensors + torch.save)", f"{write_s:.2f}", f"{megabytes / write_s:.0f}"],
        ["digest at save (size + SHA-256)", f"{digest_s:.2f}", f"{megabytes / digest_s:.0f}"],
        ["check with the record", f"{check_s:.2f}", f"{megabytes / check_s:.0f}"],
        ["structural check (no record)", f"{legacy_s:.2f}", f"{megabytes / legacy_s:.0f}"],
        ["load (safetensors + torch.load)", f"{load_s:.2f}", f"{megabytes / load_s:.0f}"],
    ]
    table = markdown_table(["step", "seconds", "MB/s"], rows)
    body = (
        f"A checkpoint of {args.params / 1e6:.1f} M parameters with Adam's state: {megabytes:.0f} MB in 3 files "
        f"(best of {args.repeats}, page cache warm; the write once).\n\n{table}"
    )
    print(body)
    if not args.no_write:
        print(f"written to {write_result('checkpoint-check', 'Checking checkpoint files', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
