"""One training step with an installed st_cached_losses: the check `make dist` runs inside a fresh
environment holding only the built wheel and its dependencies.

It builds a tiny random BERT offline (nothing is downloaded), wraps it as a mean-pooling
SentenceTransformer, trains one step of ``CachedMNRLoss`` (4 encoder mini-batches of 4 rows) with the
stock ``SentenceTransformerTrainer``, and checks that the step changed the weights, that the loss is
finite and that ``st_cached_losses`` was imported from the environment, not from a source tree.

    python tools/smoke_train.py            # exits 0 and prints one line on success
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    import torch
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    import st_cached_losses
    from st_cached_losses import CachedMNRLoss

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(st_cached_losses.__file__).resolve()
    if site not in where.parents:
        sys.exit(f"st_cached_losses was imported from {where}, not from this environment's {site}")

    words = [f"w{i}" for i in range(50)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-bert"
        vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
        # vocab= (not vocab_file=): transformers 5 builds a 5-token vocabulary from a file here
        tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True)
        config = BertConfig(
            vocab_size=len(vocab),
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
        torch.manual_seed(0)
        BertModel(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        transformer = Transformer(str(path), max_seq_length=32)
        model = SentenceTransformer(
            modules=[transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")],
            device="cpu",
        )
        before = [p.detach().clone() for p in model.parameters()]

        texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(2 + i % 5)) for i in range(32)]
        data = Dataset.from_dict({"anchor": texts[:16], "positive": texts[16:]})
        loss = CachedMNRLoss(model, mini_batch_size=4)
        args = SentenceTransformerTrainingArguments(
            output_dir=str(Path(tmp) / "out"),
            per_device_train_batch_size=16,
            max_steps=1,
            learning_rate=1e-3,
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            save_strategy="no",
        )
        result = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()

    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    if not changed:
        sys.exit("the training step left every weight unchanged")
    if not math.isfinite(result.training_loss):
        sys.exit(f"the training loss is {result.training_loss}")
    print(
        f"smoke: st_cached_losses {st_cached_losses.__version__} from {where.parent}: one CachedMNRLoss step "
        f"(16 pairs, 4 mini-batches), loss {result.training_loss:.4f}, weights updated; torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
