"""The cached losses on vision-language models, against sentence-transformers' non-cached losses (the oracle):
the same loss and parameter gradients.

Real tiny models built offline (:mod:`tests.support.tiny_vlm`), inputs from sentence-transformers' own
``preprocess`` (message rows with 0, 1 and 2 images): a Qwen2-VL (flattened patches with their grids, as
Qwen2.5-VL and ColQwen2 take them; it checks every image's patches against the image tokens of its text)
a LLaVA (gridless, one ``pixel_values`` entry per image) and an Idefics3 (sample-first, images padded per
row); Qwen2-VL videos built by hand as its processor
lays them out. Mini-batches that split a column's images, length sorting on and off, token budgets (which
count vision patches), ``"auto"`` sizes, graphs kept within a budget, 2 gloo processes, and the multi-vector
loss on a ColQwen-style model (Qwen2-VL + token projection). Before the engine sliced images per row every
cached run here on Qwen2-VL raised "Image features and image tokens do not match", and on LLaVA (as many
images as rows) the cached loss silently embedded row i with image i."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sentence_transformer import losses as st_losses

from st_cached_losses import CachedMNRLoss, CachedMultiVectorLoss
from tests.losses.test_losses import assert_grads_close, flat_grads, param_grads
from tests.support.tiny_vlm import (
    image_rows,
    load_tiny_qwen2_vl,
    make_tiny_idefics3,
    make_tiny_llava,
    make_tiny_qwen2_vl,
    qwen_video_column,
)

B = 8
IMAGES = ([0, 1, 2, 0, 2, 1, 1, 1], [1, 0, 1, 2, 0, 1, 2, 1], [2, 1, 0, 0, 1, 1, 0, 2])


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mm_losses") / "qwen2_vl"
    make_tiny_qwen2_vl(path, seed=1)
    return str(path)


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return load_tiny_qwen2_vl(qwen_dir)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("mm_losses") / "llava", seed=1)


def image_columns(model, n_cols: int, seed: int = 0, rows: slice = slice(None)) -> list[dict]:
    """``n_cols`` columns of ``B`` message rows with 0 to 2 images each (``rows`` of them)."""
    return [
        model.preprocess(image_rows(B, seed=seed + 17 * k, images=IMAGES[k])[rows]) for k in range(n_cols)
    ]


def st_mnrl(model):
    loss = st_losses.MultipleNegativesRankingLoss(model)
    return lambda f: loss(f, None)


def ours(model, **options):
    loss = CachedMNRLoss(model, **options)
    return loss, lambda f: loss(f, None)


def _spy_plans(loss) -> list:
    """Record the mini-batches the loss's engine cuts (every column, every call)."""
    plans: list = []
    plan = loss.cache.plan

    def recording(*args, **kwargs):
        out = plan(*args, **kwargs)
        plans.append(out)
        return out

    object.__setattr__(loss.cache, "plan", recording)  # a spy under the frozen engine's configuration
    return plans


def _assert_images_split(plans: list, features: list[dict]) -> None:
    """Guard against a vacuous pass: some mini-batch holds some, not all, of its column's images."""
    split = False
    for plan in plans:
        column = features[plan[0].column]
        counts = column.get("num_images_per_sample", column.get("num_videos_per_sample"))
        for mb in plan:
            mine = int(counts[mb.rows].sum())
            split |= 0 < mine < int(counts.sum())
    assert split, "no mini-batch split a column's images"


OPTIONS = [
    {"mini_batch_size": 3},
    {"mini_batch_size": 3, "sort_by_length": False},
    {"mini_batch_num_tokens": 70},
    {"mini_batch_size": 2, "graph_memory_budget": 2_000_000},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["mb3", "mb3-unsorted", "tokens70", "graph-budget"])
