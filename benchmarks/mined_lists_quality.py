"""Do mined hard negatives, as lists, train a better retriever than a bigger cached batch without them, at
equal compute? (Issue 60.)

The packaged all-MiniLM-L6-v2 is fine-tuned with ``CachedMNRLoss`` on the standard library's (docstring summary,
function source) pairs and scored on the same held-out pairs (MRR@10 by sentence-transformers'
``InformationRetrievalEvaluator``), the same optimizer steps and about the same encoder forwards per step:

* ``lists``: ``--list-pairs`` training pairs at batch ``--list-batch``, each query with the hard negatives that
  sentence-transformers' ``mine_hard_negatives`` finds for it with the pretrained model (up to
  ``--negatives`` among its ``--range-max`` best candidates, ``relative_margin`` ``--margin``: a candidate
  scoring within that fraction of the positive is skipped as a likely false negative; ``output_format="labeled-list"``, so each query keeps what it has:
  lists of their own lengths), collated by ``ListDataCollator``;
* ``pairs``: as many steps over more pairs at the batch whose texts per step match the lists run's (anchors,
  positives and the mean list length), pairs only: the forwards the negatives took spent on more pairs;
* ``same pairs, no negatives``: the lists run's pairs at its batch without the negatives (fewer forwards): what
  the negatives themselves add.

Each run is repeated for ``--seeds``; the table gives the median, the range, and whether the difference
exceeds the seed range. Run: ``.venv/bin/python benchmarks/mined_lists_quality.py --threads 1``. Writes
``benchmarks/results/mined_lists_quality.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time

from _common import ROOT, minilm, quality_arguments, quality_evaluate, quality_setup

RESULTS = ROOT / "benchmarks" / "results"


def _mined(dataset, negatives: int, margin: float, range_max: int, max_seq_length: int):
    """``(query, document, negative)`` rows, ``negative`` a list of the hard negatives mined for the query."""
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    labeled = mine_hard_negatives(
        dataset,
        minilm(max_seq_length),
        num_negatives=negatives,
        relative_margin=margin,
        range_max=range_max,
        output_format="labeled-list",
        verbose=False,
    )
    anchor, docs, labels = labeled.column_names[:3]
    rows: dict[str, list] = {"query": [], "document": [], "negative": []}
    for a, d, lab in zip(labeled[anchor], labeled[docs], labeled[labels]):
        rows["query"].append(a)
        rows["document"].append(next(x for x, y in zip(d, lab) if y == 1))
        rows["negative"].append([x for x, y in zip(d, lab) if y == 0])
    return Dataset.from_dict(rows)


def _train(dataset, args, lists: bool, max_seq_length: int) -> tuple[object, float, int]:
    from sentence_transformers import SentenceTransformerTrainer

    from st_cached_losses import CachedMNRLoss
    from st_cached_losses.config.collator import ListDataCollator

    model = minilm(max_seq_length)
    loss = CachedMNRLoss(model, mini_batch_size=args.mini_batch_size)
    collator = ListDataCollator(preprocess_fn=model.preprocess) if lists else None
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=dataset, loss=loss, data_collator=collator
    )
    t0 = time.perf_counter()
    trainer.train()
    return model, time.perf_counter() - t0, trainer.state.global_step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list-pairs", type=int, default=256)
    parser.add_argument("--list-batch", type=int, default=16)
    parser.add_argument("--negatives", type=int, default=4)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument(
        "--range-max", type=int, default=8, help="mine among each query's top candidates only"
    )
    parser.add_argument("--eval-pairs", type=int, default=300)
    parser.add_argument("--max-seq-length", type=int, default=32)
    parser.add_argument("--mini-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    quality_setup(args.threads)
    import torch

    from st_cached_losses.demo import retrieval_evaluator, stdlib_data

    # the lists run's pairs are the first of the pairs run's; the pairs run's batch spends the lists' texts per
    # step on more pairs (at most every query with --negatives negatives)
    steps = -(-args.list_pairs // args.list_batch)
    most = steps * round(args.list_batch * (2 + args.negatives) / 2)
    train, held_out = stdlib_data(most, args.eval_pairs)
    mined = _mined(
        train.select(range(args.list_pairs)), args.negatives, args.margin, args.range_max, args.max_seq_length
    )
    lengths = [len(n) for n in mined["negative"]]
    mean_list = statistics.mean(lengths)
    steps = -(-len(mined) // args.list_batch)  # mine_hard_negatives leaves out a query with none found
    pair_batch = round(args.list_batch * (2 + mean_list) / 2)
    n_pairs = steps * pair_batch
    evaluator = retrieval_evaluator(held_out, name="heldout", show_progress_bar=False)
    runs = {
        "lists": (mined, args.list_batch, True),
        "pairs": (train.select(range(n_pairs)), pair_batch, False),
        # the lists run's queries and positives without their negatives: what the negatives themselves did
        "same pairs, no negatives": (mined.remove_columns("negative"), args.list_batch, False),
    }
    results: dict = {"pretrained": quality_evaluate(minilm(args.max_seq_length), evaluator)}
    for name, (data, batch, lists) in runs.items():
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as out:
                targs = quality_arguments(
                    out, batch, args.lr, seed, loss="mnr", mini_batch_size=args.mini_batch
                )
                model, seconds, taken = _train(data, targs, lists, args.max_seq_length)
                metrics = quality_evaluate(model, evaluator)
            results.setdefault(name, []).append(
                {
                    "seed": seed,
                    "batch": batch,
                    "rows": len(data),
                    "steps": taken,
                    "train_s": round(seconds, 1),
                    **metrics,
                }
            )
            print(name, results[name][-1], flush=True)
    summary = {
        "command": "python benchmarks/mined_lists_quality.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": torch.get_num_threads(),
        "list_lengths": {"min": min(lengths), "mean": round(mean_list, 2), "max": max(lengths)},
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mined_lists_quality.json").write_text(json.dumps(summary, indent=2))
    base = results["pretrained"]["MRR@10"]
    lines = [
        "# Mined hard negatives as lists vs a bigger batch of pairs, equal steps and texts per step (issue 60)",
        "",
        f"`{summary['command'].strip()}`, {summary['date']}, {summary['threads']} CPU thread(s). all-MiniLM-L6-v2, "
        f"max_seq_length {args.max_seq_length}, encoder mini-batch {args.mini_batch}, lr {args.lr} constant, one "
        f"epoch, {args.eval_pairs} held-out pairs; mined lists: {min(lengths)}-{max(lengths)} negatives per query "
        f"(mean {mean_list:.2f}), mine_hard_negatives(num_negatives={args.negatives}, "
        f"relative_margin={args.margin}, range_max={args.range_max}, output_format='labeled-list').",
        "",
        "| run | batch | training rows | steps | MRR@10 median (range) | vs pretrained | recall@1 median | train s |",
        "|---|---|---|---|---|---|---|---|",
        f"| pretrained | - | - | 0 | {base:.4f} | - | {results['pretrained']['recall@1']:.4f} | - |",
    ]
    medians = {}
    for name in runs:
        rs = results[name]
        mrr = [r["MRR@10"] for r in rs]
        medians[name] = (statistics.median(mrr), min(mrr), max(mrr))
        lines.append(
            f"| {name} | {rs[0]['batch']} | {rs[0]['rows']} | {rs[0]['steps']} | {medians[name][0]:.4f} "
            f"({min(mrr):.4f}-{max(mrr):.4f}) | {medians[name][0] - base:+.4f} | "
            f"{statistics.median(r['recall@1'] for r in rs):.4f} | {statistics.median(r['train_s'] for r in rs):.0f} |"
        )
    (lo_l, hi_l), (lo_p, hi_p) = medians["lists"][1:], medians["pairs"][1:]
    apart = lo_l > hi_p or lo_p > hi_l
    lines += [
        "",
        f"Lists - pairs: {medians['lists'][0] - medians['pairs'][0]:+.4f} MRR@10 (medians over {len(args.seeds)} "
        f"seeds); the seeds' ranges {'do not overlap' if apart else 'overlap'}.",
    ]
    (RESULTS / "mined_lists_quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
