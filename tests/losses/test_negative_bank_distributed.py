"""The losses' negative bank (``negative_bank_size``) across 2 and 3 gloo processes (spawned from pytest),
with ``gather_across_devices=True``: gathered (``CachedMNRLoss``, ``CachedCLIPLoss``) and around the ring
(``CachedTiledLoss``). Four training steps under DDP with an optimizer step between them, equal and unequal
per-process batches: each step's loss and DDP-averaged parameter gradients equal a one-process dense
oracle that scores the step's global batch plus, as extra negatives, what every process's share of the
bank should hold (each process's newest ``size`` rows of its own part of the earlier global batches, as
the model of their step embedded them; symmetric: the anchors too; ``max_age`` expiry). After the third
step each process saves its share (``LossStateCallback.bank_state_dict``, one file per process); the
saved share equals the oracle's, and the fourth step runs on a fresh loss that restored it (or, for a
process whose file is missing, on an empty share while the others restore theirs). Without
``gather_across_devices`` each process scores its own rows against its own share only; inside
``MatryoshkaLoss`` each width has its own shares."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.dist_utils import run_distributed
from tests.support.reference import reference_infonce
from tests.support.tiny_model import load_for_ddp, make_tiny_model, random_texts

#: name -> (class name, kwargs, text columns, symmetric); the bank's size is per process, in rows of each
#: kind: sizes that cut a step's rows in the middle (a row's positive kept, its hard negative dropped)
CONFIGS = {
    "mnr_hard_neg": ("CachedMNRLoss", {"negative_bank_size": 7}, 3, False),
    "clip": ("CachedCLIPLoss", {"negative_bank_size": 5}, 2, True),
    "tiled_ring_sym": (
        "CachedTiledLoss",
        {"symmetric": True, "tile_size": 3, "negative_bank_size": 5},
        2,
        True,
    ),
    "tiled_ring_hard_neg": ("CachedTiledLoss", {"tile_size": 2, "negative_bank_size": 9}, 3, False),
    # max age: the size alone would keep every earlier step
    "mnr_age_1": ("CachedMNRLoss", {"negative_bank_size": 100, "negative_bank_max_age": 1}, 2, False),
    "clip_age_2": ("CachedCLIPLoss", {"negative_bank_size": 100, "negative_bank_max_age": 2}, 2, True),
    # without gather_across_devices each process scores its own rows against its own share only
    "clip_local": ("CachedCLIPLoss", {"negative_bank_size": 4, "gather_across_devices": False}, 2, True),
    # inside MatryoshkaLoss: a bank per width, aged together
    "clip_matryoshka": ("CachedCLIPLoss", {"negative_bank_size": 5, "matryoshka_dims": (32, 16)}, 2, True),
}
STEPS = 4  # the last one on a fresh loss that restored the bank saved after the third
LR = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("bank_dist_model")
    model = make_tiny_model(base / "bert", dropout=0.0)
    model.save(str(base / "st"))
    return str(base / "st")


load_model = load_for_ddp


def global_texts(n_rows: int, n_cols: int, step: int) -> list[list[str]]:
    return [random_texts(n_rows, seed=100 * step + 31 * k) for k in range(n_cols)]


def make_loss(name: str, model, wrapped):
    """The configured loss (inside ``MatryoshkaLoss`` with ``matryoshka_dims``), scoring with ``wrapped``
    (the DDP model, as sentence-transformers' trainer sets it)."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    import st_cached_losses

    cls_name, kwargs, _, _ = CONFIGS[name]
    kwargs = {"gather_across_devices": True, **kwargs}
    dims = kwargs.pop("matryoshka_dims", None)
    loss = getattr(st_cached_losses, cls_name)(model, mini_batch_size=2, **kwargs)
    outer = MatryoshkaLoss(model, loss, matryoshka_dims=list(dims)) if dims else loss
    loss.model = wrapped
    return outer, loss


def flat_grads(model) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )


