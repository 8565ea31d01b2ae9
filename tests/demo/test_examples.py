"""The examples and the demo end to end on a tiny offline model: each trains, evaluates, writes its model
card (loss, its config, citations, the TrainingArguments' loss fields), and explains its fields in
``--help``, the loss fields first; the multi-process example goes through ``accelerate launch``; the
push_to_hub dry run (``st_cached_losses.demo.hub``, the demo's ``--push_dry_run``) produces the folder (and card) a real push would
upload, without a network. The examples are self-contained scripts: no ``sys.path`` edits, no demo."""

from __future__ import annotations

import ast
import collections
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import st_cached_losses.data
import st_cached_losses.demo.data
from st_cached_losses import CachedLossArgumentParser, CachedLossTrainingArguments
from st_cached_losses.data import stdlib_pairs
from st_cached_losses.demo import hub
from tests.support.dist_utils import accelerate_launch
from tests.support.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TINY = [
    "--max_steps",
    "2",
    "--train_pairs",
    "48",
    "--eval_pairs",
    "24",
    "--per_device_train_batch_size",
    "16",
    "--mini_batch_size",
    "4",
    "--max_seq_length",
    "32",
    "--disable_tqdm",
    "true",
    "--learning_rate",
    "1e-3",
]


@functools.lru_cache(maxsize=1)
def all_stdlib_pairs() -> tuple[tuple[str, str], ...]:
    return tuple(stdlib_pairs(seed=0))


@pytest.fixture(autouse=True)
def parse_the_standard_library_once(monkeypatch):
    """Parsing the standard library takes seconds: the examples and the demo in this process share one
    parse (``stdlib_pairs(limit=n)`` is the first n of the same shuffle)."""

    def cached(limit: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
        assert seed == 0
        return list(all_stdlib_pairs()[:limit])

    # the examples import it from the documented path, the demo from its own package
    monkeypatch.setattr(st_cached_losses.data, "stdlib_pairs", cached)
    monkeypatch.setattr(st_cached_losses.demo.data, "stdlib_pairs", cached)


def make_text_model(path: Path) -> str:
    """A tiny random BERT whose word vocabulary comes from the standard library's docstrings and code,
    so that stdlib texts are not all [UNK] (hard-negative mining needs distinct embeddings); saved as a
    SentenceTransformer folder."""
    counts: collections.Counter[str] = collections.Counter()
    for query, document in all_stdlib_pairs()[:1500]:
        counts.update(re.findall(r"[a-z]+|[0-9]+|[^\sa-z0-9]", (query + " " + document).lower()))
    words = [w for w, _ in counts.most_common(1500)]
    model = make_tiny_model(path / "bert", words=words, dropout=0.1)
    model.save(str(path / "st"))
    return str(path / "st")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory.mktemp("tiny"))


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


