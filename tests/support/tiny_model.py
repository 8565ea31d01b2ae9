"""A tiny random BERT SentenceTransformer, built offline in a temp dir, and text helpers for tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

WORDS = [f"w{i}" for i in range(200)]


def _bert_tokenizer_and_config(
    path: Path, words: Sequence[str], hidden: int, dropout: float
) -> tuple[BertTokenizerFast, BertConfig]:
    """The tokenizer (special tokens, then ``words``) and the 2-layer BERT config of the tiny models; creates
    ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys([*specials, *words]))}
    # vocab= (not vocab_file=): transformers 5.x silently builds a 5-token vocabulary from a file here
    tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return tokenizer, config


def make_tiny_model(
    path: Path,
    *,
    dropout: float = 0.0,
    hidden: int = 32,
    seed: int = 0,
    max_seq_length: int = 64,
    words: Sequence[str] = WORDS,
):
    """Write a 2-layer random BERT + tokenizer to ``path`` and load it as a mean-pooling SentenceTransformer.

    ``words`` are the tokenizer's vocabulary besides the special tokens (default: ``w0`` ... ``w199``)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    tokenizer, config = _bert_tokenizer_and_config(path, words, hidden, dropout)
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformer = Transformer(str(path), max_seq_length=max_seq_length)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def random_texts(n: int, *, seed: int, min_words: int = 1, max_words: int = 20) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def make_tiny_decoder(path: Path, *, hidden: int = 32, seed: int = 0, words: Sequence[str] = WORDS):
    """A 2-layer random Qwen2 (rotary positions) with last-token pooling and a left-padding tokenizer,
    the layout of decoder embedding models."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import Qwen2Config, Qwen2Model

    path.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys([*specials, *words]))}
    tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True, padding_side="left")
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    Qwen2Model(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformer = Transformer(str(path), max_seq_length=64)
    # AutoTokenizer would pick Qwen2's tokenizer class for this config: use the word-level one
    transformer.processor = tokenizer
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def load_tiny_decoder(path: Path | str):
    """The decoder :func:`make_tiny_decoder` wrote to ``path``, loaded again without writing anything (in
    a worker of a process group, where only rank 0 would write)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(str(path), max_seq_length=64)
    # the word-level tokenizer it was saved with (AutoTokenizer would pick Qwen2's), left-padding
    transformer.processor = BertTokenizerFast.from_pretrained(str(path))
    assert transformer.processor.padding_side == "left"
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def make_tiny_splade(
    path: Path,
    *,
    dropout: float = 0.0,
    hidden: int = 32,
    seed: int = 0,
    bias: float = -0.15,
    words: Sequence[str] = WORDS,
):
    """A 2-layer random BERT with its MLM head, written to ``path``, loaded as a SPLADE SparseEncoder
    (``Transformer(transformer_task="fill-mask")`` + max ``SpladePooling``): vocabulary-sized embeddings.

    ``bias`` shifts the MLM head's output bias (random, up to ``2 * bias``) so that the rows are sparse and
    their numbers of non-zero entries vary (a random head activates about half the vocabulary)."""
    from sentence_transformers.sentence_transformer.modules import Transformer
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertForMaskedLM

    tokenizer, config = _bert_tokenizer_and_config(path, words, hidden, dropout)
    torch.manual_seed(seed)
    mlm = BertForMaskedLM(config)
    with torch.no_grad():
        mlm.cls.predictions.bias.copy_(bias * 2 * torch.rand(config.vocab_size))
    mlm.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformer = Transformer(str(path), max_seq_length=64, transformer_task="fill-mask")
    pooling = SpladePooling("max", embedding_dimension=config.vocab_size)
    return SparseEncoder(modules=[transformer, pooling], device="cpu")


def make_tiny_multi_vector(path: Path, seed: int = 0):
    """A 2-layer random BERT as a MultiVectorEncoder: Transformer, a random token projection (32 -> 128),
    MultiVectorMask and a token-level Normalize, as the encoder builds it from a plain checkpoint."""
    from sentence_transformers import MultiVectorEncoder

    make_tiny_model(path, seed=seed)
    torch.manual_seed(seed)
    return MultiVectorEncoder(str(path), device="cpu")


def make_tiny_cross_encoder(
    path: Path,
    *,
    dropout: float = 0.0,
    hidden: int = 32,
    seed: int = 0,
    max_length: int = 64,
    words: Sequence[str] = WORDS,
    num_labels: int = 1,
):
    """Write a 2-layer random BERT for sequence classification (``num_labels``) + tokenizer to ``path`` and load
    it as a ``CrossEncoder`` (a reranker scoring (query, document) pairs)."""
    from sentence_transformers.cross_encoder import CrossEncoder
    from transformers import BertForSequenceClassification

    tokenizer, config = _bert_tokenizer_and_config(path, words, hidden, dropout)
    config.num_labels = num_labels
    # BERT's default init (0.02) scores every pair alike (spread ~1e-5): the gradient is then a sum of
    # nearly cancelling per-pair terms and any two summation orders differ by rounding alone; wider
    # weights give scores that differ (spread ~0.4), as a trained reranker's do
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return CrossEncoder(str(path), device="cpu", max_length=max_length)


def load_for_ddp(path: str):
    """A saved tiny SentenceTransformer loaded on the CPU without BERT's pooler, which mean pooling leaves
    unused (DDP expects every parameter to get a gradient)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model[0].auto_model.pooler = None
    return model