def test_qwen2_vl_images_equal_st_mnrl(qwen, options):
    """Anchors, positives and hard negatives with 0 to 2 images per row (of 2 x 2 and 4 x 4 patch grids)."""
    features = image_columns(qwen, 3)
    ref_loss, ref = param_grads(qwen, st_mnrl(qwen), features)
    loss_fn, fn = ours(qwen, **options)
    plans = _spy_plans(loss_fn)
    loss, grads = param_grads(qwen, fn, features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref)
    _assert_images_split(plans, features)


def test_mask_duplicates_sees_the_images(qwen):
    """Issue 50: two positives of one caption and different images are no duplicates (they were: the keys were
    the token ids), so with ``mask_duplicates`` and no other duplicate the loss is sentence-transformers'
    unmasked one; the same caption with the same image is, and is masked."""
    import random

    from tests.support.tiny_vlm import random_image

    rng = random.Random(5)
    pictures = [random_image(rng, 16) for _ in range(5)]

    def row(image, text):
        return [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}
        ]

    anchors = qwen.preprocess([f"w{i} w{i + 9}" for i in range(5)])
    positives = [row(pictures[0], "w1 w2"), row(pictures[1], "w1 w2")]
    positives += [row(pictures[i], f"w{i} w3") for i in range(2, 5)]
    features = [anchors, qwen.preprocess(positives)]
    ref_loss, ref = param_grads(qwen, st_mnrl(qwen), features)
    loss, grads = param_grads(qwen, ours(qwen, mask_duplicates=True, mini_batch_size=2)[1], features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref)
    # row 2's positive made row 0's (caption and image): a duplicate, masked, so another loss than theirs
    positives[2] = positives[0]
    features = [anchors, qwen.preprocess(positives)]
    _, fn = ours(qwen, mask_duplicates=True, mini_batch_size=2)
    with torch.no_grad():
        assert float(fn(features)) < float(st_mnrl(qwen)(features)) - 1e-3


def test_gist_guide_of_the_models_processor_sees_images_another_is_refused(qwen, qwen_dir, tmp_path):
    """Issue 50: a guide of another tokenizer reads the columns re-tokenised from their decoded text, which
    drops the images (silently, as sentence-transformers' GISTEmbedLoss does): refused, naming the fix. A guide
    with the model's processor reads the very inputs, images included: GISTEmbedLoss's loss and gradients."""
    from sentence_transformers.sentence_transformer.losses import GISTEmbedLoss

    from st_cached_losses import CachedGISTLoss
    from tests.support.tiny_model import make_tiny_model

    features = image_columns(qwen, 2)
    other = CachedGISTLoss(qwen, make_tiny_model(tmp_path / "bert"), mini_batch_size=3)
    assert other.must_retokenize
    with pytest.raises(
        ValueError, match=r"re-tokenised from the decoded text, which holds no images.*guide=None"
    ):
        other(features, None)
    guide = load_tiny_qwen2_vl(qwen_dir)
    ref_loss, ref = param_grads(qwen, lambda f: GISTEmbedLoss(qwen, guide, 0.05)(f, None), features)
    same = CachedGISTLoss(qwen, guide, 0.05, mini_batch_size=3)
    assert not same.must_retokenize
    loss, grads = param_grads(qwen, lambda f: same(f, None), features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref)


