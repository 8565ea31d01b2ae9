"""The modules' paths from before ``functional/`` had rooms ([`old_paths`][st_cached_losses.functional.old_paths]):
each one imports, and gives the module at its new home (the same object)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from st_cached_losses.functional.old_paths import MOVED, PREFIX

#: ``functional/``'s modules before the rooms
BEFORE = [
    "__init__",
    "_kernels",
    "autograd",
    "binding",
    "checks",
    "distill",
    "distributed",
    "embed_distill",
    "flash",
    "flops",
    "infonce",
    "keys",
    "listwise",
    "local",
    "multi_vector",
    "options",
    "own",
    "parallel",
    "positives",
    "precision",
    "ring",
    "score",
    "sigmoid",
    "sigmoid_blocks",
    "sigmoid_drivers",
    "sigmoid_options",
    "sparse",
    "terms",
    "triton_kernels",
]
#: still where they were: the package's face, the shared floor, and the two packages named as the modules were
STAYED = {"__init__", "checks", "distributed", "keys", "precision", "score", "sigmoid", "distill"}


def test_every_module_that_moved_has_its_new_home_in_the_table():
    assert sorted(set(BEFORE) - STAYED) == sorted(MOVED)
    for name in STAYED - {"__init__"}:
        importlib.import_module(PREFIX + name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_module_at_its_new_home(old):
    new = importlib.import_module(PREFIX + MOVED[old])
    assert importlib.import_module(PREFIX + old) is new
    assert sys.modules[PREFIX + old] is new
    # the module keeps its own name and spec (not the old path's)
    assert new.__name__ == new.__spec__.name == PREFIX + MOVED[old]


def test_old_paths_in_a_fresh_interpreter():
    """Every form of import, first thing in a process (nothing of the rooms loaded yet); the face's entry point
    ``infonce`` stays the function although an old module path has the same name."""
    code = (
        "import st_cached_losses.functional.sigmoid_options as so\n"
        "from st_cached_losses.functional.own import in_batch_negatives\n"
        "from st_cached_losses.functional.infonce import InfoNCEOutput\n"
        "import st_cached_losses.functional.infonce\n"
        "from st_cached_losses.functional import infonce, flash\n"
        "import st_cached_losses.functional.softmax.own as own, st_cached_losses.functional.sigmoid.options as o\n"
        "import st_cached_losses.functional.softmax.loss as loss, st_cached_losses.functional as F\n"
        "assert so is o and own.in_batch_negatives is in_batch_negatives and loss.InfoNCEOutput is InfoNCEOutput\n"
        "assert infonce is loss.infonce and F.infonce is loss.infonce, infonce\n"
        "assert flash.__name__ == 'st_cached_losses.functional.softmax.flash'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_packages_named_as_modules_were_export_what_the_modules_did():
    from st_cached_losses.functional import distill, sigmoid
    from st_cached_losses.functional.distill import scores
    from st_cached_losses.functional.sigmoid import loss

    assert sigmoid.__all__ == ["SigmoidOptions", "SigmoidOutput", "sigmoid_loss", "sigmoid_loss_and_grad"]
    assert all(getattr(sigmoid, n) is getattr(loss, n) for n in sigmoid.__all__)
    assert distill.__all__ == scores.__all__
    assert all(getattr(distill, n) is getattr(scores, n) for n in distill.__all__)


def test_an_unknown_path_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(PREFIX + "no_such_module")