def _worker(
    rank: int, world: int, path: str, names: list[str], sizes: list[int], folder: str, lost: list[int]
) -> dict:
    """``lost``: the processes whose bank file the checkpoint lacks (they resume with an empty share)."""
    from st_cached_losses import LossStateCallback
    from st_cached_losses.losses.callbacks import BANK_FILE

    assert torch.distributed.get_world_size() == world
    start = sum(sizes[:rank])
    results = {}
    for name in names:
        model = load_model(path)
        ddp = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        loss, banked = make_loss(name, model, ddp)
        per_step, saved = [], None
        for step in range(STEPS):
            if step == STEPS - 1:  # a checkpoint: this process's share saved, restored by a fresh loss
                file = Path(folder) / name / BANK_FILE.format(rank)
                file.parent.mkdir(parents=True, exist_ok=True)
                torch.save(LossStateCallback(loss).bank_state_dict(), file)
                saved = torch.load(file, weights_only=True)
                loss, banked = make_loss(name, model, ddp)
                restored = torch.load(file, weights_only=True) if rank not in lost else {}
                LossStateCallback(loss).load_bank_state_dict(restored)
            texts = global_texts(sum(sizes), CONFIGS[name][2], step)
            feats = [model.preprocess(t[start : start + sizes[rank]]) for t in texts]
            params = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
            optimizer.zero_grad(set_to_none=True)
            value = loss(feats, None)
            value.backward()
            per_step.append({"loss": value.item(), "grads": flat_grads(model), "params": params})
            optimizer.step()
        results[name] = {"steps": per_step, "saved": saved, "after": banked.negative_bank.get_extra_state()}
    return results


class _OracleBank:
    """What one process's share of the bank should hold: its newest ``size`` rows of each kind, with the
    step that added them, dropped past ``max_age``; kept independently of the package's bank."""

    def __init__(self, size: int, max_age: int | None) -> None:
        self.size, self.max_age = size, max_age
        self.rows: dict[str, torch.Tensor] = {}
        self.added: dict[str, torch.Tensor] = {}

    def expire(self, step: int) -> None:
        if self.max_age is not None:
            for kind in self.rows:
                keep = step - self.added[kind] <= self.max_age
                self.rows[kind], self.added[kind] = self.rows[kind][keep], self.added[kind][keep]

    def add(self, kind: str, rows: torch.Tensor, step: int) -> None:
        rows, added = rows.detach(), torch.full((rows.shape[0],), step, dtype=torch.long)
        self.rows[kind] = torch.cat([self.rows.get(kind, rows[:0]), rows])[-self.size :]
        self.added[kind] = torch.cat([self.added.get(kind, added[:0]), added])[-self.size :]


def _rows(sizes: list[int]) -> list[slice]:
    """Each process's rows of the global batch."""
    return [slice(sum(sizes[:rank]), sum(sizes[: rank + 1])) for rank in range(len(sizes))]