def check_card(card: str, loss_class: str, citations: list[str], settings: dict) -> None:
    assert f"loss:{loss_class}" in card and "st_cached_losses.losses" in card and loss_class in card
    for key in citations:
        assert "@" in card and key in card, key
    # the loss's own config (get_config_dict) and the TrainingArguments' loss fields
    assert '"mini_batch_size": 4' in card
    for key, value in settings.items():
        assert f"- `{key}`: {value}" in card, (key, value)
    assert "## Cached loss training" in card and "| before |" in card and "| after |" in card


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "extra", "loss_class", "citations", "settings"),
    [
        (  # --temperature over a script whose loss has a scale: the user's temperature wins
            "train_cached_mnr",
            ["--hard_negatives", "1", "--mining_margin", "0", "--temperature", "0.07"],
            "CachedMNRLoss",
            ["gao2021scaling", "henderson2017efficient"],
            {"loss": "mnr", "temperature": 0.07},
        ),
        (
            "train_cached_clip",
            [],
            "CachedCLIPLoss",
            ["gao2021scaling", "radford2021learning"],
            {"loss": "clip", "learnable_scale": True, "temperature": 0.05},
        ),
        (  # a fixed --scale over the defaults' learnable temperature (and its learning rate)
            "train_cached_clip",
            ["--learnable_scale", "false", "--scale", "30"],
            "CachedCLIPLoss",
            ["gao2021scaling", "radford2021learning"],
            {"loss": "clip", "scale": 30.0},
        ),
        (  # the scale and the bias learned, at the arguments' scale_learning_rate, from the fine-tuning start
            "train_cached_siglip",
            [],
            "CachedSigLIPLoss",
            ["gao2021scaling", "zhai2023sigmoid"],
            {"loss": "siglip", "learnable": True, "scale": 20.0, "siglip_bias": -10.0},
        ),
        (
            "train_cached_tiled",
            [],
            "CachedTiledLoss",
            ["gao2021scaling", "cheng2024breaking", "radford2021learning"],
            {"loss": "tiled", "symmetric": True, "tile_size": 32},
        ),
        (  # the tiny model guided by itself, frozen (the script's default guide: the packaged MiniLM)
            "train_cached_gist",
            ["--guide_model", "{tiny_model}"],
            "CachedGISTLoss",
            ["gao2021scaling", "solatorio2024gistembed"],
            {"loss": "gist", "temperature": 0.01},
        ),
        (  # SPLADE on the tiny BERT's weights with a fresh MLM head, through SparseEncoderTrainer
            "train_cached_sparse",
            [],
            "CachedSparseLoss",
            ["gao2021scaling", "formal2022distillationhardnegativesampling", "paria2020minimizing"],
            {"loss": "sparse", "document_regularizer_weight": 3e-05},
        ),
        (  # the bank across optimizer steps (the card's batch: one micro-batch of 16 a step)
            "train_negative_bank",
            ["--gradient_accumulation_steps", "1", "--negative_bank_size", "24"],
            "CachedMNRLoss",
            ["gao2021scaling", "kim2024gradient"],
            {"loss": "mnr", "negative_bank_size": 24, "negative_bank_max_age": 4},
        ),
        (  # offline (HF_HUB_OFFLINE=1 in the tests): the standard-library pairs, an evaluation set and an evaluator
            "train_real_data",
            [],
            "CachedMNRLoss",
            ["gao2021scaling", "henderson2017efficient"],
            {"loss": "mnr"},
        ),
        (  # ColBERT on the tiny BERT's weights, queries expanded to 8 tokens, MultiVectorEncoderTrainer
            "train_cached_multi_vector",
            ["--query_length", "8"],
            "CachedMultiVectorLoss",
            ["gao2021scaling", "henderson2017efficient"],
            {"loss": "multi_vector", "similarity": "maxsim"},
        ),
    ],
)
def test_example_runs_end_to_end(tmp_path, tiny_model, name, extra, loss_class, citations, settings, capfd):
    module = load_example(name)
    out = tmp_path / "out"
    extra = [tiny_model if a == "{tiny_model}" else a for a in extra]
    trainer, metrics = module.main(
        ["--model_name_or_path", tiny_model, "--output_dir", str(out), *TINY, *extra]
    )
    printed = capfd.readouterr()
    # --disable_tqdm true: no bar at all, sentence-transformers' model card's included
    assert "Computing widget examples" not in printed.err, printed.err[-3000:]
    if name == "train_cached_mnr":  # mining drops the pairs it finds too few negatives for, and says so
        mined = re.search(
            r"hard-negative mining dropped (\d+) of (\d+) pairs .*; training on (\d+)", printed.out
        )
        assert mined is not None, printed.out
        dropped, given, kept = map(int, mined.groups())
        assert given == 48 and dropped + kept == given and kept == len(trainer.train_dataset)
    assert set(metrics) == {"before", "after"} and 0 <= metrics["after"]["MRR@10"] <= 1
    assert trainer.state.global_step == 2 and type(trainer.loss).__name__ == loss_class
    card = (out / "README.md").read_text()
    check_card(card, loss_class, citations, settings)
    assert "batch 16 (1 process(es))" in card and "2 optimizer steps" in card
    assert (out / "model.safetensors").is_file()
    if name == "train_cached_mnr":  # trained on mined triplets, at the command line's temperature
        assert "<code>negative_1</code>" in card
        assert trainer.loss.scale == pytest.approx(1 / 0.07)
    if name == "train_cached_clip" and not extra:  # the temperature was learned, at its own learning rate
        assert trainer.loss.learnable_scale and abs(float(trainer.loss.scale) - 20.0) > 1e-3
        assert "- `learning_rate_mapping`: {'logit_scale': 0.01}" in card
        # our section reports the learned value, not only the start (issue 45)
        learned = float(trainer.loss.scale)
        assert (
            f"learned: from 20 to {learned:.4g} at the end of training (temperature {1 / learned:.4g})"
            in card
        )
    if name == "train_cached_siglip":  # both learned; the card says from what to what
        loss = trainer.loss
        assert abs(float(loss.scale) - 20.0) > 1e-4 and abs(float(loss.bias) + 10.0) > 1e-4
        assert f"scale from 20 to {float(loss.scale):.4g}, bias from -10 to {float(loss.bias):.4g}" in card
    if name == "train_cached_clip" and extra:  # fixed at the command line's scale, no temperature left
        assert not trainer.loss.learnable_scale and float(trainer.loss.scale) == 30.0
        assert "- `temperature`: None" in card and "- `temperature`: 0.05" not in card
        settings = json.loads(card.split("Loss settings (")[1].split("```json")[1].split("```")[0])
        assert settings["scale"] == 30.0 and "temperature" not in settings  # no null beside the scale
    if name == "train_real_data":  # offline: the packaged pairs, 24 held out as evaluation set and evaluator
        assert "Python standard library" in printed.out and "evaluation loss" in printed.out
        assert len(trainer.eval_dataset) == 24 and trainer.eval_dataset.column_names == ["query", "document"]
        assert "Python standard library" in card
    if name == "train_cached_gist":  # guided by a second, frozen model: the trained one is a copy
        assert trainer.loss.guide is not trainer.model
        assert all(not p.requires_grad or p.grad is None for p in trainer.loss.guide.parameters())
    if name == "train_cached_sparse":  # a SparseEncoder trained by its own trainer, FLOPS logged
        assert type(trainer).__name__ == "SparseEncoderTrainer" and "SparseEncoder" in card
        assert any("document_regularizer_loss" in entry for entry in trainer.state.log_history)
    if name == "train_cached_multi_vector":  # ColBERT's query expansion, expansion positions not attended
        assert type(trainer).__name__ == "MultiVectorEncoderTrainer"
        assert trainer.model[0].query_expansion == {
            "strategy": "fixed",
            "attend": False,
            "token": None,
            "length": 8,
        }
        assert '"query_expansion"' in (out / "sentence_bert_config.json").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("precompute", [False, True], ids=["live_teacher", "labels"])
