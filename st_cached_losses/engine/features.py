"""A batch's inputs as the caching engine sees them: the row count of a column, which positions of each
row are real tokens ([`real_tokens`][st_cached_losses.engine.features.real_tokens], the one place that decides it), the inputs of some of its rows
with the padding they do not need cut away, each row's length and token count, and whether a model's
positions allow cutting leading padding. No model is run here.

A column comes in one of two layouts, and every function here understands both:

* padded: tensors ``(B, T, ...)``, rows padded to a common length, an ``attention_mask`` ``(B, T)``
  (ColBERT query-expansion positions have mask 0 and are still real tokens);
* flattened (padding-free, transformers' ``DataCollatorWithFlattening``, which sentence-transformers
  uses whenever flash attention's variable-length kernels are on): every row's tokens concatenated into
  one sequence, ``input_ids`` / ``position_ids`` / ``seq_idx`` ``(1, total)``, rows delimited by
  ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``(B + 1,)`` (cumulative lengths from 0), ``max_length_q`` /
  ``max_length_k`` the longest row, no attention mask. Slicing such a column gathers the selected rows'
  tokens and rebuilds the per-sequence keys for them ([`is_flattened`][st_cached_losses.engine.features.is_flattened]). Every token of it is real
  (sentence-transformers never flattens expanded queries).

A padded column may also be made per mini-batch ([`InputsOnDemand`][st_cached_losses.engine.features.InputsOnDemand]): it holds only its attention
mask, which is all the planning reads, and makes the inputs of the rows a mini-batch runs when it runs (a
reranker's ``B x (1 + k)`` pairs are tokenized per mini-batch, so no step holds every pair's tokens).

A multimodal column's images and videos ([`multimodal`][st_cached_losses.engine.multimodal]: Qwen-VL's flattened
patches with their grids, gridless per-image pixels, sample-first pixels) go with their rows in either
layout: a mini-batch gets exactly its rows' images, row after row, and its token counts
([`token_counts`][st_cached_losses.engine.features.token_counts]) include its rows' vision patches."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from st_cached_losses.engine.multimodal import (
    imageless_keys,
    media_axes,
    media_keys,
    patches_per_row,
    slice_media,
    untrimmed_keys,
)

Features = Mapping[str, Any]

__all__ = [
    "Features",
    "InputsOnDemand",
    "batch_size_of",
    "check_splittable",
    "input_ids_by_row",
    "is_flattened",
    "longest_first",
    "media_tokens",
    "mini_batch_length",
    "model_device",
    "position_shift_invariant",
    "real_tokens",
    "row_lengths",
    "row_weights",
    "slice_features",
    "token_counts",
    "unwrap_model",
]


class InputsOnDemand(Mapping[str, Any]):
    """A padded column whose inputs are made per mini-batch: it holds its ``attention_mask`` ``(B, T)``
    (what the planning reads: each row's real tokens) and ``make(rows, trim_leading)``, which returns the
    inputs of ``rows`` as [`slice_features`][st_cached_losses.engine.features.slice_features] would cut them from the whole padded column (padding no
    row of them needs trimmed, leading padding only with ``trim_leading``).

    A column, for the engine, is a read-only mapping (``Features``: what the planning reads with ``get``,
    ``[]``, ``in`` and iteration) that [`slice_features`][st_cached_losses.engine.features.slice_features] cuts into a mini-batch's inputs; this one
    makes them instead ([`rows`][st_cached_losses.engine.features.InputsOnDemand.rows]). It is no ``dict``:
    a copy into one (``dict(column)``, ``{**column}``) would keep the mask alone and lose the inputs, so it
    is refused with a ``TypeError`` saying so."""

    def __init__(
        self, attention_mask: Tensor, make: Callable[[Tensor, bool], Features], patches: Tensor | None = None
    ) -> None:
        self._read = {"attention_mask": attention_mask}
        self._make = make
        #: per row, the vision patches of its images and videos in flattened-patch layouts (``(B,)``, counted
        #: when the rows were measured), or None: what [`media_tokens`][st_cached_losses.engine.features.media_tokens]
        #: reads of this column, whose inputs are not held
        self.patches = patches

    def rows(self, rows: Tensor, trim_leading: bool) -> dict[str, Any]:
        """The inputs of ``rows``, made now (what [`slice_features`][st_cached_losses.engine.features.slice_features] returns for this column)."""
        return dict(self._make(rows, trim_leading))

    def __getitem__(self, key: str) -> Any:
        return self._read[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read)

    def __len__(self) -> int:
        return len(self._read)

    def keys(self) -> Any:  # what dict(...) and {**...} call: a copy would lose the inputs
        raise TypeError(
            "InputsOnDemand is a column whose inputs are made per mini-batch: a dict copy of it (dict(column), "
            "{**column}) would hold its attention_mask alone and lose the inputs. Pass the column itself; "
            "slice_features(column, rows, batch_size) (or column.rows(rows, trim_leading)) makes a mini-batch's "
            "inputs."
        )


def unwrap_model(model: nn.Module) -> nn.Module:
    """The SentenceTransformer inside a DDP (or similar) wrapper."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def model_device(model: nn.Module) -> torch.device:
    """Where the model inside any wrapper keeps its (first) parameters; the CPU without any."""
    first = next(unwrap_model(model).parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def is_flattened(features: Features) -> bool:
    """Whether a column is flattened (padding-free): its rows concatenated into one sequence and
    delimited by ``cu_seq_lens_q`` ``(B + 1,)``, as ``DataCollatorWithFlattening`` writes it."""
    bounds = features.get("cu_seq_lens_q")
    return isinstance(bounds, Tensor) and bounds.dim() == 1 and bounds.numel() >= 1


def _flat_lengths(features: Features, key: str = "cu_seq_lens_q") -> Tensor:
    """A flattened column's row lengths from its cumulative lengths ``key``: ``(B,)`` int64 on the CPU."""
    bounds = features[key].detach().to("cpu", torch.long)
    return bounds[1:] - bounds[:-1]


def batch_size_of(features: Features) -> int:
    """Rows of a column: the leading dimension of its inputs, or a flattened column's sequences."""
    if is_flattened(features):
        return int(features["cu_seq_lens_q"].numel()) - 1
    # the per-row counts of images / videos before pixel_values, which may hold one entry per image or patch
    keys = ("input_ids", "attention_mask", "inputs_embeds", "num_images_per_sample", "num_videos_per_sample")
    for key in (*keys, "pixel_values"):
        value = features.get(key)
        if isinstance(value, Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    for value in features.values():
        if isinstance(value, Tensor) and value.dim() >= 2:
            return int(value.shape[0])
    raise ValueError(
        f"cannot tell the batch size of a column with keys {sorted(features)}: a cached loss needs tensor inputs "
        "with a leading batch dimension (e.g. input_ids / attention_mask)."
    )


def check_splittable(features: Features) -> None:
    """Refuse inputs without a batch dimension to split (e.g. StaticEmbedding's flat ids + offsets)."""
    ids = features.get("input_ids")
    if "offsets" in features and isinstance(ids, Tensor) and ids.dim() == 1:
        raise ValueError(
            "this model's inputs (flat input_ids with offsets, as produced by StaticEmbedding) have no batch "
            "dimension to split into mini-batches; a StaticEmbedding model is cheap enough to train with the "
            "non-cached sentence_transformers.sentence_transformer.losses.MultipleNegativesRankingLoss."
        )


#: the key under which sentence-transformers marks ColBERT query-expansion positions, ``(B, T)``
EXPANSION_KEY = "query_expansion_positions"


def real_tokens(features: Features, batch_size: int) -> Tensor | None:
    """Per row and position, whether it is a real token: ``(B, T)`` bool, None without a 2-D attention mask.

    A real token is one the model attends to (``attention_mask`` non-zero) or one it scores without
    attending to it: ColBERT's query-expansion positions, which sentence-transformers marks in
    ``features["query_expansion_positions"]`` when a query is expanded with ``attend=False`` (PyLate and
    Stanford ColBERT checkpoints). Their attention mask is 0, yet ``MultiVectorMask`` scores them, so
    trimming them as padding would drop scored tokens. Every trim, length sort and token count of the
    engine reads this, so that no caller has to know about expansion."""
    mask = features.get("attention_mask")
    if not (isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[0] == batch_size):
        return None
    real = mask.ne(0)
    expansion = features.get(EXPANSION_KEY)
    if isinstance(expansion, Tensor) and expansion.shape == mask.shape:
        real = real | expansion.to(real.device).ne(0)
    return real


def slice_features(
    features: Features, rows: Tensor, batch_size: int, *, trim_leading: bool = True
) -> Features:
    """The inputs of ``rows`` (``(m,)`` indices), with padding no row of them needs trimmed away.

    Tensors whose first dim is the batch are indexed; of those, the ones laid out like the attention
    mask ``(B, T, ...)`` are cut to the span of real tokens ([`real_tokens`][st_cached_losses.engine.features.real_tokens]) of the selected rows:
    trailing padding always, leading (left) padding only with ``trim_leading``. A model with absolute
    positions numbers a left-padded row's tokens after its padding, so cutting that padding would change
    its embedding (and make the result depend on the mini-batch). Everything else (e.g. a Router's task
    name) is passed through.

    Images and videos indexed per image, per video or per patch ([`media_axes`][st_cached_losses.engine.multimodal.media_axes]) are
    gathered for ``rows``, row after row; a kind of visual entry none of them has is left out (sample-first
    images too, [`imageless_keys`][st_cached_losses.engine.multimodal.imageless_keys]).

    A flattened column ([`is_flattened`][st_cached_losses.engine.features.is_flattened]) has no padding: the selected rows' tokens are gathered,
    row after row in the order of ``rows``, and its per-sequence keys rebuilt for them
    (`_slice_flattened`). A column made per mini-batch ([`InputsOnDemand`][st_cached_losses.engine.features.InputsOnDemand]) makes them."""
    if isinstance(features, InputsOnDemand):
        return features.rows(rows, trim_leading)
    axes = media_axes(features, batch_size)
    # keys indexed per entry (gathered in picked), and sample-first images of rows without any (left out)
    media = media_keys(axes) | imageless_keys(features, rows, axes)
    picked = slice_media(features, rows, axes)
    if is_flattened(features):
        rest = {k: v for k, v in features.items() if k not in media}
        return {**_slice_flattened(rest, rows, batch_size), **picked}
    real = real_tokens(features, batch_size)
    span: slice | None = None
    seq_len = None
    if real is not None:
        seq_len = real.shape[1]
        used = real.index_select(0, rows.to(real.device)).any(0).nonzero()
        if used.numel() > 0:
            span = slice(int(used[0]) if trim_leading else 0, int(used[-1]) + 1)
    keep_width = untrimmed_keys(features)
    out: dict[str, Any] = {}
    for key, value in features.items():
        if key in media:
            if key in picked:
                out[key] = picked[key]
            continue
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == batch_size:
            value = value.index_select(0, rows.to(value.device))
            if span is not None and value.dim() >= 2 and value.shape[1] == seq_len and key not in keep_width:
                value = value[:, span]
        out[key] = value
    return out


def _slice_flattened(features: Features, rows: Tensor, batch_size: int) -> Features:
    """[`slice_features`][st_cached_losses.engine.features.slice_features] of a flattened column: one sequence of the ``m`` selected rows' tokens.

    Token-level tensors (``(1, total, ...)``: ``input_ids``, ``position_ids``, ...) keep the selected
    rows' tokens, so each row keeps its own positions (also an offset such as RoBERTa's); ``seq_idx``
    numbers the rows of the mini-batch ``0 .. m - 1``; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` become
    the mini-batch's cumulative lengths ``(m + 1,)`` and ``max_length_q`` / ``max_length_k`` its
    longest row (each in the type, dtype and device it came in); tensors with one entry per row
    ``(B, ...)`` are indexed; anything else is passed through."""
    total = int(features["cu_seq_lens_q"][-1])
    picked = rows.detach().to("cpu", torch.long)
    # per side of the attention (queries, keys: the same rows for self-attention), the picked rows' lengths
    side = {"q": _flat_lengths(features)[picked]}
    side["k"] = (
        _flat_lengths(features, "cu_seq_lens_k")[picked]
        if isinstance(features.get("cu_seq_lens_k"), Tensor)
        else side["q"]
    )
    lengths = side["q"]
    ends = lengths.cumsum(0)
    n = int(ends[-1]) if len(ends) else 0
    # (n,) each kept token's index in the column's sequence, row after row: its row's start plus its
    # offset within the row
    starts = features["cu_seq_lens_q"].detach().to("cpu", torch.long)[:-1][picked]
    tokens = torch.repeat_interleave(starts - (ends - lengths), lengths) + torch.arange(n)
    out: dict[str, Any] = {}
    for key, value in features.items():
        if key in ("cu_seq_lens_q", "cu_seq_lens_k") and isinstance(value, Tensor):
            own = side[key[-1]]
            cumulative = torch.cat([own.new_zeros(1), own.cumsum(0)])
            out[key] = cumulative.to(device=value.device, dtype=value.dtype)
        elif key in ("max_length_q", "max_length_k"):
            own = side[key[-1]]
            longest = int(own.max()) if len(own) else 0
            is_tensor = isinstance(value, Tensor)
            out[key] = torch.tensor(longest, dtype=value.dtype, device=value.device) if is_tensor else longest
        elif key == "seq_idx" and isinstance(value, Tensor) and value.shape[-1] == total:
            numbered = torch.repeat_interleave(torch.arange(len(picked)), lengths)
            out[key] = (
                numbered.to(device=value.device, dtype=value.dtype).expand(*value.shape[:-1], n).contiguous()
            )
        elif (
            isinstance(value, Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == total
        ):
            out[key] = value.index_select(1, tokens.to(value.device))
        elif isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == batch_size:
            out[key] = value.index_select(0, picked.to(value.device))
        else:
            out[key] = value
    return out


def row_lengths(features: Features, batch_size: int, trim_leading: bool = True) -> Tensor | None:
    """Per row, the positions it occupies once trimmed as [`slice_features`][st_cached_losses.engine.features.slice_features] trims: ``(B,)``; a
    flattened column's row lengths (it has no padding)."""
    if is_flattened(features):
        return _flat_lengths(features)
    real = real_tokens(features, batch_size)
    if real is None:
        return None
    used = real.cpu()
    pos = torch.arange(used.shape[1])
    end = torch.where(used, pos, -1).amax(1) + 1
    if not trim_leading:
        return end
    start = torch.where(used, pos, used.shape[1]).amin(1)
    return (end - start).clamp(min=0)


def row_weights(features: Features, batch_size: int, trim_leading: bool = True) -> Tensor | None:
    """Per row, the positions its forward runs on: its trimmed length ([`row_lengths`][st_cached_losses.engine.features.row_lengths]) plus the vision
    patches of its images and videos ([`media_tokens`][st_cached_losses.engine.features.media_tokens]): ``(B,)``; None without lengths. What the
    ``"auto"`` sizes probe and re-measure by: the heaviest rows of a batch are not always its longest text."""
    lengths = row_lengths(features, batch_size, trim_leading)
    patches = media_tokens(features, batch_size)
    return lengths if lengths is None or patches is None else lengths + patches


def longest_first(lengths: Tensor | None, batch_size: int) -> Tensor:
    """Row indices, the longest rows first (ties in row order); row order without ``lengths``."""
    return (
        torch.arange(batch_size) if lengths is None else torch.argsort(lengths, descending=True, stable=True)
    )


def token_counts(features: Features, batch_size: int) -> Tensor | None:
    """Per row, its real tokens ([`real_tokens`][st_cached_losses.engine.features.real_tokens]: attended, or ColBERT expansion positions): ``(B,)``;
    None without a ``(B, T)`` mask. What ``mini_batch_num_tokens`` budgets (not the padded length). A
    flattened column's row lengths (every token is real).

    sentence-transformers budgets attended tokens only; expansion positions are counted here because the
    encoder runs over them and the loss scores them, so they cost memory like any other token. So are the
    vision patches of a row's images and videos in flattened-patch layouts ([`media_tokens`][st_cached_losses.engine.features.media_tokens]): a vision
    encoder runs over them before the text model sees a quarter as many image tokens."""
    if is_flattened(features):
        counts: Tensor | None = _flat_lengths(features)
    else:
        real = real_tokens(features, batch_size)
        counts = None if real is None else real.sum(1).cpu()
    patches = media_tokens(features, batch_size)
    return counts if counts is None or patches is None else counts + patches


def media_tokens(features: Features, batch_size: int) -> Tensor | None:
    """Per row, the vision patches of its images and videos where they come flattened with a grid
    (Qwen2-VL, [`patches_per_row`][st_cached_losses.engine.multimodal.patches_per_row]): ``(B,)``; None for a column without them. What a
    token budget and the ``"auto"`` sizes count besides a row's text. A column made per mini-batch
    ([`InputsOnDemand`][st_cached_losses.engine.features.InputsOnDemand]) gives those it measured."""
    if isinstance(features, InputsOnDemand):
        return features.patches
    return patches_per_row(media_axes(features, batch_size), batch_size)


def mini_batch_length(features: Features, lengths: Tensor | None, rows: Tensor) -> int:
    """The length per row a mini-batch of ``rows`` is embedded at, so that ``len(rows)`` times it counts
    the positions its forward runs on (what the graph-memory estimates scale with): padded, its
    longest row (``lengths`` from [`row_lengths`][st_cached_losses.engine.features.row_lengths]); flattened, its rows' mean length, rounded up
    (no row is padded to the longest). Plus its rows' vision patches per row, rounded up
    ([`media_tokens`][st_cached_losses.engine.features.media_tokens]: a vision encoder's positions). 1 without lengths to tell."""
    if lengths is None or len(rows) == 0:
        return 1
    picked = lengths[rows.cpu()]
    patches = media_tokens(features, len(lengths))
    extra = 0 if patches is None else -(-int(patches[rows.cpu()].sum()) // len(rows))
    if is_flattened(features):
        return -(-int(picked.sum()) // len(rows)) + extra
    return int(picked.max()) + extra


def input_ids_by_row(features: Features) -> Tensor | list[list[int]]:
    """Each row's token ids as a tokenizer's ``batch_decode`` takes them (to re-tokenise the text for
    another model): a padded column's ``input_ids`` ``(B, T)`` as they are (its padding is a special
    token, skipped when decoding), a flattened column's one list per row."""
    ids = features["input_ids"]
    if not is_flattened(features):
        return ids
    bounds = features["cu_seq_lens_q"].tolist()
    flat = ids.reshape(-1).tolist()
    return [flat[start:end] for start, end in itertools.pairwise(bounds)]


#: names under which transformers models keep a learned table of absolute positions
_ABSOLUTE_POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions")


#: per model, the answer of [`position_shift_invariant`][st_cached_losses.engine.features.position_shift_invariant] (it walks every module: once per model, not
#: once per step); weak keys, so a model is not kept alive by it
_SHIFT_INVARIANT: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def position_shift_invariant(model: nn.Module) -> bool:
    """Whether shifting every token's position by the same amount leaves the embeddings unchanged.

    True for rotary models (attention scores depend on position differences only) without a table of
    absolute positions: there, cutting a left-padded row's leading padding is exact. False whenever
    unsure (BERT-style absolute positions, unknown models): padding is then kept as it came."""
    inner = unwrap_model(model)
    if inner not in _SHIFT_INVARIANT:
        _SHIFT_INVARIANT[inner] = _shift_invariant(inner)
    return _SHIFT_INVARIANT[inner]


def _shift_invariant(model: nn.Module) -> bool:
    """The module walk behind [`position_shift_invariant`][st_cached_losses.engine.features.position_shift_invariant]."""
    rotary = False
    for module in model.modules():
        for name in _ABSOLUTE_POSITION_TABLES:
            if isinstance(getattr(module, name, None), nn.Embedding):
                return False
        config = getattr(module, "config", None)
        if config is not None and any(
            getattr(config, key, None) for key in ("rope_parameters", "rope_theta", "rope_scaling")
        ):
            rotary = True
        if hasattr(module, "rotary_emb"):
            rotary = True
    return rotary