@pytest.mark.parametrize(
    "options", [{"mini_batch_size": 3}, {"mini_batch_num_tokens": 48}], ids=["mb3", "tok48"]
)
def test_a_multimodal_reranker_equals_st_and_its_budget_counts_the_patches(qwen_dir, options):
    """Issue 50: a Qwen2-VL reranker (``CrossEncoder`` of its causal LM and ``LogitScore``) ranking documents with
    and without images: the loss and gradients of sentence-transformers' cross-encoder
    ``MultipleNegativesRankingLoss``; a token budget counts each pair's vision patches besides its tokens, as
    for an embedding column (it counted the tokens only, so a mini-batch ran over the budget)."""
    import random

    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    from st_cached_losses import CachedCrossEncoderLoss
    from st_cached_losses.engine.multimodal import media_axes, patches_per_row
    from tests.support.tiny_vlm import load_tiny_qwen2_vl_reranker, random_image

    reranker = load_tiny_qwen2_vl_reranker(qwen_dir)
    rng = random.Random(0)
    n = 5
    queries = [f"w{i} w{i + 3}" for i in range(n)]
    documents = [
        {"image": random_image(rng, rng.choice([8, 16])), "text": f"w{i + 20}"}
        if i % 2 == 0
        else f"w{i + 30} w7"
        for i in range(n)
    ]
    negatives = [{"image": random_image(rng, 16)} if i % 3 == 0 else f"w{i + 40}" for i in range(n)]
    inputs = [queries, documents, negatives]
    torch.manual_seed(0)
    ref_loss, ref = param_grads(
        reranker, lambda x: MultipleNegativesRankingLoss(reranker, 3)(x, None), inputs
    )
    loss_fn = CachedCrossEncoderLoss(reranker, 3, **options)
    plans = _spy_plans(loss_fn)
    torch.manual_seed(0)
    loss, grads = param_grads(reranker, lambda x: loss_fn(x, None), inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref)
    if "mini_batch_num_tokens" in options:
        torch.manual_seed(0)
        pairs = loss_fn.pairs(inputs)
        assert len(loss_fn.columns(pairs, n, None, None)) == 1  # rows of the plans are the pairs
        every = reranker.preprocess(pairs)
        patches = patches_per_row(media_axes(every, len(pairs)), len(pairs))
        assert patches is not None and int(patches.max()) > 0
        cost = every["attention_mask"].sum(1) + patches
        packed = [mb.rows for plan in plans for mb in plan if len(mb.rows) > 1]
        assert packed, "no mini-batch of several pairs: the budget is not tested"
        assert max(int(cost[rows].sum()) for rows in packed) <= options["mini_batch_num_tokens"]


@pytest.mark.parametrize(
    "options", [{"mini_batch_size": 3}, {"mini_batch_num_tokens": 90}], ids=["mb3", "tok"]
)
def test_qwen2_vl_videos_equal_st_mnrl(qwen, options):
    """Columns of videos (0 to 2 per row, 1 and 2 frames) beside a column of images."""
    features = [
        qwen_video_column(qwen, B, seed=5, videos=[1, 0, 2, 1, 0, 2, 1, 1]),
        image_columns(qwen, 1, seed=9)[0],
        qwen_video_column(qwen, B, seed=6, videos=[0, 2, 1, 1, 2, 0, 0, 1]),
    ]
    ref_loss, ref = param_grads(qwen, st_mnrl(qwen), features)
    loss_fn, fn = ours(qwen, **options)
    plans = _spy_plans(loss_fn)
    loss, grads = param_grads(qwen, fn, features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref)
    _assert_images_split(plans, features)


@pytest.mark.parametrize("setting", ["mini_batch_size", "mini_batch_num_tokens"])
def test_qwen2_vl_auto_sizes_equal_st_mnrl(qwen, setting):
    """``"auto"`` sizes measured on the batch's heaviest rows (text and vision patches): several
    mini-batches within the budget, the same loss and gradients."""
    features = image_columns(qwen, 2, seed=3)
    ref_loss, ref = param_grads(qwen, st_mnrl(qwen), features)
    loss_fn, fn = ours(qwen, mini_batch_memory_budget=150_000, **{setting: "auto"})
    plans = _spy_plans(loss_fn)
    loss, grads = param_grads(qwen, fn, features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref)
    assert loss_fn.cache.auto_size is not None
    _assert_images_split(plans, features)