def test_embed_distill_example_runs_end_to_end(tmp_path, tiny_model, precompute):
    """The student (the tiny model's first layer) distils the tiny model's embeddings: a live teacher loaded by
    build_loss from --teacher_model, or (--precompute_labels) the teacher's embeddings in a label column."""
    module = load_example("train_cached_embed_distill")
    out = tmp_path / "out"
    trainer, metrics = module.main(
        ["--model_name_or_path", tiny_model, "--teacher_model", tiny_model, "--student_layers", "1",
         "--precompute_labels", str(precompute).lower(), "--output_dir", str(out), *TINY]
    )  # fmt: skip
    loss = trainer.loss
    assert type(loss).__name__ == "CachedEmbedDistillLoss" and trainer.state.global_step == 2
    assert (loss.pointwise_weight, loss.listwise_weight, loss.listwise_scale) == (1.0, 1.0, 20.0)
    assert len(trainer.model[0].auto_model.encoder.layer) == 1
    columns = trainer.train_dataset.column_names
    if precompute:
        assert loss.teacher is None and columns == ["query", "document", "label"]
        width = trainer.model.get_embedding_dimension()
        assert [len(x) for x in trainer.train_dataset[0]["label"]] == [width, width]
    else:
        assert (
            loss.teacher is not None
            and loss.teacher is not trainer.model
            and columns == ["query", "document"]
        )
        assert all(p.grad is None for p in loss.teacher.parameters())
    assert set(metrics) == {"before", "after", "teacher"} and 0 <= metrics["after"]["MRR@10"] <= 1
    card = (out / "README.md").read_text()
    check_card(
        card,
        "CachedEmbedDistillLoss",
        ["gao2021scaling", "kim2023embeddistill"],
        {"loss": "embed_distill", "listwise_weight": 1.0},
    )
    assert "| teacher |" in card and (out / "model.safetensors").is_file()


