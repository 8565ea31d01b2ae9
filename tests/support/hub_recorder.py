"""A ``push_to_hub`` dry run: everything sentence-transformers does before the upload, nothing sent.

Test-only (it swaps the Hub client of a private sentence-transformers import path, so it stays out of
the wheel): the tests check that the card a real push would upload is the saved one, and ``make
model-cards`` records the demo's upload folder with it::

    python -m tests.support.hub_recorder output/demo your-username/my-model   # -> output/demo_hub_upload
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

#: where sentence-transformers 6.2 looks up the Hub client that push_to_hub uses
HF_API_PATH = "sentence_transformers.base.model.HfApi"


class RecordingHfApi:
    """Stands in for ``huggingface_hub.HfApi`` during a dry run: copies what would be uploaded to ``target``."""

    def __init__(self, target: Path, token: str | None = None) -> None:
        self.target = target

    def create_repo(self, repo_id: str, **kwargs: Any) -> Any:
        return mock.Mock(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

    def create_branch(self, **kwargs: Any) -> None:
        return None

    def upload_folder(self, repo_id: str, folder_path: str, **kwargs: Any) -> Any:
        if self.target.exists():
            shutil.rmtree(self.target)
        shutil.copytree(folder_path, self.target)
        return mock.Mock(
            commit_url=f"https://huggingface.co/{repo_id}/commit/dry-run", pr_url=None, repo_id=repo_id
        )


def push_to_hub_dry_run(model: Any, repo_id: str, folder: str | Path, **kwargs: Any) -> Path:
    """Run ``model.push_to_hub(repo_id, ...)`` with the Hub client replaced by a recorder.

    Everything sentence-transformers does before the upload runs (saving the model and writing its card
    for ``repo_id``, unless ``local_model_path=`` names a saved folder to upload as it is); the folder it
    would upload is copied to ``folder`` instead. Returns ``folder``; its ``README.md`` is the card the
    Hub would show.
    """
    target = Path(folder)
    with mock.patch(HF_API_PATH, lambda token=None: RecordingHfApi(target)):
        # replace_model_card: do not ask the Hub whether the repository already has a README
        model.push_to_hub(repo_id, replace_model_card=True, **kwargs)
    return target


def main(argv: list[str] | None = None) -> Path:
    """Dry-run the push of a saved model folder (its card as saved) to ``<folder>_hub_upload``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", help="a folder written by model.save_pretrained")
    parser.add_argument("repo_id", help="the repository a real push would go to, e.g. your-username/my-model")
    parser.add_argument("--upload_dir", help="where the upload lands (default: <model_dir>_hub_upload)")
    options = parser.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    model_dir = Path(options.model_dir)
    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    upload = options.upload_dir or model_dir.parent / f"{model_dir.name}_hub_upload"
    folder = push_to_hub_dry_run(model, options.repo_id, upload, local_model_path=str(model_dir))
    print(f"push_to_hub dry run: the folder that would go to {options.repo_id} is in {folder}")
    return folder


if __name__ == "__main__":
    main()
