"""Multimodal columns (:mod:`st_cached_losses.engine.multimodal`): a mini-batch of any rows, in any order, gets
exactly its rows' images and videos.

Real tiny models (:mod:`tests.support.tiny_vlm`), their inputs from sentence-transformers' own
``preprocess``: a Qwen2-VL (flattened patches ``pixel_values`` ``(total_patches, p)`` with
``image_grid_thw`` and ``num_images_per_sample``; videos built by hand as its processor lays them out) and a
LLaVA (gridless: ``pixel_values`` ``(n_images, 3, H, W)``); sample-first pixels (Idefics3, Mllama) with
synthetic tensors. Before this module the engine indexed only tensors whose first dimension is the batch
and passed the others whole: every mini-batch of a Qwen2-VL column got every image's patches with its own
rows' grids and the model raised "Image features and image tokens do not match"; a LLaVA column with as
many images as rows had its images indexed as rows (row i got image i)."""

from __future__ import annotations

import pytest
import torch

from st_cached_losses.engine.features import (
    batch_size_of,
    media_tokens,
    mini_batch_length,
    row_lengths,
    row_weights,
    slice_features,
    token_counts,
)
from st_cached_losses.engine.multimodal import media_axes
from tests.support.tiny_vlm import (
    image_rows,
    make_tiny_idefics3,
    make_tiny_llava,
    make_tiny_qwen2_vl,
    qwen_video_column,
)

B = 6
# rows in the engine's orders: length-sorted, reversed, a single row, rows without any image
ROW_SETS = ([2, 0, 5], [5, 4, 3, 2, 1, 0], [4], [0, 3], [1, 2, 4])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("mm_engine") / "qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("mm_engine") / "llava", seed=0)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return make_tiny_idefics3(tmp_path_factory.mktemp("mm_engine") / "idefics3", seed=0)


def _assert_same_inputs(got: dict, want: dict) -> None:
    """``got`` is ``want`` (a preprocess of the same rows): every key, dtype and value. ``want`` has no
    ``num_images_per_sample`` when none of its rows has an image (sentence-transformers writes it only
    beside ``pixel_values``); ``got`` keeps the zeros."""
    if "pixel_values" not in want:
        assert "pixel_values" not in got and not got["num_images_per_sample"].any()
        got = {k: v for k, v in got.items() if k != "num_images_per_sample"}
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("which", ["qwen2_vl", "llava"])
def test_a_multimodal_column_is_sliced_per_row(request, which):
    """Any rows, in any order: exactly what ``preprocess`` writes for those rows alone (the rows' images,
    row after row, each image's patches in one piece; grids, counts, text trimmed to their longest)."""
    model = request.getfixturevalue("qwen" if which == "qwen2_vl" else "llava")
    rows = image_rows(B, seed=1, images=[0, 1, 2, 0, 2, 1])
    column = model.preprocess(rows)
    assert batch_size_of(column) == B
    if which == "llava":  # as many images as rows: indexing pixel_values per row would look right
        assert column["pixel_values"].shape[0] == B
    for picked in ROW_SETS:
        got = slice_features(column, torch.tensor(picked), B)
        _assert_same_inputs(got, model.preprocess([rows[i] for i in picked]))