def test_embed_distill_example_yaml_is_its_defaults():
    module = load_example("train_cached_embed_distill")
    parser = CachedLossArgumentParser((module.ExampleArguments, CachedLossTrainingArguments))
    example, args = parser.parse_command_line(
        [str(EXAMPLES / "configs" / "cached_embed_distill.yaml")], module.DEFAULTS
    )
    example_defaults, defaults = parser.parse_command_line([], module.DEFAULTS)
    assert example == example_defaults
    assert (args.loss, args.teacher_model) == ("embed_distill", module.packaged_model_path())
    for name in ("distance_metric", "pointwise_weight", "listwise_weight", "listwise_scale", "mini_batch_size",
                 "per_device_train_batch_size", "learning_rate", "batch_sampler"):  # fmt: skip
        assert getattr(args, name) == getattr(defaults, name), name


def test_real_data_example_loads_the_hub_dataset_online(monkeypatch):
    """Online (no HF_HUB_OFFLINE), the example asks load_dataset for the first rows of the named dataset and
    keeps its first two columns (natural-questions: query, answer); offline it never calls it."""
    module = load_example("train_real_data")
    asked = []

    def fake_load_dataset(name, split):
        asked.append((name, split))
        rows = {"query": [f"q{i}" for i in range(10)], "answer": [f"a{i}" for i in range(10)]}
        return module.Dataset.from_dict({**rows, "id": list(range(10))})

    monkeypatch.setattr(module, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(module, "is_offline_mode", lambda: False)
    dataset, source = module.load_pairs("sentence-transformers/natural-questions", 10)
    assert asked == [("sentence-transformers/natural-questions", "train[:10]")]
    assert dataset.column_names == ["query", "answer"] and source == "sentence-transformers/natural-questions"
    monkeypatch.setattr(module, "is_offline_mode", lambda: True)
    dataset, source = module.load_pairs("sentence-transformers/natural-questions", 10)
    assert len(asked) == 1 and len(dataset) == 10 and "standard library" in source


@pytest.mark.slow
def test_multi_dataset_example_trains_one_dataset_per_step(tmp_path, tiny_model):
    """Three datasets of different sizes, SameDatasetBatchSampler from the script's defaults (one process here;
    tests/config/test_same_dataset_accelerate.py runs the sampler under accelerate launch), from its YAML too."""
    from st_cached_losses import SameDatasetBatchSampler

    module = load_example("train_multi_dataset")
    out = tmp_path / "out"
    trainer, metrics = module.main(["--model_name_or_path", tiny_model, "--output_dir", str(out), *TINY])
    sampler = trainer.get_train_dataloader().batch_sampler
    assert isinstance(sampler, SameDatasetBatchSampler) and sampler.order == "proportional"
    sizes = [len(part) for part in trainer.train_dataset.values()]
    assert list(trainer.train_dataset) == ["summary_to_code", "code_to_summary", "name_to_code"]
    assert sizes[0] > sizes[1] > sizes[2] > 0
    assert trainer.state.global_step == 2 and set(metrics) == {"before", "after"}
    assert "CachedMNRLoss" in (out / "README.md").read_text()
    parser = CachedLossArgumentParser((module.ExampleArguments, CachedLossTrainingArguments))
    _, args = parser.parse_command_line([str(EXAMPLES / "configs" / "multi_dataset.yaml")], module.DEFAULTS)
    assert args.multi_dataset_batch_sampler.func is SameDatasetBatchSampler
    assert (args.loss, args.margin, args.guide_model) == ("gist", -0.1, None)  # the BGE-style recipe


@pytest.mark.slow
def test_multi_dataset_example_the_bge_style_recipe(tmp_path, tiny_model):
    """The YAML's recipe on the tiny model: a self-guided CachedGISTLoss per dataset, one dataset (the one with
    a mined hard negative) scored against its own candidates only, a learnable scale saved by the callback."""
    from st_cached_losses import CachedGISTLoss

    module = load_example("train_multi_dataset")
    recipe = ["--loss", "gist", "--margin", "-0.1", "--own_negatives_datasets", "summary_to_code"]
    argv = ["--model_name_or_path", tiny_model, "--output_dir", str(tmp_path / "out"), *TINY, *recipe]
    trainer, _ = module.main([*argv, "--learnable_scale", "true"])
    losses = dict(trainer.loss.items())
    assert set(losses) == {"summary_to_code", "code_to_summary", "name_to_code"}
    assert all(isinstance(x, CachedGISTLoss) and x.self_guided for x in losses.values())
    assert [name for name, x in losses.items() if not x.in_batch_negatives] == ["summary_to_code"]
    assert trainer.train_dataset["summary_to_code"].column_names == ["query", "document", "negative"]
    assert trainer.state.global_step == 2


@pytest.mark.parametrize(
    ("name", "argv", "expected"),
    [
        ("train_cached_clip", ["--learnable_scale", "false", "--scale", "30"], (30.0, None, 30.0)),
        ("train_cached_mnr", ["--temperature", "0.07"], (None, 0.07, 1 / 0.07)),
        (
            "train_cached_clip",
            ["--config", "examples/configs/cached_clip.yaml", "--scale", "30"],
            (30.0, None, 30.0),
        ),
        ("train_cached_tiled", ["examples/configs/cached_tiled.yaml", "--temp", "0.1"], (None, 0.1, 10.0)),
        ("train_cached_gist", ["examples/configs/cached_gist.yaml", "--scale", "50"], (50.0, None, 50.0)),
    ],
)
def test_scale_or_temperature_from_the_command_line_replaces_the_defaults_one(name, argv, expected):
    """`--scale 30` on a script (or file) whose defaults name a temperature, and the other way round,
    used to fail with "scale and temperature disagree"."""
    module = load_example(name)
    parser = CachedLossArgumentParser((module.ExampleArguments, CachedLossTrainingArguments))
    _, args = parser.parse_command_line(
        [a.replace("examples/", f"{EXAMPLES}/") for a in argv], module.DEFAULTS
    )
    assert (args.scale, args.temperature) == expected[:2]
    assert args.loss_scale == pytest.approx(expected[2])


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_are_self_contained(path):
    """A user copies an example: it imports the package's public API, never the demo or tests, and does
    not edit sys.path."""
    source = path.read_text()
    assert "sys.path" not in source and len(source.splitlines()) <= 160
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[0] != "tests" and "demo" not in node.module, node.module
            assert not any(alias.name.startswith("_") for alias in node.names), node.module


def _aborted_after_finishing(proc: subprocess.CompletedProcess[str]) -> bool:
    """The run finished (model and card saved) and only then did a rank abort ("terminate called")."""
    return (
        proc.returncode != 0
        and "model and card saved" in proc.stdout
        and "terminate called without an active exception" in proc.stderr
    )


def test_accelerate_example_two_processes(tmp_path, tiny_model):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        *accelerate_launch(2),
        str(EXAMPLES / "train_accelerate.py"),
        "--model_name_or_path",
        tiny_model,
        "--output_dir",
        str(out),
        *TINY,
        "--per_device_train_batch_size",
        "8",
        "--loss",
        "tiled",
        "--symmetric",
        "true",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if _aborted_after_finishing(proc):
        # seen once in about 15 runs since deepspeed is installed (accelerate imports it in every Trainer):
        # a rank aborts in native code at interpreter exit, after the run finished and the card was written,
        # although the example leaves the process group first. Run once more: twice in a row fails here.
        warnings.warn(
            f"the two-process example aborted at exit once; run again:\n{proc.stderr[-1500:]}", stacklevel=1
        )
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # every process left the process group cleanly (no abort at exit while the main one was saving)
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr
    assert "2 process(es)" in proc.stdout and "global batch 16" in proc.stdout
    card = (out / "README.md").read_text()
    assert "CachedTiledLoss" in card and "- `gather_across_devices`: True" in card
    assert "batch 16 (2 process(es))" in card


@pytest.mark.parametrize(
    "name",
    [
        "train_cached_mnr",
        "train_cached_clip",
        "train_cached_tiled",
        "train_cached_gist",
        "train_cached_sparse",
        "train_cached_multi_vector",
        "train_cached_embed_distill",
        "train_accelerate",
        "train_multi_dataset",
        "train_real_data",
        "demo",
    ],
)
def test_example_help_explains_the_fields(name, capsys):
    if name == "demo":
        from st_cached_losses.demo import main
    else:
        main = load_example(name).main
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    raw = capsys.readouterr().out
    text = " ".join(raw.split())
    for snippet in (
        "--loss",
        "'mnr' (CachedMNRLoss",
        "--mini_batch_size",
        "sets the memory, never the result",
        "--temperature",
        "--tile_size",
        "--gather_across_devices",
        "--model_name_or_path",
        "--train_pairs",
    ):
        assert snippet in text, snippet
    # a one-line usage, the docstring's lines kept, and the loss fields before the ~120 training arguments
    assert raw.splitlines()[0].startswith("usage:") and "[--FIELD VALUE ...]" in raw.splitlines()[0]
    assert "\n    python examples/" in raw or "\n1. real text pairs" in raw
    fields = raw[raw.index("\noptions:") :]
    assert fields.index("--loss ") < fields.index("--model_name_or_path") < fields.index("--output_dir")
    assert fields.index("--symmetric") < fields.index("--learning_rate")


def test_example_rejects_a_bad_config_before_training(tmp_path, tiny_model):
    module = load_example("train_cached_clip")
    (tmp_path / "bad.yaml").write_text(f"model_name_or_path: {tiny_model}\nloss: clip\nsymetric: true\n")
    with pytest.raises(ValueError, match=r"symetric.*Did you mean 'symmetric'"):
        module.main([str(tmp_path / "bad.yaml")])
    with pytest.raises(ValueError, match="symmetric applies to loss='tiled' only"):
        module.main(["--model_name_or_path", tiny_model, "--symmetric", "true"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--loss", "nmr"],
            "loss='nmr' is not a cached loss; choose one of 'mnr', 'clip', 'tiled', 'gist', 'sparse', 'multi_vector'",
        ),
        (["{bad_yaml}"], "unknown field(s) ['mini_bach_size']; see --help for the fields. Did you mean"),
        (["--margin", "0.1"], "margin applies to loss='gist' only"),
    ],
)
def test_command_line_errors_are_one_line_before_training(tmp_path, argv, message):
    """From a shell, a bad configuration is one 'error:' line and exit status 2 (no traceback), before any
    model is loaded."""
    (tmp_path / "bad.yaml").write_text("loss: mnr\nmini_bach_size: 4\n")
    argv = [a.replace("{bad_yaml}", str(tmp_path / "bad.yaml")) for a in argv]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_cached_mnr.py"), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Loading weights" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], proc.stderr[-2000:]


