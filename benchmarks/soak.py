"""Soak: does a long training run with a cached loss keep its memory and its Python objects flat?

The user's path: sentence-transformers' stock ``SentenceTransformerTrainer`` under ``accelerate launch``
(DDP over ``--processes`` gloo processes on CPU), a tiny random BERT (hidden 32, 2 layers, built offline
in a temp dir), ``CachedMNRLoss(model, mini_batch_size=4, gather_across_devices=True)``, ``--steps``
optimizer steps (default 1,000) over a synthetic pairs dataset of random word texts (several epochs,
so epoch boundaries are crossed too), with an evaluation every ``--eval-every`` steps whose eval loss
is computed by the same loss.

A ``TrainerCallback`` in every process samples, at step 0 and every ``--sample-every`` steps (after
``gc.collect()``; nothing is measured between sample points):

* ``rss_mib``: the resident set size of the process (psutil, or VmRSS from /proc/self/status);
* ``tensors`` / ``tensor_mib``: the torch tensors alive in Python (``gc.get_objects()``) and the bytes of
  their distinct storages (parameters, gradients, optimizer state and whatever else is still referenced);
* ``py_objects``: ``len(gc.get_objects())``;
* ``engine_instances``: instances alive of every class defined in ``st_cached_losses`` (the engine's
  ``MiniBatch``, ``_Session``, ``RandState``..., broken down by class in the CSV) plus the engine's
  autograd nodes (``_ReplayBackward``); between steps only the loss, its ``GradCache`` and the module-level
  ``CollectiveStats`` should be alive;
* ``loss_reachable``: the Python objects reachable from the loss, not counting the model (and other
  ``nn.Module``s) it refers to;
* ``log_entries``: ``len(trainer.state.log_history)``, which the trainer grows by design (one entry per
  log / evaluation), and ``prepared_loaders``: the data loaders accelerate's ``Accelerator`` keeps
  (``accelerator._dataloaders``): every evaluation prepares a new eval data loader, which accelerate keeps
  for good (sentence-transformers reuses them only with ``dataloader_persistent_workers``), about ten
  Python objects per evaluation that are neither ours nor a tensor. Both explain growth of the Python
  object count; the ``.md`` also lists the types whose object count changed between the first and the
  last sample.

Each process writes its samples as JSON; the launching process writes
``benchmarks/results/soak.{csv,md,png}``: per metric and process, the first (step ``--sample-every``,
after the first optimizer step has allocated its state), last and max sample, last / first, and the
change over the second half of the run (which a one-time warm-up does not reach).

Run: ``.venv/bin/python benchmarks/soak.py`` (about 5 minutes for 1,000 steps on 2 shared CPU cores); a
smoke run: ``--steps 60 --eval-every 20 --sample-every 10``. The script re-launches itself as
``accelerate launch --multi_gpu --num_processes 2 ... benchmarks/soak.py --worker ...``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from _common import ROOT

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

WORDS = [f"w{i}" for i in range(200)]
METRICS = [
    "rss_mib",
    "tensors",
    "tensor_mib",
    "py_objects",
    "engine_instances",
    "loss_reachable",
    "log_entries",
    "prepared_loaders",
]


# ---------------------------------------------------------------------------------------------- model, data


def build_tiny_model(path: Path, *, hidden: int = 32, seed: int = 0) -> None:
    """Write a 2-layer random BERT (word-level vocabulary ``w0`` ... ``w199``) with mean pooling as a
    SentenceTransformer folder at ``path``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    bert = path / "bert"
    bert.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys([*specials, *WORDS]))}
    # vocab= (not vocab_file=): transformers 5.x silently builds a 5-token vocabulary from a file
    tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(bert)
    tokenizer.save_pretrained(bert)
    transformer = Transformer(str(bert), max_seq_length=64)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling], device="cpu").save(str(path / "st"))


def random_texts(n: int, *, seed: int, min_words: int = 2, max_words: int = 30) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def pairs(n: int, seed: int):
    """Anchors and positives that share most of their words, so that the loss has something to learn."""
    from datasets import Dataset

    rng = random.Random(seed + 1)
    anchors = random_texts(n, seed=seed)
    positives = [" ".join(w if rng.random() < 0.7 else rng.choice(WORDS) for w in a.split()) for a in anchors]
    return Dataset.from_dict({"anchor": anchors, "positive": positives})


