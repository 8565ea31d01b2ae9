"""Tiny random vision-language models, built offline: a Qwen2-VL (flattened patches with their grids), a
LLaVA (gridless, one ``pixel_values`` entry per image) and an Idefics3 (sample-first: ``pixel_values``
``(B, max_images, 3, H, W)`` with ``pixel_attention_mask``), each with a processor made in-process (a word-level
tokenizer, the PIL image processor at tiny sizes, a chat template), loaded as sentence-transformers loads
them (``Transformer`` + mean ``Pooling``), so their inputs come from its own ``preprocess``.

transformers' Qwen2-VL processor wants a video processor, which needs torchvision: :class:`TinyQwen2VLProcessor`
is the same processor without one (registered with ``AutoProcessor`` so that sentence-transformers loads
it). Videos are therefore built by hand (:func:`qwen_video_column`), as the processor lays them out."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoProcessor,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3Processor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2VLConfig,
    Qwen2VLModel,
    Qwen2VLProcessor,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

WORDS = [f"w{i}" for i in range(60)]
HIDDEN = 32
#: Qwen2-VL's vision patches: 4 x 4 pixels, 2 frames (an image is repeated), 2 x 2 merged into one token
PATCH, TEMPORAL, MERGE = 4, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH

_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ image_markup }}"
    "{% elif item['type'] == 'text' %} {{ item['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
)


def _tokenizer(specials: list[str], pad: str, eos: str) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate([*specials, *WORDS, "user", "assistant", "system"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=pad))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        eos_token=eos,
        additional_special_tokens=[t for t in specials if t not in (pad, eos)],
    )


class TinyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without a video processor (transformers' needs torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def _register() -> None:
    AutoProcessor.register(Qwen2VLConfig, TinyQwen2VLProcessor, exist_ok=True)


def _sentence_transformer(path: Path | str):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(str(path))
    return SentenceTransformer(modules=[transformer, Pooling(HIDDEN, pooling_mode="mean")], device="cpu")


def make_tiny_qwen2_vl(path: Path, *, seed: int = 0):
    """Write a random 2-layer Qwen2-VL (a 1-block vision tower) and its processor to ``path``; load it as a
    mean-pooling SentenceTransformer (:func:`load_tiny_qwen2_vl`)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(_QWEN_SPECIALS, "<|endoftext|>", "<|im_end|>")
    template = _TEMPLATE.replace("{{ image_markup }}", "<|vision_start|><|image_pad|><|vision_end|>")
    images = Qwen2VLImageProcessorPil(
        min_pixels=8 * 8, max_pixels=16 * 16, patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE
    )
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            "bos_token_id": None,
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": HIDDEN,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
            "in_channels": 3,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
    )
    torch.manual_seed(seed)
    Qwen2VLModel(config).save_pretrained(path)
    _register()
    TinyQwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template).save_pretrained(
        path
    )
    return load_tiny_qwen2_vl(path)


def load_tiny_qwen2_vl(path: Path | str):
    """The SentenceTransformer of :func:`make_tiny_qwen2_vl` (in a fresh process too)."""
    _register()
    return _sentence_transformer(path)


def load_tiny_qwen2_vl_reranker(path: Path | str):
    """The Qwen2-VL of :func:`make_tiny_qwen2_vl` as a multimodal reranker, as sentence-transformers builds one
    from a vision-language model: its causal LM (``transformer_task="any-to-any"``, a new random ``lm_head``)
    scored by ``LogitScore`` (the logit of ``w1`` minus that of ``w2`` at the last position)."""
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder import CrossEncoder
    from sentence_transformers.cross_encoder.modules import LogitScore

    _register()
    torch.manual_seed(0)
    transformer = Transformer(str(path), transformer_task="any-to-any")
    ids = transformer.processor.tokenizer.convert_tokens_to_ids
    return CrossEncoder(modules=[transformer, LogitScore(ids("w1"), ids("w2"))], device="cpu")