def test_push_to_hub_dry_run_uploads_the_saved_card(tmp_path, tiny_model):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(tiny_model, device="cpu")
    model.save_pretrained(str(tmp_path / "saved"))
    (tmp_path / "saved" / "README.md").write_text("# my card\n")
    folder = hub.push_to_hub_dry_run(
        model, "me/my-model", tmp_path / "upload", local_model_path=str(tmp_path / "saved")
    )
    assert (folder / "README.md").read_text() == "# my card\n"
    assert (folder / "model.safetensors").is_file()
    # without a local folder: sentence-transformers saves the model and writes the card for the repo id
    folder = hub.push_to_hub_dry_run(model, "me/my-model", tmp_path / "upload2")
    assert 'SentenceTransformer("me/my-model")' in (folder / "README.md").read_text()


@pytest.mark.slow
def test_demo_runs_on_a_tiny_model_then_a_hub_dry_run(tmp_path, tiny_model, monkeypatch):
    """The demo writes its card for the repository named by --hub_model_id; its --push_dry_run (what
    `make model-cards` records) and the dry run of a saved folder upload exactly the saved folder, card
    included, with no network (a Hub call would fail)."""
    from st_cached_losses.demo import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "demo"
    summary = main(
        [
            "--model_name_or_path",
            tiny_model,
            "--output_dir",
            str(out),
            "--hub_model_id",
            "me/stdlib-demo",
            "--push_dry_run",
            str(tmp_path / "upload"),
            "--loss_show_progress_bar",
            "false",
            *TINY,
        ]
    )
    assert summary["steps"] == 2 and summary["batch_size"] == 16
    assert set(summary["metrics"]) == {"before", "after"}
    assert summary["push_dry_run"] == str(tmp_path / "upload")
    pushed = tmp_path / "upload"
    assert (pushed / "model.safetensors").is_file()
    assert (pushed / "README.md").read_text() == (out / "README.md").read_text()
    uploaded = hub.main([str(out), "me/stdlib-demo"])
    assert uploaded == tmp_path / "demo_hub_upload" and (uploaded / "model.safetensors").is_file()
    assert sorted(p.name for p in uploaded.iterdir()) == sorted(p.name for p in pushed.iterdir())
    card = (uploaded / "README.md").read_text()
    assert card == (out / "README.md").read_text()
    assert 'SentenceTransformer("me/stdlib-demo")' in card
    check_card(card, "CachedMNRLoss", ["gao2021scaling", "henderson2017efficient"], {"loss": "mnr"})
    settings = json.loads(
        card.split("Loss settings (`CachedLossTrainingArguments`):")[1].split("```json")[1].split("```")[0]
    )
    assert settings["loss"] == "mnr" and settings["mini_batch_size"] == 4