def _embed(model, features: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(dict(features))["sentence_embedding"]


def test_idefics3_images_go_with_their_rows(idefics3):
    """Sample-first images (Idefics3: ``pixel_values`` ``(B, 2, 3, 8, 8)``, padded per row with all-zero
    images, as many images in all as rows, where a per-image reading would go wrong): each mini-batch embeds
    its rows as the whole column does."""
    column = idefics3.preprocess(image_rows(B, seed=1, images=[0, 1, 2, 0, 2, 1]))
    assert column["pixel_values"].shape[:2] == (B, 2) and int(column["num_images_per_sample"].sum()) == B
    assert media_axes(column, B) == []
    whole = _embed(idefics3, column)
    for picked in ROW_SETS:
        rows = torch.tensor(picked)
        torch.testing.assert_close(
            _embed(idefics3, slice_features(column, rows, B)), whole[rows], rtol=1e-5, atol=1e-5
        )


def test_qwen_videos_go_with_their_rows(qwen):
    """Videos (``pixel_values_videos``, ``video_grid_thw``, ``num_videos_per_sample``; rows with 0, 1 and 2
    videos of 1 and 2 frames): each mini-batch embeds its rows as the whole column does."""
    column = qwen_video_column(qwen, B, seed=2, videos=[1, 0, 2, 1, 0, 2])
    whole = _embed(qwen, column)
    for picked in ROW_SETS:
        rows = torch.tensor(picked)
        part = slice_features(column, rows, B)
        torch.testing.assert_close(_embed(qwen, part), whole[rows], rtol=1e-5, atol=1e-5)
        has_videos = bool(column["num_videos_per_sample"][rows].any())
        assert ("pixel_values_videos" in part) == ("video_grid_thw" in part) == has_videos
        if has_videos:
            assert part["pixel_values_videos"].shape[0] == int(part["video_grid_thw"].prod(1).sum())


def test_qwen_images_and_videos_together(qwen):
    """A column with images and videos (and Qwen2.5-VL's per-video ``second_per_grid_ts``): both axes go
    with the rows, the per-video seconds with their videos."""
    videos = qwen_video_column(qwen, B, seed=3, videos=[2, 1, 0, 1, 0, 1])
    column = dict(videos)
    column["second_per_grid_ts"] = torch.arange(5, dtype=torch.float32)
    # flattened image patches beside them, one image per row (no num_images_per_sample: one per row)
    column["image_grid_thw"] = torch.tensor(
        [[1, 2, 2], [1, 2, 4], [1, 2, 2], [1, 4, 4], [1, 2, 2], [1, 2, 2]]
    )
    column["pixel_values"] = torch.arange(int(column["image_grid_thw"].prod(1).sum()))[:, None].float()
    axes = media_axes(column, B)
    assert [a.keys for a in axes] == [("image_grid_thw",), ("video_grid_thw", "second_per_grid_ts")]
    part = slice_features(column, torch.tensor([3, 0]), B)
    assert part["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2]]
    assert part["pixel_values"].flatten().tolist() == [*range(16, 32), *range(4)]
    assert part["second_per_grid_ts"].tolist() == [3.0, 0.0, 1.0]
    assert part["num_videos_per_sample"].tolist() == [1, 2]
    assert part["pixel_values_videos"].shape[0] == int(part["video_grid_thw"].prod(1).sum())


def test_patches_count_as_tokens(qwen):
    """A Qwen2-VL row's token count (what ``mini_batch_num_tokens`` budgets) and weight (what ``"auto"``
    probes by) include its vision patches; a gridless column's and a text column's do not change."""
    rows = image_rows(B, seed=1, images=[0, 1, 2, 0, 2, 1])
    column = qwen.preprocess(rows)
    text = column["attention_mask"].sum(1)
    per_row = torch.zeros(B, dtype=torch.long)
    grids = column["image_grid_thw"].prod(1).split(column["num_images_per_sample"].tolist())
    for i, g in enumerate(grids):
        per_row[i] = g.sum()
    assert per_row.tolist()[0] == 0 and per_row.max() > 0
    torch.testing.assert_close(media_tokens(column, B), per_row)
    torch.testing.assert_close(token_counts(column, B), text + per_row)
    torch.testing.assert_close(row_weights(column, B), row_lengths(column, B) + per_row)
    rows_ = torch.tensor([1, 2])
    expect = int(row_lengths(column, B)[rows_].max()) + -(-int(per_row[rows_].sum()) // 2)
    assert mini_batch_length(column, row_lengths(column, B), rows_) == expect
    plain = {k: v for k, v in column.items() if k in ("input_ids", "attention_mask")}
    assert media_tokens(plain, B) is None


def test_sample_first_pixels_are_indexed_per_row_and_never_trimmed():
    """Idefics3 / Mllama pad images per row: ``pixel_values`` ``(B, n_images, 3, H, W)``,
    ``pixel_attention_mask`` ``(B, n_images, H, W)``, ``aspect_ratio_mask`` ``(B, n_images, tiles)``. They go
    with their rows and keep every image even when ``n_images`` equals the text's width (the engine
    trimmed every ``(B, T, ...)`` tensor to the rows' tokens); Mllama's ``cross_attention_mask``
    ``(B, T, n_images, tiles)`` is token-level and is trimmed with the text."""
    width = 3
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    column = {
        "input_ids": torch.arange(9).view(3, width),
        "attention_mask": mask,
        "pixel_values": torch.randn(3, width, 3, 4, 4),
        "pixel_attention_mask": torch.ones(3, width, 4, 4, dtype=torch.bool),
        "aspect_ratio_ids": torch.ones(3, width, dtype=torch.long),
        "aspect_ratio_mask": torch.ones(3, width, 2, dtype=torch.long),
        "cross_attention_mask": torch.ones(3, width, width, 2, dtype=torch.long),
        "num_images_per_sample": torch.tensor([3, 3, 3]),
    }
    assert media_axes(column, 3) == []
    part = slice_features(column, torch.tensor([1, 0]), 3)
    assert part["input_ids"].shape == (2, 2) and part["cross_attention_mask"].shape == (2, 2, width, 2)
    for key in ("pixel_values", "pixel_attention_mask", "aspect_ratio_ids", "aspect_ratio_mask"):
        assert torch.equal(part[key], column[key][[1, 0]]), key


def test_gridless_images_follow_their_counts():
    """Gridless per-image tensors (``pixel_values``, ``image_sizes``, ``image_position_ids``) of rows with 0
    to 3 images, picked in any order; rows none of whose images remain leave the keys out."""
    counts = torch.tensor([2, 0, 3, 1])
    n = int(counts.sum())
    column = {
        "input_ids": torch.ones(4, 5, dtype=torch.long),
        "attention_mask": torch.ones(4, 5, dtype=torch.long),
        "pixel_values": torch.arange(n).view(n, 1, 1, 1).float().expand(n, 3, 2, 2),
        "image_sizes": torch.arange(n).view(n, 1).expand(n, 2),
        "image_position_ids": torch.arange(n).view(n, 1).expand(n, 4),
        "num_images_per_sample": counts,
    }
    part = slice_features(column, torch.tensor([3, 0, 2]), 4)
    assert part["pixel_values"][:, 0, 0, 0].tolist() == [5.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert (
        part["image_sizes"][:, 0].tolist() == part["image_position_ids"][:, 0].tolist() == [5, 0, 1, 2, 3, 4]
    )
    assert part["num_images_per_sample"].tolist() == [1, 2, 3]
    empty = slice_features(column, torch.tensor([1]), 4)
    assert not {"pixel_values", "image_sizes", "image_position_ids"} & set(empty)


def test_one_grid_row_per_row_without_counts():
    """A grid of exactly one entry per row needs no ``num_images_per_sample`` (sentence-transformers' rule)."""
    grid = torch.tensor([[1, 2, 2], [1, 2, 4], [2, 2, 2]])
    column = {
        "input_ids": torch.ones(3, 4, dtype=torch.long),
        "image_grid_thw": grid,
        "pixel_values": torch.arange(int(grid.prod(1).sum())).float()[:, None],
    }
    part = slice_features(column, torch.tensor([2, 0]), 3)
    assert part["image_grid_thw"].tolist() == [[2, 2, 2], [1, 2, 2]]
    assert part["pixel_values"].flatten().tolist() == [*range(12, 20), *range(4)]


def test_images_that_cannot_be_assigned_to_rows_are_refused():
    """Entries the engine cannot assign to rows raise a ValueError naming the fix, instead of reaching the
    model whole (every mini-batch would get every image)."""
    column = {"input_ids": torch.ones(3, 4, dtype=torch.long), "pixel_values": torch.zeros(5, 3, 2, 2)}
    with pytest.raises(ValueError, match="num_images_per_sample"):
        slice_features(column, torch.tensor([0]), 3)
    column = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "image_grid_thw": torch.tensor([[1, 2, 2]] * 3),
        "pixel_values": torch.zeros(12, 1),
        "num_images_per_sample": torch.tensor([1, 1]),
    }
    with pytest.raises(ValueError, match="num_images_per_sample"):
        slice_features(column, torch.tensor([0]), 2)
    column["num_images_per_sample"] = torch.tensor([1, 2])
    column["pixel_values"] = torch.zeros(11, 1)
    with pytest.raises(ValueError, match="patches"):
        slice_features(column, torch.tensor([0]), 2)


def _heavy_images_column() -> dict:
    """Row 0: 30 text tokens, no image; rows 1 to 4: 10 text tokens (4 of them image tokens) and one image
    of 8 x 8 = 64 vision patches: the rows with images are the heaviest, not the longest."""
    mask = torch.zeros(5, 30, dtype=torch.long)
    mask[0] = 1
    mask[1:, :10] = 1
    grid = torch.tensor([[1, 8, 8]] * 4)
    return {
        "input_ids": torch.ones(5, 30, dtype=torch.long),
        "attention_mask": mask,
        "image_grid_thw": grid,
        "pixel_values": torch.zeros(256, 1),
        "num_images_per_sample": torch.tensor([0, 1, 1, 1, 1]),
    }


@pytest.mark.parametrize("by_tokens", [False, True], ids=["rows", "tokens"])
def test_auto_sizes_measure_the_rows_with_the_most_vision_patches(monkeypatch, by_tokens):
    """``"auto"`` probes the heaviest rows (text plus vision patches), and a token budget's bytes per
    token divide by the text and the patches the probes ran on."""
    from torch import nn

    from st_cached_losses.engine import auto_size
    from st_cached_losses.engine.features import mini_batch_length, row_lengths

    seen: list[list[int]] = []
    column = _heavy_images_column()
    lengths = row_lengths(column, 5)

    def probe(model, features, rows, trim_leading, encode, device) -> float:
        seen.append(rows.tolist())
        if by_tokens:  # 100 bytes per padded token, text and patches
            return 100.0 * len(rows) * mini_batch_length(features, lengths, rows)
        return 7400.0 * len(rows)

    monkeypatch.setattr(auto_size, "_probe", probe)
    size = auto_size.pick_mini_batch(
        nn.Linear(1, 1), [column], True, 74_000, by_tokens=by_tokens, encode=lambda m, f: torch.zeros(1)
    )
    assert sorted(seen[0]) == [1, 2, 3, 4]  # not row 0, the longest text
    # rows: 74,000 / 7,400 per row; tokens: 74,000 / 100 per token of text or patches
    assert size == (740 if by_tokens else 10)


def test_an_auto_token_budget_packs_vision_patches():
    """An ``"auto"`` token budget (a budget of memory) packs rows by their padded tokens plus their vision
    patches: 3 rows of 10 tokens and 64 patches do not fit in 100, each is a mini-batch of its own."""
    from st_cached_losses.engine.gradcache import GradCache

    column = _heavy_images_column()
    cache = GradCache(mini_batch_num_tokens="auto", mini_batch_memory_budget=1)
    cache.auto.size = 100
    plan = cache.plan(0, column)
    assert [mb.rows.tolist() for mb in plan] == [[0], [1], [2], [3], [4]]
    cache.auto.size = 150
    # longest first: row 0 (30 wide) with one image row (2 x 30 + 64), then two image rows (2 x 10 + 128)
    assert [mb.rows.tolist() for mb in cache.plan(0, column)] == [[0, 1], [2, 3], [4]]
    assert not cache.fits_in_one([column])


def test_a_flattened_column_keeps_its_rows_images():
    """Padding-free text (``cu_seq_lens_q``) beside flattened image patches: the rows' tokens and their
    images, both row after row in the order picked."""
    lengths = torch.tensor([3, 2, 4])
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    grid = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 2, 2]])
    column = {
        "input_ids": torch.arange(9)[None],
        "position_ids": torch.cat([torch.arange(int(n)) for n in lengths])[None],
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": 4,
        "max_length_k": 4,
        "image_grid_thw": grid,
        "pixel_values": torch.arange(int(grid.prod(1).sum())).float()[:, None],
        "num_images_per_sample": torch.tensor([2, 0, 1]),
    }
    part = slice_features(column, torch.tensor([2, 0]), 3)
    assert part["input_ids"].tolist() == [[5, 6, 7, 8, 0, 1, 2]]
    assert part["cu_seq_lens_q"].tolist() == [0, 4, 7]
    assert part["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2], [1, 2, 4]]
    assert part["pixel_values"].flatten().tolist() == [*range(12, 16), *range(12)]
    assert part["num_images_per_sample"].tolist() == [1, 2]
    assert token_counts(column, 3).tolist() == [3 + 12, 2, 4 + 4]


# --------------------------------------------------------------------------- duplicate keys (mask_duplicates)


def _captioned(images: list, text: str = "w1 w2 w3") -> list:
    """A message row: ``images`` then one caption."""
    content = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


@pytest.mark.parametrize("which", ["qwen", "llava", "idefics3"])
def test_duplicate_keys_are_equal_text_and_equal_images(request, which):
    """Issue 50: ``mask_duplicates`` compared token ids only, so two rows of one caption and different images
    (of one size: the same image tokens) were duplicates. Now a row's key covers its images, bit for bit, in
    each layout (flattened patches with grids, one entry per image, sample-first): equal text and equal images
    give equal keys, another image (or one image fewer, or another caption) another key; in a column with no
    image the keys are the text's."""
    import random

    from st_cached_losses.engine.multimodal import input_keys, media_hashes
    from st_cached_losses.functional.keys import input_hashes
    from tests.support.tiny_vlm import random_image

    model = request.getfixturevalue(which)
    rng = random.Random(3)
    a, b, c = (random_image(rng, 16) for _ in range(3))
    rows = [
        _captioned([a]),  # 0
        _captioned([b]),  # 1: row 0's caption, another image
        _captioned([a]),  # 2: row 0 again
        _captioned([a, c]),  # 3: two images
        _captioned([a, c]),  # 4: row 3 again
        _captioned([c, a]),  # 5: row 3's images in the other order
        _captioned([a], "w4 w5"),  # 6: another caption
        _captioned([]),  # 7: no image
    ]
    features = model.preprocess(rows)
    text = input_hashes(features)
    keys = input_keys(features)
    assert text[0] == text[1], "the issue's case: one caption, images of one size, the same token ids"
    assert keys[0] == keys[2] and keys[3] == keys[4]
    assert len({int(keys[i]) for i in (0, 1, 3, 5, 6, 7)}) == 6
    assert keys[7] == text[7], "a row without an image keeps its text's key"
    # the same rows in another batch (other padding, other rows' images around them): the same keys
    again = model.preprocess([rows[7], rows[4], rows[2], rows[1]])
    assert input_keys(again).tolist() == [int(keys[i]) for i in (7, 4, 2, 1)]
    text_only = model.preprocess([_captioned([]), _captioned([], "w4 w5")])
    assert media_hashes(text_only, 2) is None and torch.equal(input_keys(text_only), input_hashes(text_only))
