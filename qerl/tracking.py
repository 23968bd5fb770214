"""MLflow tracking with explicit run ids (no fluent "active run": tasks may run in threads).

    tracker = Tracker(recipe.mlflow)
    parent = tracker.start_run(recipe, "reproduce-table/embedded")
    child = tracker.start_run(recipe, "evaluate/nvfp4", parent_run_id=parent, tags={"format": "nvfp4"})
    with tracker.tracked(child):          # FINISHED on success; FAILED + error tag + error.txt on error
        tracker.log_metrics(child, {"gsm8k_accuracy": 0.41})

Each run gets the recipe flattened into params and these tags: recipe, model, seed, git_commit
(+ mlflow.source.git.commit), version.<package> for torch/transformers/qerl/prefect/mlflow,
plus whatever the caller adds (variant, format, step). A nested run carries mlflow.parentRunId.

The default store is sqlite:///mlflow.db in the working directory; its artifacts go to ./mlruns
next to it. `import qerl` does not import this module; mlflow is imported when a Tracker is made.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from qerl.recipe import MlflowSettings, Recipe

__all__ = [
    "Tracker",
    "artifact_location_for",
    "git_commit",
    "package_versions",
    "resolve_tracking_uri",
    "ui_command",
]

PACKAGES = ("torch", "transformers", "qerl", "prefect", "mlflow")
PARENT_TAG = "mlflow.parentRunId"
_LOCK = threading.RLock()  # serialise writes: sqlite stores dislike concurrent writers
_MAX_TAG = 5000


# ----------------------------------------------------------------------------- helpers


def resolve_tracking_uri(uri: str) -> str:
    """Make a relative sqlite path absolute (sqlite:///mlflow.db -> sqlite:////cwd/mlflow.db)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        path = uri[len(prefix):]
        if path and path != ":memory:" and not path.startswith("/"):
            return prefix + str(Path(path).resolve())
    elif "://" not in uri and uri:  # a bare directory: MLflow's file store
        return str(Path(uri).resolve())
    return uri


def artifact_location_for(uri: str) -> str | None:
    """Default artifact root for a new experiment: <folder of the sqlite file>/mlruns."""
    uri = resolve_tracking_uri(uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and uri[len(prefix):] not in ("", ":memory:"):
        return (Path(uri[len(prefix):]).parent / "mlruns").as_uri()
    return None


def ui_command(uri: str, port: int = 5000) -> str:
    return f"mlflow ui --backend-store-uri {resolve_tracking_uri(uri)} --host 127.0.0.1 --port {port}"


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of the checkout that holds this package, or None (not a git checkout / no git)."""
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def _git_dirty() -> bool | None:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "qerl":
                import qerl

                versions[name] = qerl.__version__
            else:
                versions[name] = "not installed"
    versions["python"] = platform.python_version()
    return versions


def base_tags(recipe: "Recipe") -> dict[str, str]:
    tags = {
        "recipe": recipe.name,
        "model": recipe.model.name,
        "seed": str(recipe.seed),
    }
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
        tags["mlflow.source.git.commit"] = commit
        dirty = _git_dirty()
        if dirty is not None:
            tags["git_dirty"] = str(dirty).lower()
    for name, version in package_versions().items():
        tags[f"version.{name}"] = version
    tags.update(kernel_tags())
    return tags


def kernel_tags() -> dict[str, str]:
    """What the kernels ran under: the nvfp4 word-order setting (`w4a16_order`, QERL_W4A16_ORDER or its default)
    and every `QERL_*` switch set in the environment (`switch.QERL_...`), so runs of an ablation over kernel
    settings can be told apart and filtered in the MLflow UI."""
    from qerl.env import switches
    from qerl.kernels.layout import order_setting

    return {"w4a16_order": order_setting(), **{f"switch.{k}": v for k, v in switches().items()}}


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def error_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ----------------------------------------------------------------------------- tracker


class Tracker:
    """Thin, thread-safe wrapper of `mlflow.MlflowClient` for one tracking store + experiment."""

    def __init__(self, settings: "MlflowSettings"):
        self.tracking_uri = resolve_tracking_uri(settings.tracking_uri)
        self.experiment_name = settings.experiment
        self.artifact_location = settings.artifact_location or artifact_location_for(self.tracking_uri)
        self.client = _client(self.tracking_uri)
        self._experiment_id: str | None = None

    # ---- experiment and runs
    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            with _LOCK:
                exp = self.client.get_experiment_by_name(self.experiment_name)
                if exp is None:
                    self._experiment_id = self.client.create_experiment(
                        self.experiment_name, artifact_location=self.artifact_location
                    )
                else:
                    if exp.lifecycle_stage == "deleted":
                        self.client.restore_experiment(exp.experiment_id)
                    self._experiment_id = exp.experiment_id
        return self._experiment_id

    def start_run(
        self,
        recipe: "Recipe",
        run_name: str,
        *,
        parent_run_id: str | None = None,
        tags: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> str:
        """Create a RUNNING run (nested under parent_run_id if given) with recipe params and tags."""
        from qerl.recipe import flatten

        all_tags = base_tags(recipe)
        all_tags.update({k: str(v) for k, v in (tags or {}).items()})
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        with _LOCK:
            run = self.client.create_run(self.experiment_id, tags=all_tags, run_name=run_name)
        run_id = run.info.run_id
        all_params = flatten(recipe)
        all_params.update({k: str(v) for k, v in (params or {}).items()})
        self.log_params(run_id, all_params)
        return run_id

    def start_plain_run(self, run_name: str, tags: dict[str, Any]) -> str:
        """A RUNNING top-level run with only the given tags (no recipe): e.g. a logged benchmark file."""
        with _LOCK:
            run = self.client.create_run(self.experiment_id, tags={k: str(v)[:_MAX_TAG] for k, v in tags.items()},
                                         run_name=run_name)
        return run.info.run_id

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        with _LOCK:
            self.client.set_terminated(run_id, status=status)

    def fail(self, run_id: str, exc: BaseException, status: str = "FAILED") -> None:
        """Mark a run FAILED (or KILLED) with the error as tags and an error.txt artifact."""
        line = error_line(exc)
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            self.set_tags(run_id, {"error": line[:_MAX_TAG], "error_type": type(exc).__name__})
            self.log_text(run_id, f"{line}\n\n{trace}", "error.txt")
        finally:
            self.finish(run_id, status)

    @contextmanager
    def tracked(self, run_id: str) -> Iterator[str]:
        """FINISHED on success; FAILED (KILLED on Ctrl-C) with the error logged, then re-raise."""
        try:
            yield run_id
        except BaseException as exc:
            status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
            try:
                self.fail(run_id, exc, status)
            except Exception:  # never hide the original error behind a tracking error
                pass
            raise
        else:
            self.finish(run_id, "FINISHED")

    # ---- logging
    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:6000]) for k, v in params.items()]
        with _LOCK:
            for chunk in _chunks(items, 100):
                self.client.log_batch(run_id, params=chunk)

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(str(k), str(v)[:_MAX_TAG]) for k, v in tags.items()]
        with _LOCK:
            for chunk in _chunks(items, 100):
                self.client.log_batch(run_id, tags=chunk)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(str(k), float(v), now, step) for k, v in metrics.items() if v is not None]
        with _LOCK:
            for chunk in _chunks(items, 1000):
                self.client.log_batch(run_id, metrics=chunk)

    def log_artifact(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        with _LOCK:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        with _LOCK:
            self.client.log_text(run_id, text, artifact_file)

    def log_dict(self, run_id: str, data: dict, artifact_file: str) -> None:
        with _LOCK:
            self.client.log_dict(run_id, data, artifact_file)

    # ---- reading
    def get_run(self, run_id: str):
        with _LOCK:
            return self.client.get_run(run_id)

    def search_runs(self, filter_string: str, experiment_id: str | None = None) -> list:
        """Every active run of the experiment (default: this tracker's, if it exists) that matches, oldest first."""
        if experiment_id is None:
            with _LOCK:
                exp = self.client.get_experiment_by_name(self.experiment_name)
            if exp is None:
                return []
            experiment_id = exp.experiment_id
        out, token = [], None
        with _LOCK:
            while True:
                page = self.client.search_runs(
                    [experiment_id],
                    filter_string=filter_string,
                    run_view_type=1,  # ACTIVE_ONLY
                    max_results=1000,
                    order_by=["attributes.start_time ASC"],
                    page_token=token,
                )
                out.extend(page)
                token = page.token
                if not token:
                    break
        return out

    def child_runs(self, parent_run_id: str) -> list:
        """All runs nested under `parent_run_id` (any status), oldest first."""
        parent = self.get_run(parent_run_id)
        return self.search_runs(f"tags.`{PARENT_TAG}` = '{parent_run_id}'", parent.info.experiment_id)

    def latest_parent_run(self, recipe_name: str) -> str | None:
        """The newest top-level reproduce-table run of a recipe in this experiment, or None."""
        with _LOCK:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            if exp is None:
                return None
            runs = self.client.search_runs(
                [exp.experiment_id],
                filter_string=f"tags.recipe = '{recipe_name}' and tags.step = 'flow'",
                max_results=1,
                order_by=["attributes.start_time DESC"],
            )
        return runs[0].info.run_id if runs else None

    def download_artifacts(self, run_id: str, path: str, dst: str | os.PathLike | None = None) -> str:
        with _LOCK:
            return self.client.download_artifacts(run_id, path, str(dst) if dst else tempfile.mkdtemp())


@functools.lru_cache(maxsize=8)
def _client(uri: str):
    import logging

    from mlflow import MlflowClient

    # MLflow logs its first-time database migrations at INFO: keep the console readable.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)
