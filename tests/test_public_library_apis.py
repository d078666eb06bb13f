"""anyattn uses FlashInfer and Triton through their public APIs only: no module of `src/anyattn`
imports `flashinfer.jit`, `triton.runtime` or `triton.knobs`, nor any underscore-prefixed name
of either library (module, imported name, or attribute reached from one), so that a new release
of either cannot break anyattn through internals it never promised to keep."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import anyattn

SOURCE = Path(anyattn.__file__).parent
LIBRARIES = ("flashinfer", "triton")
FORBIDDEN_MODULES = ("flashinfer.jit", "triton.runtime", "triton.knobs")
# `flashinfer._x`, `triton.language._x`, `tl._x` ... written in the code
PRIVATE_ATTRIBUTE = re.compile(r"\b(?:flashinfer|triton|tl)(?:\.[A-Za-z]\w*)*\._\w")


def _is_forbidden(module: str) -> bool:
    parts = module.split(".")
    if parts[0] not in LIBRARIES:
        return False
    return any(module == m or module.startswith(m + ".") for m in FORBIDDEN_MODULES) or any(
        p.startswith("_") for p in parts
    )


def violations(source: str, name: str) -> list[str]:
    """Each private or forbidden use of FlashInfer or Triton in `source` (a module's text)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{name}:{node.lineno}: import {a.name}" for a in node.names
                      if _is_forbidden(a.name)]  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _is_forbidden(node.module):
                found.append(f"{name}:{node.lineno}: from {node.module} import ...")
            elif node.module.split(".")[0] in LIBRARIES:
                found += [
                    f"{name}:{node.lineno}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") or _is_forbidden(f"{node.module}.{a.name}")
                ]
    for number, line in enumerate(source.splitlines(), 1):
        code = line.split("#", 1)[0]
        if PRIVATE_ATTRIBUTE.search(code):
            found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_the_check_finds_what_it_forbids():
    bad = (
        "import flashinfer.jit\nfrom flashinfer.jit import env\nfrom triton import knobs\n"
        "from triton.runtime.driver import driver\nfrom flashinfer.decode import _plan\n"
        "import triton._C\nx = flashinfer.prefill._get_module()\ny = tl._core\n"
    )
    flagged = {int(v.split(":")[1]) for v in violations(bad, "bad.py")}
    assert flagged == set(range(1, 9))
    good = (
        "import flashinfer\nfrom flashinfer.decode import xqa_batch_decode_with_kv_cache\n"
        "import triton\nimport triton.language as tl\nx = triton.cdiv(1, 2)\ny = self._x\n"
    )
    assert violations(good, "good.py") == []


def test_no_module_uses_private_flashinfer_or_triton_apis():
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        found += violations(path.read_text(), str(path.relative_to(SOURCE)))
    assert found == [], "\n".join(found)