def _bank_columns(banks: list[_OracleBank], embs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``reference_infonce``'s extra negatives: the given shares, concatenated (none before a first
    step), at the embeddings' width (MatryoshkaLoss's truncation of the stored rows; it also normalises
    them, moot under cosine similarity)."""
    if not any(b.rows for b in banks):
        return {}
    d = embs[0].shape[1]
    columns = {"bank_candidates": torch.cat([b.rows.get("candidates", embs[1][:0])[:, :d] for b in banks])}
    if any("anchors" in b.rows for b in banks):
        columns["bank_anchors"] = torch.cat([b.rows.get("anchors", embs[0][:0])[:, :d] for b in banks])
    return columns


def _oracle_loss(
    embs: list[torch.Tensor],
    banks: list[_OracleBank],
    sizes: list[int],
    symmetric: bool,
    gather: bool,
    dims: tuple[int, ...] = (),
) -> torch.Tensor:
    """The dense loss of the global batch with the shares of ``banks`` as extra negatives; without
    ``gather``, DDP's mean of the processes' losses, each of its own rows against its own share; with
    ``dims``, MatryoshkaLoss's sum over the truncations (each scored against its own width's bank)."""
    if dims:
        return sum(
            (_oracle_loss([e[:, :d] for e in embs], banks, sizes, symmetric, gather) for d in dims),
            torch.zeros(()),
        )
    if gather:
        return reference_infonce(embs[0], embs[1:], symmetric=symmetric, **_bank_columns(banks, embs))
    per_process = [
        reference_infonce(
            embs[0][rows], [e[rows] for e in embs[1:]], symmetric=symmetric, **_bank_columns([b], embs)
        )
        for b, rows in zip(banks, _rows(sizes))
    ]
    return torch.stack(per_process).mean()


def _oracle(model, name: str, sizes: list[int], params: list[torch.Tensor], lost: list[int]) -> dict:
    """One process, the global batch of every step, the dense loss with every process's oracle share of
    the bank concatenated as extra negatives, at the parameters the processes had at that step
    (``params``: the optimizer steps are theirs, so that one step's rounding does not grow through the
    next ones' updates; the bank's rows are the oracle's own embeddings, by the model of their step)."""
    _, kwargs, n_cols, symmetric = CONFIGS[name]
    banks = [_OracleBank(kwargs["negative_bank_size"], kwargs.get("negative_bank_max_age")) for _ in sizes]
    steps, saved, first = [], None, None
    for step in range(STEPS):
        clock = step + 1  # the bank's clock: training steps begun
        if step == STEPS - 1:  # saved after the last step, before the next one begins
            saved = [{k: (b.rows[k].clone(), b.added[k].clone()) for k in b.rows} for b in banks]
            for rank in lost:
                banks[rank] = _OracleBank(banks[rank].size, banks[rank].max_age)
        for bank in banks:
            bank.expire(clock)
        torch.nn.utils.vector_to_parameters(params[step], model.parameters())
        texts = global_texts(sum(sizes), n_cols, step)
        embs = [model(dict(model.preprocess(t)))["sentence_embedding"] for t in texts]
        model.zero_grad(set_to_none=True)
        gather, dims = kwargs.get("gather_across_devices", True), kwargs.get("matryoshka_dims", ())
        value = _oracle_loss(embs, banks, sizes, symmetric, gather, dims)
        value.backward()
        empty = [_OracleBank(1, None) for _ in sizes]
        without = _oracle_loss([e.detach() for e in embs], empty, sizes, symmetric, gather, dims)
        steps.append({"loss": value.item(), "grads": flat_grads(model), "without": without.item()})
        for bank, rows in zip(banks, _rows(sizes)):  # each process's rows: positive, then hard negatives
            bank.add("candidates", torch.stack([e[rows] for e in embs[1:]], dim=1).flatten(0, 1), clock)
            if symmetric:
                bank.add("anchors", embs[0][rows], clock)
        if step == 0:
            first = embs[1].detach()
    # not vacuous: the model moved, so a bank re-embedded by the current model would differ from the
    # stored one by far more than the tolerance
    with torch.no_grad():
        now = model(dict(model.preprocess(global_texts(sum(sizes), n_cols, 0)[1])))["sentence_embedding"]
    assert (now - first).abs().max() > 1e-3 * first.abs().max(), name
    return {"steps": steps, "saved": saved, "after": banks}


@contextmanager
def _one_thread() -> Iterator[None]:
    """The oracle's matrices are tiny: on a busy machine, torch's idle threads waiting for work cost ~50x
    its arithmetic (as the spawned processes do, one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check(model_dir: str, sizes: list[int], per_rank: list[dict], lost: list[int]) -> None:
    with _one_thread():
        _check_one_thread(model_dir, sizes, per_rank, lost)


def _check_one_thread(model_dir: str, sizes: list[int], per_rank: list[dict], lost: list[int]) -> None:
    model = load_model(model_dir)
    for name in per_rank[0]:
        symmetric = CONFIGS[name][3]
        params = [per_rank[0][name]["steps"][step]["params"] for step in range(STEPS)]
        for p in per_rank[1:]:  # DDP keeps the processes' models equal
            assert all(torch.equal(x["params"], y) for x, y in zip(p[name]["steps"], params)), name
        ref = _oracle(model, name, sizes, params, lost)
        for step, r in enumerate(ref["steps"]):
            where = f"{name} sizes {sizes} step {step}"
            assert r["grads"].abs().max() > 0
            if step:  # not vacuous: the bank changes the loss
                assert abs(r["loss"] - r["without"]) > 1e-3, where
            losses = [p[name]["steps"][step]["loss"] for p in per_rank]
            assert sum(losses) / len(losses) == pytest.approx(r["loss"], rel=1e-5), where
            tol = 1e-5 * r["grads"].abs().max().item()
            for rank, p in enumerate(per_rank):
                err = (p[name]["steps"][step]["grads"] - r["grads"]).abs().max().item()
                assert err <= tol, f"{where} rank {rank}: max grad error {err:.2e} > {tol:.2e}"
        max_age = CONFIGS[name][1].get("negative_bank_max_age")
        if max_age is not None:  # not vacuous: the oracle dropped the older steps' rows
            kept = [int(b.added["candidates"].min()) for r, b in enumerate(ref["after"]) if r not in lost]
            assert kept and set(kept) == {STEPS - max_age}, name
        # every process saved its own share, and holds its own share after the last step (the entries'
        # ages: a process that resumed without its share restarted its clock)
        kinds = ["candidates", "anchors"] if symmetric else ["candidates"]
        widths = CONFIGS[name][1].get("matryoshka_dims", [model.get_embedding_dimension()])
        keys = sorted(f"{kind}/{width}" for kind in kinds for width in widths)
        for rank, p in enumerate(per_rank):
            (saved,) = p[name]["saved"].values()  # one bank in use
            after = {k: (ref["after"][rank].rows[k], ref["after"][rank].added[k]) for k in kinds}
            for when, state, expected, clock in [
                ("saved", saved, ref["saved"][rank], STEPS - 1),
                ("after", p[name]["after"], after, STEPS),
            ]:
                if not (rank in lost and when == "after"):
                    assert state["step"] == clock, f"{name} rank {rank} {when}"
                assert sorted(state["entries"]) == keys, name
                for key, entry in state["entries"].items():
                    kind, width = key.split("/")
                    rows, added = expected[kind]
                    if "matryoshka_dims" in CONFIGS[name][1]:  # MatryoshkaLoss's truncated, normalised rows
                        rows = torch.nn.functional.normalize(rows[:, : int(width)], dim=-1)
                    where = f"{name} rank {rank} {when} {key}"
                    assert torch.equal(state["step"] - entry["added"], clock - added), where
                    torch.testing.assert_close(entry["rows"], rows, rtol=1e-5, atol=1e-6, msg=where)


@pytest.mark.parametrize(
    "sizes", [[3, 3], [2, 4], [3, 3, 3], [2, 3, 4]], ids=["2-equal", "2-unequal", "3-equal", "3-unequal"]
)
def test_bank_across_processes_equals_the_dense_oracle(model_dir, tmp_path, sizes):
    per_rank = run_distributed(_worker, len(sizes), model_dir, list(CONFIGS), sizes, str(tmp_path), [])
    _check(model_dir, sizes, per_rank, [])


@pytest.mark.parametrize(("sizes", "lost"), [([2, 4], [0]), ([2, 3, 4], [1])], ids=["2", "3"])
def test_one_process_resumes_without_its_share(model_dir, tmp_path, sizes, lost):
    """A checkpoint without one process's bank file: that process resumes with an empty share (with a
    warning) while the others restore theirs, and the step scores the shares there are."""
    names = ["mnr_hard_neg", "clip", "tiled_ring_sym"]  # gathered and ring
    per_rank = run_distributed(_worker, len(sizes), model_dir, names, sizes, str(tmp_path), lost)
    _check(model_dir, sizes, per_rank, lost)