# ---------------------------------------------------------------------------------------------- sampling


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # pragma: no cover - psutil is optional
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    return 0


def _reachable(root, stop: tuple[type, ...]) -> int:
    """Python objects reachable from ``root`` through ``gc.get_referents``, not entering instances of
    ``stop`` (other than ``root``), types, modules and functions (shared, not held by ``root``)."""
    import types

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)
    seen = {id(root)}
    todo = [root]
    while todo:
        obj = todo.pop()
        for ref in gc.get_referents(obj):
            if id(ref) in seen or isinstance(ref, skip) or (isinstance(ref, stop) and ref is not root):
                continue
            seen.add(id(ref))
            todo.append(ref)
    return len(seen)


def sample(step: int, loss, log_entries: int, loaders: int, t0: float) -> dict:
    from torch import nn

    gc.collect()
    objects = gc.get_objects()
    # isinstance() reads __class__, which some deprecated module-level objects answer with a warning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = _count(objects)
    row.update(
        step=step,
        seconds=time.perf_counter() - t0,
        rss_mib=rss_bytes() / 2**20,
        py_objects=len(objects),
        loss_reachable=_reachable(loss, (nn.Module,)),
        log_entries=log_entries,
        prepared_loaders=loaders,
    )
    del objects
    return {k: row[k] for k in ("step", "seconds", *METRICS, "engine_by_class", "types")}


def _count(objects: list) -> dict:
    """Live tensors (and the bytes of their distinct storages) and st_cached_losses instances."""
    import torch

    tensors = 0
    storages: dict[tuple, int] = {}
    engine: dict[str, int] = {}
    types: dict[str, int] = {}
    for obj in objects:
        cls = type(obj)
        module = getattr(cls, "__module__", None)
        name = f"{module}.{cls.__qualname__}"
        types[name] = types.get(name, 0) + 1
        if isinstance(obj, torch.Tensor):
            tensors += 1
            # not obj.untyped_storage(): that creates a Python storage object which then lives as long as
            # the storage, i.e. the measurement would grow the object count it measures. The bytes of a
            # storage: the furthest element any tensor on it reaches.
            try:
                if obj.device.type == "meta" or obj.is_sparse or obj.numel() == 0:
                    continue
                size = obj.element_size()
                base = obj.data_ptr() - obj.storage_offset() * size
                end = obj.storage_offset() + sum((n - 1) * st for n, st in zip(obj.shape, obj.stride())) + 1
            except (RuntimeError, NotImplementedError):  # tensors without a plain strided storage
                continue
            key = (obj.device.type, base)
            storages[key] = max(storages.get(key, 0), end * size)
            continue
        if (
            isinstance(module, str) and module.startswith("st_cached_losses")
        ) or cls.__name__ == "_ReplayBackward":
            engine[cls.__name__] = engine.get(cls.__name__, 0) + 1
    return {
        "tensors": tensors,
        "tensor_mib": sum(storages.values()) / 2**20,
        # the loss, its GradCache and the collective counters are expected (1 each)
        "engine_instances": sum(engine.values()),
        "engine_by_class": engine,
        "types": types,  # objects per type, for the growth report
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from transformers import TrainerCallback

    from st_cached_losses import CachedMNRLoss

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads)
    model = SentenceTransformer(args.model_dir, device="cpu")
    model[0].auto_model.pooler = None  # unused by mean pooling: DDP would wait for its gradients
    loss = CachedMNRLoss(model, mini_batch_size=args.mini_batch, gather_across_devices=True)
    global_batch = args.batch_size * world
    train = pairs(args.train_rows, seed=1)
    evaluation = pairs(args.eval_rows, seed=2)
    samples: list[dict] = []
    # objects per type at the first sample after step 0 and at the latest one
    types: dict[str, dict[str, int]] = {}
    eval_losses: list[tuple[int, float]] = []
    t0 = time.perf_counter()

    def loaders() -> int:
        return len(getattr(trainer.accelerator, "_dataloaders", ()))

    class Sampler(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kwargs):
            nonlocal t0
            t0 = time.perf_counter()
            samples.append(sample(0, loss, len(state.log_history), loaders(), t0))
            samples[-1].pop("types")

        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step % args.sample_every == 0 or state.global_step == args.steps:
                samples.append(sample(state.global_step, loss, len(state.log_history), loaders(), t0))
                types.setdefault("first", samples[-1]["types"])
                types["last"] = samples[-1].pop("types")
                if rank == 0:
                    s = samples[-1]
                    print(
                        f"[soak] step {s['step']:5d}  {s['seconds']:7.1f} s  rss {s['rss_mib']:7.1f} MiB  "
                        f"tensors {s['tensors']:5d} ({s['tensor_mib']:.2f} MiB)  objects {s['py_objects']:7d}  "
                        f"engine {s['engine_instances']} {s['engine_by_class']}  loss-reachable "
                        f"{s['loss_reachable']}",
                        flush=True,
                    )

        def on_evaluate(self, targs, state, control, metrics=None, **kwargs):
            if metrics and "eval_loss" in metrics:
                eval_losses.append((state.global_step, float(metrics["eval_loss"])))

    training_args = SentenceTransformerTrainingArguments(
        output_dir=str(Path(args.samples_dir) / "trainer"),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=1e-4,
        warmup_steps=0,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        logging_steps=args.eval_every,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_drop_last=True,
        ddp_find_unused_parameters=False,
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        loss=loss,
        callbacks=[Sampler()],
    )
    result = trainer.train()
    assert trainer.accelerator.num_processes == world, "accelerate must run the expected number of processes"
    out = {
        "rank": rank,
        "world": world,
        "global_batch": global_batch,
        "train_runtime": result.metrics.get("train_runtime"),
        "train_loss": result.metrics.get("train_loss"),
        "eval_losses": eval_losses,
        # the types whose number of objects changed between the first and the last sample
        "type_growth": sorted(
            (
                (name, types["last"].get(name, 0) - types["first"].get(name, 0))
                for name in set(types["first"]) | set(types["last"])
                if types["last"].get(name, 0) != types["first"].get(name, 0)
            ),
            key=lambda x: -abs(x[1]),
        ),
        "samples": samples,
    }
    Path(args.samples_dir, f"rank{rank}.json").write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------- launcher


