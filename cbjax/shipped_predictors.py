"""The output-length predictors cbjax ships (`cbjax/data/length_predictors/NAME/`, each with a
README.md saying how it was made), found by the name of the model they were made for."""

from __future__ import annotations

import os

PREDICTOR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "length_predictors")


def shipped() -> list[str]:
    """The names of the shipped predictors."""
    return sorted(n for n in os.listdir(PREDICTOR_DIR) if os.path.isdir(os.path.join(PREDICTOR_DIR, n)))


def predictor_dir(name_or_path: str | os.PathLike) -> str:
    """A predictor checkpoint's directory: `name_or_path` itself when it is a directory, else the
    shipped predictor of that name ("smollm2-135m"); unchanged when it is neither (the loader
    then says what is missing)."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return path
    if os.sep not in path and os.path.isdir(os.path.join(PREDICTOR_DIR, path)):
        return os.path.join(PREDICTOR_DIR, path)
    return path
