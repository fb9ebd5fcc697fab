"""One speculative round's verification at a real vocabulary: dense tables vs top-K lists.

The engines report, per proposal position, the sampled (draft) or prompt (guidance) token and
its top-K log-probs. The rollout used to spread them into dense (B, k, V) float64 tables before
verifying; it now verifies the lists themselves (`speculative.TopK`). Both paths below start
from the same lists and do the same work per round: build the tables, report the top-K tail
mass, verify. Reported: median time per round and table bytes, dense / lists, in one run.

Usage:
    python benchmarks/bench_verify.py
    python benchmarks/bench_verify.py --vocab 32000 --batch 64 --k 6 --logprobs 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from verl.workers.rollout.speculative import TopK, verify_proposals


def engine_lists(batch: int, k: int, logprobs: int, vocab: int, first: torch.Tensor, seed: int):
    """(B, k, K+1) token ids and log-probs as an engine lists them: `first`, then the top-K."""
    gen = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(batch, k, vocab, generator=gen) * 3, dim=-1)
    top = log_probs.topk(logprobs, dim=-1)
    ids = torch.cat([first.unsqueeze(-1), top.indices], dim=-1)
    return ids, log_probs.gather(-1, ids).double()


def dense_round(proposals, num, draft, guide, vocab: int, lam: float, gen):
    tables = []
    for ids, values in (draft, guide):
        table = torch.full((*ids.shape[:2], vocab), float("-inf"), dtype=torch.float64)
        tables.append(table.scatter_(-1, ids, values))
    tail = (1.0 - tables[1].exp().sum(-1)).clamp(min=0.0)
    return verify_proposals(proposals, num, *tables, lam, gen), tail, sum(t.nbytes for t in tables)


def lists_round(proposals, num, draft, guide, vocab: int, lam: float, gen):
    p, q = TopK.dedupe(*draft), TopK.dedupe(*guide)
    nbytes = sum(t.ids.nbytes + t.log_probs.nbytes for t in (p, q))
    return verify_proposals(proposals, num, p, q, lam, gen), q.tail_mass(), nbytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=151_936, help="V (Qwen2.5's, by default)")
    parser.add_argument("--batch", type=int, default=16, help="sequences in one round (a group)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--logprobs", type=int, default=20, help="top-K listed per position")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    b, k = args.batch, args.k
    proposals = torch.randint(args.vocab, (b, k), generator=torch.Generator().manual_seed(0))
    num = torch.full((b,), k)
    draft = engine_lists(b, k, args.logprobs, args.vocab, proposals, 1)
    guide = engine_lists(b, k, args.logprobs, args.vocab, proposals, 2)
    runs = {"dense tables": dense_round, "top-K lists": lists_round}
    times: dict[str, list[float]] = {name: [] for name in runs}
    nbytes = {}
    for _ in range(args.repeats):  # alternated
        for name, fn in runs.items():
            start = time.perf_counter()
            _, _, nbytes[name] = fn(
                proposals, num, draft, guide, args.vocab, 0.5, torch.Generator().manual_seed(3)
            )
            times[name].append(time.perf_counter() - start)
    print(
        f"torch {torch.__version__}, V={args.vocab}, B={b}, k={k}, top-{args.logprobs}, {torch.get_num_threads()} threads"
    )
    for name, t in times.items():
        print(
            f"{name:13s} median {statistics.median(t) * 1e3:8.3f} ms per round, tables {nbytes[name] / 2**20:8.3f} MiB"
        )
    dense, lists = (statistics.median(times[n]) for n in runs)
    print("\n=== summary (ratios from one run) ===")
    print(f"verification per round: dense / top-K lists = {dense / lists:.1f}x time, "
          f"{nbytes['dense tables'] / nbytes['top-K lists']:.0f}x table memory")  # fmt: skip


if __name__ == "__main__":
    main()
