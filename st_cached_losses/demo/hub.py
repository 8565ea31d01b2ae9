"""A ``push_to_hub`` dry run: everything sentence-transformers does before the upload, nothing sent.

``model.push_to_hub(repo_id, ...)`` runs as is, with only its Hub client replaced by a recorder that copies
the folder a real push would upload (the model's files and its ``README.md``, the card the Hub would show)
into a local folder. No network and no token are needed. Three ways in:

```text
python -m st_cached_losses.demo --hub_model_id your-username/my-model --push_dry_run output/upload
python -m st_cached_losses.demo.hub output/demo your-username/my-model   # a saved folder, as saved
push_to_hub_dry_run(model, "your-username/my-model", "output/upload")     # from Python
```

The recorder stands in for the ``HfApi`` that sentence-transformers 6.x's ``push_to_hub`` looks up in
``sentence_transformers.base.model``; another version that looks it up elsewhere fails with a clear error
rather than uploading.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["HF_API_MODULE", "RecordingHfApi", "main", "push_to_hub_dry_run"]

#: the module whose ``HfApi`` name sentence-transformers' push_to_hub calls
HF_API_MODULE = "sentence_transformers.base.model"


class RecordingHfApi:
    """Stands in for ``huggingface_hub.HfApi`` during a dry run: copies what would be uploaded to ``target``."""

    def __init__(self, target: Path, token: str | None = None) -> None:
        self.target = target

    def create_repo(self, repo_id: str, **kwargs: Any) -> Any:
        return SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

    def create_branch(self, **kwargs: Any) -> None:
        return None

    def upload_folder(self, repo_id: str, folder_path: str, **kwargs: Any) -> Any:
        if self.target.exists():
            shutil.rmtree(self.target)
        shutil.copytree(folder_path, self.target)
        return SimpleNamespace(
            commit_url=f"https://huggingface.co/{repo_id}/commit/dry-run", pr_url=None, repo_id=repo_id
        )


def push_to_hub_dry_run(model: Any, repo_id: str, folder: str | Path, **kwargs: Any) -> Path:
    """Run ``model.push_to_hub(repo_id, **kwargs)`` with the Hub client replaced by a recorder.

    Everything sentence-transformers does before the upload runs (saving the model and writing its card
    for ``repo_id``, unless ``local_model_path=`` names a saved folder to upload as it is); the folder it
    would upload is copied to ``folder`` instead (replacing it). Returns ``folder``; its ``README.md`` is
    the card the Hub would show.

    Raises:
        RuntimeError: if the installed sentence-transformers does not look its Hub client up where the
            recorder replaces it (nothing is pushed).
    """
    target = Path(folder)
    module = importlib.import_module(HF_API_MODULE)
    original = getattr(module, "HfApi", None)
    if original is None:
        raise RuntimeError(
            f"this sentence-transformers does not call {HF_API_MODULE}.HfApi in push_to_hub: the dry run cannot "
            "replace its Hub client, so it stops here (nothing was sent)."
        )
    setattr(module, "HfApi", lambda token=None, **_: RecordingHfApi(target, token))  # noqa: B010
    try:
        # replace_model_card: do not ask the Hub whether the repository already has a README
        model.push_to_hub(repo_id, replace_model_card=True, **kwargs)
    finally:
        setattr(module, "HfApi", original)  # noqa: B010
    return target


def main(argv: list[str] | None = None) -> Path:
    """Dry-run the push of a saved model folder (its card as saved) to ``--upload_dir`` (default:
    ``<model_dir>_hub_upload``)."""
    parser = argparse.ArgumentParser(
        prog="python -m st_cached_losses.demo.hub",
        description="The folder a push_to_hub of a saved model folder would upload, written locally; "
        "nothing is sent.",
    )
    parser.add_argument("model_dir", help="a folder written by model.save_pretrained (its card as saved)")
    parser.add_argument("repo_id", help="the repository a real push would go to, e.g. your-username/my-model")
    parser.add_argument("--upload_dir", help="where the upload lands (default: <model_dir>_hub_upload)")
    options = parser.parse_args(argv)
    model_dir = Path(options.model_dir)
    if not (model_dir / "modules.json").is_file() and not (model_dir / "config.json").is_file():
        parser.error(
            f"{model_dir} is not a saved SentenceTransformer folder (no modules.json or config.json)."
        )
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    upload = options.upload_dir or model_dir.parent / f"{model_dir.name}_hub_upload"
    folder = push_to_hub_dry_run(model, options.repo_id, upload, local_model_path=str(model_dir))
    print(f"push_to_hub dry run: the folder that would go to {options.repo_id} is in {folder}")
    return folder


if __name__ == "__main__":
    main()
