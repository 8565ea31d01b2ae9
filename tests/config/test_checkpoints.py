"""training_args.bin: the arguments pickle under the documented path."""

from __future__ import annotations

from st_cached_losses.config.factory import build_loss, check_dataset_columns
from st_cached_losses.config.training_args import (
    CachedLossTrainingArguments,
)
from tests.config.helpers import BASE


def test_checkpoints_pickle_the_documented_path(tmp_path):
    """``training_args.bin`` names the class by ``st_cached_losses.training_args``, the documented path kept
    as a re-export: a checkpoint from before the move into ``config/`` loads (the same bytes), and one
    written now loads under an older version; a fresh process unpickles it by that path alone."""
    import pickle
    import subprocess
    import sys

    import st_cached_losses.training_args as documented

    assert documented.CachedLossTrainingArguments is CachedLossTrainingArguments
    assert documented.build_loss is build_loss and documented.check_dataset_columns is check_dataset_columns
    args = CachedLossTrainingArguments(**BASE, loss="clip", temperature=0.05, mini_batch_size=4)
    data = pickle.dumps(args)
    assert b"st_cached_losses.training_args" in data and b"st_cached_losses.config" not in data
    back = pickle.loads(data)
    assert type(back) is CachedLossTrainingArguments
    assert back.loss_settings() == args.loss_settings()
    (tmp_path / "args.pkl").write_bytes(data)
    code = (
        "import pickle, sys; a = pickle.load(open(sys.argv[1], 'rb')); "
        "from st_cached_losses.config.training_args import CachedLossTrainingArguments as C; "
        "assert type(a) is C and a.loss == 'clip' and a.loss_scale == 20.0, a"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "args.pkl")], check=True)
