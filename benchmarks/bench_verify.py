"""One speculative round's verification at a real vocabulary: dense tables vs top-K lists vs rows.

The engines report, per proposal position, the sampled (draft) or prompt (guidance) token and
its top-K log-probs, as flat rows (N, K+1). Three ways to verify them, each doing the same work
per round from the same rows (build the tables, report the top-K tail mass, verify):
- dense tables: spread into (B, k, V) float64 tables (the first rollout);
- top-K lists: padded into (B, k, K+1) `speculative.TopK` tables (the previous rollout);
- flat rows: `speculative.verify_listed` on the rows themselves, in numpy (the rollout now).
Reported: median time per round and table bytes of each, and their ratios, in one run.

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

from verl.workers.rollout.speculative import ListedRows, verify_listed, verify_proposals


def engine_rows(batch: int, k: int, logprobs: int, vocab: int, first: torch.Tensor, seed: int):
    """(B*k, K+1) token ids and float32 log-probs as an engine lists them: `first`, then the top-K."""
    gen = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(batch * k, vocab, generator=gen) * 3, dim=-1)
    ids = torch.cat([first.reshape(-1, 1), log_probs.topk(logprobs, dim=-1).indices], dim=-1)
    return ListedRows(ids.numpy(), log_probs.gather(-1, ids).numpy())


def dense_round(proposals, num, draft, guide, vocab: int, lam: float, uniforms):
    tables = []
    for rows in (draft, guide):
        table = torch.full((*proposals.shape, vocab), float("-inf"), dtype=torch.float64)
        ids, values = (
            torch.from_numpy(a).reshape(*proposals.shape, -1) for a in (rows.ids, rows.log_probs)
        )
        tables.append(table.scatter_(-1, ids.long(), values.double()))
    tail = (1.0 - tables[1].exp().sum(-1)).clamp(min=0.0)
    out = verify_proposals(proposals, num, *tables, lam, uniforms=uniforms)
    return out, tail, sum(t.nbytes for t in tables)


def lists_round(proposals, num, draft, guide, vocab: int, lam: float, uniforms):
    p, q = (rows.as_topk(num, proposals.shape[1]) for rows in (draft, guide))
    nbytes = sum(t.ids.nbytes + t.log_probs.nbytes for t in (p, q))
    return verify_proposals(proposals, num, p, q, lam, uniforms=uniforms), q.tail_mass(), nbytes


def rows_round(proposals, num, draft, guide, vocab: int, lam: float, uniforms):
    nbytes = sum(rows.ids.nbytes + rows.log_probs.nbytes for rows in (draft, guide))
    return verify_listed(num, draft, guide, lam, uniforms), guide.tail_mass(), nbytes


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
    draft = engine_rows(b, k, args.logprobs, args.vocab, proposals, 1)
    guide = engine_rows(b, k, args.logprobs, args.vocab, proposals, 2)
    uniforms = torch.rand(b, k + 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    runs = {"dense tables": dense_round, "top-K lists": lists_round, "flat rows": rows_round}
    same = [fn(proposals, num, draft, guide, args.vocab, 0.5, uniforms)[0] for fn in runs.values()]
    assert torch.equal(same[1].tokens, same[2].tokens), "top-K lists and flat rows disagree"
    times: dict[str, list[float]] = {name: [] for name in runs}
    nbytes = {}
    for _ in range(args.repeats):  # alternated
        for name, fn in runs.items():
            start = time.perf_counter()
            _, _, nbytes[name] = fn(proposals, num, draft, guide, args.vocab, 0.5, uniforms)
            times[name].append(time.perf_counter() - start)
    print(
        f"torch {torch.__version__}, V={args.vocab}, B={b}, k={k}, top-{args.logprobs}, {torch.get_num_threads()} threads"
    )
    for name, t in times.items():
        print(
            f"{name:13s} median {statistics.median(t) * 1e3:8.3f} ms per round, tables {nbytes[name] / 2**20:8.3f} MiB"
        )
    dense, lists, rows = (statistics.median(times[n]) for n in runs)
    print("\n=== summary (ratios from one run) ===")
    print(f"verification per round: dense / top-K lists = {dense / lists:.1f}x time, "
          f"{nbytes['dense tables'] / nbytes['top-K lists']:.0f}x table memory")  # fmt: skip
    print(f"verification per round: top-K lists / flat rows = {lists / rows:.1f}x time, "
          f"dense / flat rows = {dense / rows:.0f}x time")  # fmt: skip


if __name__ == "__main__":
    main()