@pytest.mark.parametrize(
    "options", [{"mini_batch_size": 3}, {"mini_batch_num_tokens": 40}], ids=["mb3", "tok"]
)
def test_llava_equals_st_mnrl(llava, options):
    """Gridless images (``pixel_values`` ``(n_images, 3, 8, 8)``; the first column has as many images as
    rows, where indexing them per row would pass silently)."""
    features = image_columns(llava, 3, seed=11)
    assert features[0]["pixel_values"].shape[0] == B
    ref_loss, ref = param_grads(llava, st_mnrl(llava), features)
    loss_fn, fn = ours(llava, **options)
    plans = _spy_plans(loss_fn)
    loss, grads = param_grads(llava, fn, features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref)
    _assert_images_split(plans, features)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return make_tiny_idefics3(tmp_path_factory.mktemp("mm_losses") / "idefics3", seed=1)


def test_idefics3_equals_st_mnrl(idefics3):
    """Sample-first images (``pixel_values`` ``(B, max_images, 3, 8, 8)`` with ``pixel_attention_mask``)."""
    features = image_columns(idefics3, 2, seed=13)
    ref_loss, ref = param_grads(idefics3, st_mnrl(idefics3), features)
    loss_fn, fn = ours(idefics3, mini_batch_size=3)
    plans = _spy_plans(loss_fn)
    loss, grads = param_grads(idefics3, fn, features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref)
    _assert_images_split(plans, features)


def test_colqwen_style_multi_vector_equals_st(qwen_dir):
    """CachedMultiVectorLoss on a ColQwen-style model (the Qwen2-VL with a token projection, a
    MultiVectorEncoder): text queries, image documents, against MultiVectorMultipleNegativesRankingLoss."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    load_tiny_qwen2_vl(qwen_dir)  # registers the processor
    torch.manual_seed(4)
    model = MultiVectorEncoder(qwen_dir, device="cpu")
    tasks = ("query", "document", "document")
    features = [
        {**model.preprocess(image_rows(B, seed=41 + k, images=IMAGES[k]), task=task), "task": task}
        for k, task in enumerate(tasks)
    ]
    ref_loss, ref = param_grads(model, MultiVectorMultipleNegativesRankingLoss(model), features)
    for options in ({"mini_batch_size": 3}, {"mini_batch_num_tokens": 60}):
        loss_fn = CachedMultiVectorLoss(model, **options)
        plans = _spy_plans(loss_fn)
        loss, grads = param_grads(model, loss_fn, features)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_close(grads, ref)
        _assert_images_split(plans, features)


SIZES = [3, 5]


def _ddp_worker(rank: int, world: int, path: str, options: dict) -> dict:
    """One DDP step of CachedMNRLoss gathered across processes, on this process's rows."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert torch.distributed.get_world_size() == world
    model = load_tiny_qwen2_vl(path)
    start = sum(SIZES[:rank])
    features = image_columns(model, 2, seed=7, rows=slice(start, start + SIZES[rank]))
    loss_fn = CachedMNRLoss(model, gather_across_devices=True, **options)
    # what sentence-transformers' trainer does with a wrapped model: find_unused_parameters is its default
    # for a SentenceTransformer, and a VLM needs it under DDP (a batch without images leaves the vision
    # tower unused)
    loss_fn.model = DDP(model, find_unused_parameters=True)
    loss = loss_fn(features, None)
    loss.backward()
    return {"loss": float(loss), "grads": flat_grads(model)}


@pytest.mark.parametrize(
    "options", [{"mini_batch_size": 2}, {"mini_batch_num_tokens": 50}], ids=["mb2", "tok"]
)
def test_qwen2_vl_across_two_processes_equals_the_global_batch(qwen_dir, options):
    """2 gloo processes with 3 and 5 rows, gathered: every process's parameter gradients are those of
    sentence-transformers' MNRL on the global batch."""
    from tests.support.dist_utils import run_distributed

    per_rank = run_distributed(_ddp_worker, 2, qwen_dir, options)
    model = load_tiny_qwen2_vl(qwen_dir)
    ref_loss, ref = param_grads(model, st_mnrl(model), image_columns(model, 2, seed=7))
    assert sum(r["loss"] for r in per_rank) / 2 == pytest.approx(float(ref_loss), rel=1e-5)
    for r in per_rank:
        assert_grads_close(r["grads"], ref)