def test_push_dry_run_needs_a_hub_model_id(tmp_path, monkeypatch, capsys):
    """Checked before anything is loaded: a ValueError from Python, one error line from a shell."""
    from st_cached_losses.demo import main

    argv = ["--output_dir", str(tmp_path / "demo"), "--push_dry_run", str(tmp_path / "upload")]
    with pytest.raises(ValueError, match="push_dry_run needs --hub_model_id"):
        main(argv)
    monkeypatch.setattr(sys, "argv", ["python -m st_cached_losses.demo", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: push_dry_run needs --hub_model_id" in err, err


def test_hub_dry_run_refuses_a_folder_that_is_not_a_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        hub.main([str(tmp_path), "me/my-model"])
    assert info.value.code == 2 and "is not a saved SentenceTransformer folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("loss", "extra", "kind"),
    [
        ("sparse", ["--document_regularizer_weight", "3e-5"], "SparseEncoder"),
        ("multi_vector", [], "MultiVectorEncoder"),
    ],
)
def test_demo_refuses_a_loss_for_another_model_kind(tmp_path, monkeypatch, capsys, loss, extra, kind):
    """The demo trains a SentenceTransformer: a loss for a SparseEncoder / MultiVectorEncoder is refused before
    anything is loaded (by the arguments: CachedLossTrainingArguments trains SentenceTransformers), naming the
    model kind it needs (a ValueError from Python, one error line from a shell)."""
    from st_cached_losses.demo import main

    argv = ["--output_dir", str(tmp_path / "demo"), "--loss", loss, *extra]
    with pytest.raises(ValueError, match=f"trains a {kind}"):
        main(argv)
    monkeypatch.setattr(sys, "argv", ["python -m st_cached_losses.demo", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"trains a {kind}" in err, err
