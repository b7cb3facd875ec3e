"""Publishing with huggingface_hub: the plan (what would be uploaded, offline) and the upload."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def upload_plan(bundle: Path, repo_id: str) -> dict[str, Any]:
    files = sorted((p for p in bundle.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
    entries = [{"path": p.relative_to(bundle).as_posix(), "bytes": p.stat().st_size}
               for p in files]
    return {"repo_id": repo_id, "repo_type": "model", "create_repo": True,
            "files": entries, "total_bytes": sum(e["bytes"] for e in entries)}


def upload(bundle: Path, repo_id: str) -> str:
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    info = api.upload_folder(folder_path=str(bundle), repo_id=repo_id, repo_type="model",
                             commit_message="Upload MLX bundle with MTP sidecar (mtpkit)")
    return f"uploaded to {getattr(info, 'commit_url', repo_id)}"