def launch(args: argparse.Namespace, model_dir: Path, samples_dir: Path) -> None:
    worker_args = [
        str(Path(__file__).resolve()),
        "--worker",
        "--model-dir",
        str(model_dir),
        "--samples-dir",
        str(samples_dir),
        *(
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in (
                "steps",
                "eval_every",
                "sample_every",
                "batch_size",
                "mini_batch",
                "train_rows",
                "eval_rows",
                "threads",
            )
        ),
    ]
    if args.processes == 1:
        cmd = [sys.executable, *worker_args]
    else:
        accelerate = Path(sys.executable).parent / "accelerate"
        launcher = (
            [str(accelerate)] if accelerate.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
        )
        # accelerate's --cpu launcher starts a single process unless MPI is configured; the multi-process
        # launcher (torchrun underneath) runs gloo on CPU when no GPU is present (use_cpu=True otherwise)
        cmd = [
            *launcher,
            "launch",
            "--multi_gpu",
            "--num_processes",
            str(args.processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            *worker_args,
        ]
        if launcher[0] != str(accelerate):
            cmd.remove("launch")
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env, cwd=str(ROOT))


def summarize(per_rank: list[dict], args: argparse.Namespace, wall: float, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    classes = sorted({c for r in per_rank for s in r["samples"] for c in s["engine_by_class"]})
    rows = []
    for r in per_rank:
        for s in r["samples"]:
            row = {"rank": r["rank"], **{k: v for k, v in s.items() if k != "engine_by_class"}}
            row.update({f"n_{c}": s["engine_by_class"].get(c, 0) for c in classes})
            rows.append(row)
    with open(out / f"{args.stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    world = per_rank[0]["world"]
    runtime = max(r["train_runtime"] or 0.0 for r in per_rank)
    lines = [
        f"Soak: {args.steps} optimizer steps of the stock SentenceTransformerTrainer, DDP over {world} gloo "
        f"processes (CPU, accelerate launch), tiny random BERT (hidden 32, 2 layers), CachedMNRLoss("
        f"mini_batch_size={args.mini_batch}, gather_across_devices=True), {args.batch_size} pairs per process "
        f"(global {per_rank[0]['global_batch']}), {args.train_rows} training pairs (several epochs), evaluation "
        f"every {args.eval_every} steps on {args.eval_rows} pairs. Sampled after gc.collect() at step 0 and every "
        f"{args.sample_every} steps; first = step {args.sample_every} (after the first optimizer step), "
        f"2nd-half change = last - the sample at step {args.steps // 2}.",
        "",
        f"Wall time {wall:.0f} s (training loop {runtime:.0f} s, {runtime / max(args.steps, 1) * 1000:.0f} ms/step); "
        f"train loss {per_rank[0]['train_loss'] or float('nan'):.4f}; eval loss "
        + ", ".join(f"{loss:.4f}@{step}" for step, loss in per_rank[0]["eval_losses"]),
        "",
        "| metric | rank | step 0 | first | last | max (step) | last / first | 2nd-half change |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = {"rss_mib": "{:.1f}", "tensor_mib": "{:.3f}"}
    for metric in METRICS:
        for r in per_rank:
            ss = r["samples"]
            by_step = {s["step"]: s[metric] for s in ss}
            zero = by_step.get(0, ss[0][metric])
            first = next((s[metric] for s in ss if s["step"] >= args.sample_every), ss[0][metric])
            last = ss[-1][metric]
            top = max(ss, key=lambda s: s[metric])
            mid = next((s[metric] for s in ss if s["step"] >= args.steps // 2), last)
            f = fmt.get(metric, "{:d}").format
            ratio = f"{last / first:.3f}" if first else "-"
            lines.append(
                f"| {metric} | {r['rank']} | {f(zero)} | {f(first)} | {f(last)} | {f(top[metric])} ({top['step']}) | "
                f"{ratio} | {'+' if last - mid >= 0 else ''}{f(last - mid)} |"
            )
    last = per_rank[0]["samples"][-1]["engine_by_class"]
    lines += [
        "",
        "Engine instances alive at the last sample (rank 0): "
        + (", ".join(f"{c} {n}" for c, n in sorted(last.items())) or "none"),
    ]
    growth = per_rank[0]["type_growth"]
    lines += [
        "",
        f"Python objects per type, last sample - first sample (rank 0; {len(growth)} types changed"
        + (", the 15 largest changes" if len(growth) > 15 else "")
        + "): "
        + (", ".join(f"{name} {n:+d}" for name, n in growth[:15]) or "none"),
    ]
    (out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rss_mib", "RSS (MiB)"),
        ("tensor_mib", "live tensor storage (MiB)"),
        ("tensors", "live tensors"),
        ("py_objects", "Python objects (gc)"),
        ("engine_instances", "st_cached_losses instances"),
        ("loss_reachable", "objects reachable from the loss"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, (metric, title) in zip(axes.flat, panels):
        for r in per_rank:
            ss = r["samples"]
            ax.plot([s["step"] for s in ss], [s[metric] for s in ss], marker=".", label=f"rank {r['rank']}")
        for step in range(args.eval_every, args.steps + 1, args.eval_every):
            ax.axvline(step, color="grey", alpha=0.2, linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("optimizer step (grey: evaluations)")
        ax.legend()
    fig.suptitle(f"Soak: {args.steps} steps, DDP x{world}, CachedMNRLoss(gather_across_devices=True)")
    fig.tight_layout()
    fig.savefig(out / f"{args.stem}.png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    parser.add_argument("--eval-every", type=int, default=100, help="evaluation (and logging) every N steps")
    parser.add_argument("--sample-every", type=int, default=50, help="measure every N steps")
    parser.add_argument("--processes", type=int, default=2, help="DDP processes (accelerate launch)")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per process per step")
    parser.add_argument("--mini-batch", type=int, default=4, help="the loss's mini_batch_size")
    parser.add_argument("--train-rows", type=int, default=4096, help="training pairs (epochs repeat)")
    parser.add_argument("--eval-rows", type=int, default=256, help="evaluation pairs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--stem", default="soak", help="output file names: STEM.{csv,md,png}")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    # internal: the per-process entry point under accelerate launch
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--samples-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return

    tmp = Path(tempfile.mkdtemp(prefix="soak_"))
    try:
        build_tiny_model(tmp / "model")
        t0 = time.perf_counter()
        launch(args, tmp / "model" / "st", tmp)
        wall = time.perf_counter() - t0
        per_rank = [json.loads(p.read_text()) for p in sorted(tmp.glob("rank*.json"))]
        if len(per_rank) != args.processes:
            raise RuntimeError(f"expected {args.processes} sample files, found {len(per_rank)}")
        summarize(sorted(per_rank, key=lambda r: r["rank"]), args, wall, Path(args.out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
