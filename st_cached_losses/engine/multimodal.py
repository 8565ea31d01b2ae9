"""The images and videos of a multimodal column: which of its inputs are indexed per image, per video or per
patch rather than per row, which rows those entries belong to, and the entries of any set of rows, in any
order. No model is run here; [`slice_features`][st_cached_losses.engine.features.slice_features] calls
[`slice_media`][st_cached_losses.engine.multimodal.slice_media] for the keys [`media_keys`][st_cached_losses.engine.multimodal.media_keys] names and indexes the others per row.

sentence-transformers' processors lay a vision-language model's visual inputs out in three ways:

* flattened patches with a grid (Qwen2-VL, Qwen2.5-VL, ColQwen2): ``pixel_values`` ``(total_patches, p)``,
  every image's patches one after another, and ``image_grid_thw`` ``(n_images, 3)``, whose per-image
  product is that image's patch count; the same for videos (``pixel_values_videos``, ``video_grid_thw``,
  ``second_per_grid_ts`` ``(n_videos,)``). ``num_images_per_sample`` / ``num_videos_per_sample`` ``(B,)``
  (written by sentence-transformers' ``Transformer.preprocess`` for message inputs) say how many belong
  to each row; without them, a grid of exactly one entry per row is one per row;
* gridless, one entry per image (LLaVA, LLaVA-NeXT, Gemma3): ``pixel_values`` ``(n_images, ...)`` with
  ``image_sizes`` / ``image_position_ids`` ``(n_images, ...)`` and ``num_images_per_sample`` ``(B,)``;
* sample-first (Idefics3, Mllama: they pad images per row, and write ``pixel_attention_mask`` or
  ``aspect_ratio_ids``): ``pixel_values`` ``(B, n_images, ...)``, indexed per row like the text. Only
  their token-level tensors ``(B, T, ...)`` may have padding trimmed (`untrimmed_keys`).

A model matches the entries to its rows in order (Qwen2-VL checks each image's patches against the image
tokens of its text and numbers its positions from the grids, row after row), so a mini-batch of rows
``[5, 2]`` gets row 5's images, then row 2's, each image's patches in one piece."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from st_cached_losses.functional.keys import combine_hashes, content_hashes, input_hashes, segment_hashes

__all__ = [
    "MediaAxis",
    "imageless_keys",
    "input_keys",
    "media_axes",
    "media_hashes",
    "media_inputs",
    "media_keys",
    "patches_per_row",
    "slice_media",
    "untrimmed_keys",
]

#: per modality of the grid layout: (grid, flattened patches, entries per row, other per-entry tensors)
_GRIDS = (
    ("image_grid_thw", "pixel_values", "num_images_per_sample", ()),
    ("video_grid_thw", "pixel_values_videos", "num_videos_per_sample", ("second_per_grid_ts",)),
)
#: tensors indexed per image by gridless models (LLaVA, LLaVA-NeXT, Gemma3)
_PER_IMAGE = ("pixel_values", "image_position_ids", "image_sizes")
#: keys of processors that pad images per row (Idefics3, Mllama): their ``pixel_values`` is per row
_SAMPLE_FIRST = ("pixel_attention_mask", "aspect_ratio_ids")
#: visual tensors indexed per row whose second dimension is not the tokens' (never trimmed as padding)
_PER_ROW_VISUAL = ("pixel_values", "pixel_values_videos", "image_sizes", "aspect_ratio_mask", *_SAMPLE_FIRST)
#: what a sample-first processor writes only for a batch with images (Mllama's cross-attention mask too)
_SAMPLE_FIRST_IMAGES = (*_PER_ROW_VISUAL, "cross_attention_mask")
#: the inputs of images, videos and audio that processors write besides the text's
_MEDIA_INPUTS = (
    *_SAMPLE_FIRST_IMAGES,
    "image_grid_thw",
    "video_grid_thw",
    "second_per_grid_ts",
    "image_position_ids",
    "input_features",
    "input_values",
    "feature_attention_mask",
)


@dataclass(frozen=True)
class MediaAxis:
    """One kind of visual entry of a column (images or videos) and how its tensors are indexed.

    Attributes:
        keys: the tensors with one entry per image (or video) on their first dimension.
        per_row: ``(B,)`` int64 on the CPU, the entries of each row (they are stored row after row).
        patch_key: the tensor of flattened patches ``(total_patches, ...)``, None without one.
        patches: ``(n,)`` int64 on the CPU, the patches of each entry (its grid's product); None without a
            ``patch_key``.
    """

    keys: tuple[str, ...]
    per_row: Tensor
    patch_key: str | None = None
    patches: Tensor | None = None


def _long(value: Tensor) -> Tensor:
    return value.detach().to("cpu", torch.long)


def _per_row(features: Mapping[str, Any], count_key: str, entries: int, batch_size: int, what: str) -> Tensor:
    """The entries of each row, from ``count_key``; without it, one per row when there are as many."""
    counts = features.get(count_key)
    if isinstance(counts, Tensor):
        per_row = _long(counts).reshape(-1)
        if per_row.numel() != batch_size or int(per_row.sum()) != entries:
            raise ValueError(
                f"{count_key} ({per_row.tolist()}) does not describe this column's {entries} {what} in "
                f"{batch_size} rows; pass the column as the model's Transformer.preprocess writes it."
            )
        return per_row
    if entries == batch_size:
        return torch.ones(batch_size, dtype=torch.long)
    raise ValueError(
        f"a column has {entries} {what} for {batch_size} rows and no {count_key} to tell which rows they "
        "belong to, so it cannot be cut into mini-batches; tokenize its rows as messages with the model's "
        f"preprocess (what the trainer's collator calls), which writes {count_key}."
    )


def media_axes(features: Mapping[str, Any], batch_size: int) -> list[MediaAxis]:
    """The column's visual entries indexed per image / video / patch (see the module's layouts); empty for a
    column without them (text, or sample-first images, which are indexed per row).

    Raises:
        ValueError: entries that cannot be assigned to rows (no per-row count and not one per row), or
            flattened patches that are not the grid's.
    """
    axes: list[MediaAxis] = []
    claimed: set[str] = set()
    for grid_key, patch_key, count_key, extra in _GRIDS:
        grid = features.get(grid_key)
        if not (isinstance(grid, Tensor) and grid.dim() == 2):
            continue
        what = "images" if grid_key.startswith("image") else "videos"
        per_row = _per_row(features, count_key, grid.shape[0], batch_size, what)
        keys = [grid_key] + [k for k in extra if _leading(features.get(k)) == grid.shape[0]]
        patches = None
        pixels = features.get(patch_key)
        if isinstance(pixels, Tensor):
            patches = _long(grid).prod(1)
            if pixels.shape[0] != int(patches.sum()):
                raise ValueError(
                    f"{patch_key} has {pixels.shape[0]} patches and {grid_key} describes {int(patches.sum())}; "
                    "pass the column as the model's processor writes it."
                )
            claimed.add(patch_key)
        axes.append(MediaAxis(tuple(keys), per_row, patch_key if patches is not None else None, patches))
        claimed.update(keys)
    pixels = features.get("pixel_values")
    if (
        "pixel_values" not in claimed
        and isinstance(pixels, Tensor)
        and pixels.dim() >= 1
        and not any(k in features for k in _SAMPLE_FIRST)
    ):
        counts = features.get("num_images_per_sample")
        per_image = isinstance(counts, Tensor) and int(_long(counts).sum()) == pixels.shape[0]
        if per_image or pixels.shape[0] != batch_size:
            per_row = _per_row(features, "num_images_per_sample", pixels.shape[0], batch_size, "images")
            per_image_keys = tuple(k for k in _PER_IMAGE if _leading(features.get(k)) == pixels.shape[0])
            axes.append(MediaAxis(per_image_keys, per_row))
    return axes


def _leading(value: Any) -> int | None:
    """A tensor's first dimension; None for anything else."""
    return int(value.shape[0]) if isinstance(value, Tensor) and value.dim() >= 1 else None