def make_tiny_llava(path: Path, *, seed: int = 0):
    """Write a random LLaVA (a 1-layer CLIP vision tower on 8 x 8 images of 4 x 4 patches, 4 image tokens
    each; a 2-layer Llama) and its processor to ``path``; load it as a mean-pooling SentenceTransformer."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(["<pad>", "<s>", "</s>", "<image>"], "<pad>", "</s>")
    images = CLIPImageProcessorPil(
        size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}, do_center_crop=True
    )
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 8,
            "patch_size": 4,
            "projection_dim": 16,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 256,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).model.save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops
        chat_template=_TEMPLATE.replace("{{ image_markup }}", "<image>"),
    )
    processor.save_pretrained(path)
    return _sentence_transformer(path)


def make_tiny_idefics3(path: Path, *, seed: int = 0):
    """Write a random Idefics3 (a 1-layer SigLIP vision tower on 8 x 8 images of 4 x 4 patches, pixel-shuffled
    into 1 image token; a 2-layer Llama; no image splitting) and its processor to ``path``; load it as a
    mean-pooling SentenceTransformer. Its processor pads each row's images to the batch's most, with
    all-zero images the model drops."""
    path.mkdir(parents=True, exist_ok=True)
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    specials = ["<pad>", "<s>", "</s>", "<fake_token_around_image>", "<image>", "<end_of_utterance>"]
    tokenizer = _tokenizer([*specials, "<global-img>", *grid], "<pad>", "</s>")
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 8}, max_image_size={"longest_edge": 8}, do_image_splitting=False
    )
    config = Idefics3Config(
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 8,
            "patch_size": 4,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 256,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(config).model.save_pretrained(path)
    template = _TEMPLATE.replace("{{ image_markup }}", "<image>")
    Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=1, chat_template=template
    ).save_pretrained(path)
    return _sentence_transformer(path)


def random_image(rng: random.Random, size: int | tuple[int, int]) -> Image.Image:
    """A random RGB image of ``size`` (side, or (height, width)) pixels."""
    h, w = (size, size) if isinstance(size, int) else size
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 255, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_rows(n: int, *, seed: int, images: list[int] | None = None, sizes=(8, 12, 16)) -> list[Any]:
    """``n`` message rows (one user message each): a few words and 0 to 2 images (``images[i]`` for row
    i), of sizes drawn from ``sizes`` (side lengths, or (height, width))."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        count = images[i] if images is not None else rng.randrange(3)
        content: list[dict[str, Any]] = [
            {"type": "image", "image": random_image(rng, rng.choice(sizes))} for _ in range(count)
        ]
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        content.insert(rng.randrange(len(content) + 1), {"type": "text", "text": words})
        rows.append([{"role": "user", "content": content}])
    return rows


def qwen_video_column(model, n: int, *, seed: int, videos: list[int] | None = None) -> dict[str, Any]:
    """A Qwen2-VL column of ``n`` rows with 0 to 2 videos each (``videos[i]`` for row i) and a few words,
    laid out as Qwen2-VL's processor lays videos out (its video processor needs torchvision): each video's
    ``t x h x w`` patches flattened into ``pixel_values_videos`` ``(patches, PATCH_DIM)``, its grid in
    ``video_grid_thw``, ``t * h * w / 4`` ``<|video_pad|>`` tokens (``mm_token_type_ids`` 2) between
    ``<|vision_start|>`` and ``<|vision_end|>``, ``num_videos_per_sample``; padded as the tokenizer pads."""
    rng = random.Random(seed)
    tokenizer = model[0].processor.tokenizer
    texts, grids, counts = [], [], []
    for i in range(n):
        count = videos[i] if videos is not None else rng.randrange(3)
        parts = ["<|im_start|> user"]
        for _ in range(count):
            grid = (rng.choice([1, 2]), 2 * rng.randint(1, 2), 2 * rng.randint(1, 2))
            grids.append(grid)
            parts.append("<|vision_start|>" + "<|video_pad|>" * (grid[0] * grid[1] * grid[2] // MERGE**2))
            parts.append("<|vision_end|>")
        parts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))))
        texts.append(" ".join(parts) + " <|im_end|>")
        counts.append(count)
    out = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    out.pop("token_type_ids", None)
    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    out["mm_token_type_ids"] = out["input_ids"].eq(video_id).long() * 2
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    generator = torch.Generator().manual_seed(seed)
    out["pixel_values_videos"] = torch.randn(int(grid.prod(1).sum()), PATCH_DIM, generator=generator)
    out["video_grid_thw"] = grid
    out["num_videos_per_sample"] = torch.tensor(counts, dtype=torch.long)
    out["modality"] = "message"
    return out