def media_keys(axes: list[MediaAxis]) -> set[str]:
    """The keys ``axes`` index (per entry or per patch): not indexed per row."""
    keys = {k for axis in axes for k in axis.keys}
    return keys | {axis.patch_key for axis in axes if axis.patch_key is not None}


def untrimmed_keys(features: Mapping[str, Any]) -> set[str]:
    """Visual tensors that may be indexed per row but never trimmed as token padding: their second
    dimension counts images, tiles or channels, whatever the text's width."""
    return {k for k in _PER_ROW_VISUAL if k in features}


def imageless_keys(features: Mapping[str, Any], rows: Tensor, axes: list[MediaAxis]) -> set[str]:
    """Sample-first images (`_SAMPLE_FIRST` keys present) of ``rows`` none of which has an image (by
    ``num_images_per_sample``): the visual keys to leave out, as the processor leaves them out of a batch
    without images (Idefics3 drops all-zero padding images and fails when none is left)."""
    counts = features.get("num_images_per_sample")
    if (
        any(k in features for k in _SAMPLE_FIRST)
        and isinstance(counts, Tensor)
        and "pixel_values" not in media_keys(axes)
        and not bool(_long(counts).reshape(-1)[rows.detach().to("cpu", torch.long)].any())
    ):
        return {k for k in _SAMPLE_FIRST_IMAGES if k in features}
    return set()


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """``(sum(lengths),)`` the indices ``starts[i] .. starts[i] + lengths[i] - 1``, range after range."""
    n = int(lengths.sum())
    ends = lengths.cumsum(0)
    return torch.repeat_interleave(starts - (ends - lengths), lengths) + torch.arange(n)


def _starts(counts: Tensor) -> Tensor:
    """Where each of consecutive blocks of ``counts`` entries starts: the exclusive cumulative sum."""
    return counts.cumsum(0) - counts


def slice_media(features: Mapping[str, Any], rows: Tensor, axes: list[MediaAxis]) -> dict[str, Tensor]:
    """The entries of ``rows`` (``(m,)`` indices, any order) of every key ``axes`` index: row after row in the
    order of ``rows``, each image's patches in one piece. An axis none of ``rows`` has an entry of is left
    out (as sentence-transformers leaves it out): the model then sees no image (or video) at all, as for a
    batch of text."""
    picked = rows.detach().to("cpu", torch.long)
    out: dict[str, Tensor] = {}
    for axis in axes:
        entries = _ranges(_starts(axis.per_row)[picked], axis.per_row[picked])
        if entries.numel() == 0:
            continue
        for key in axis.keys:
            value = features[key]
            out[key] = value.index_select(0, entries.to(value.device))
        if axis.patch_key is not None and axis.patches is not None:
            value = features[axis.patch_key]
            patches = _ranges(_starts(axis.patches)[entries], axis.patches[entries])
            out[axis.patch_key] = value.index_select(0, patches.to(value.device))
    return out


def patches_per_row(axes: list[MediaAxis], batch_size: int) -> Tensor | None:
    """Per row, the patches its images and videos hold in flattened-patch layouts: ``(B,)`` int64, the
    sequence a vision encoder runs over (Qwen2-VL merges four into one text token); None without such an
    axis (gridless images are counted by their tokens in the text only)."""
    total: Tensor | None = None
    for axis in axes:
        if axis.patches is None:
            continue
        row_of = torch.repeat_interleave(torch.arange(batch_size), axis.per_row)
        own = torch.zeros(batch_size, dtype=torch.long).index_add_(0, row_of, axis.patches)
        total = own if total is None else total + own
    return total


def media_inputs(features: Mapping[str, Any]) -> list[str]:
    """The inputs of images, videos or audio a column holds besides its text's (empty for text), in a
    processor's names."""
    return [k for k in _MEDIA_INPUTS if isinstance(features.get(k), Tensor)]


def media_hashes(features: Mapping[str, Any], batch_size: int) -> Tensor | None:
    """Per row, a key of its images and videos, bit for bit (their pixels, patches, grids and sizes): rows with
    equal visual inputs get equal keys, a row without any 0; None for a column without visual inputs.
    ``(B,)`` int64.

    Every layout of the module's docstring: flattened patches (each image's patches, then its grid), one entry
    per image, and sample-first images (a row's first ``num_images_per_sample`` images: the rest is the
    processor's padding, which depends on the other rows)."""
    axes = media_axes(features, batch_size)
    total: Tensor | None = None

    def mix(keys: Tensor) -> None:
        nonlocal total
        total = keys if total is None else combine_hashes(total, keys)

    for axis in axes:
        entries: Tensor | None = None
        parts = [content_hashes(features[k]) for k in axis.keys]
        if axis.patch_key is not None and axis.patches is not None:
            parts.append(segment_hashes(content_hashes(features[axis.patch_key]), axis.patches))
        for part in parts:
            entries = part if entries is None else combine_hashes(entries, part)
        if entries is not None:
            mix(segment_hashes(entries, axis.per_row))
    counts = features.get("num_images_per_sample")
    for key in sorted(untrimmed_keys(features) - media_keys(axes)):
        value = features[key]
        if not isinstance(value, Tensor) or value.dim() < 1 or value.shape[0] != batch_size:
            continue
        if isinstance(counts, Tensor) and value.dim() >= 2 and value.shape[1] >= int(_long(counts).max()):
            # sample-first: (B, max_images, ...), a row's images first, then the batch's padding
            per_row = _long(counts).reshape(-1)
            picked = _ranges(torch.arange(batch_size) * value.shape[1], per_row)
            flat = value.reshape(batch_size * value.shape[1], *value.shape[2:])
            mix(segment_hashes(content_hashes(flat.index_select(0, picked.to(flat.device))), per_row))
        else:
            mix(content_hashes(value))
    return total


def input_keys(features: Mapping[str, Any]) -> Tensor:
    """A 64-bit key per row of a column's inputs (``mask_duplicates``): its token ids' (padding ignored, see
    [`input_hashes`][st_cached_losses.functional.keys.input_hashes]) and, with images or videos, theirs, so
    that two rows are duplicates only when their text *and* their images are. A text column's keys are
    ``input_hashes``'. ``(B,)`` int64."""
    keys = input_hashes(dict(features))
    media = media_hashes(features, len(keys))
    return keys if media is None else keys + media.to(keys.device)
