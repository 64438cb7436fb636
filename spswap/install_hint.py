"""The command that adds an optional part (a pip extra: ``vllm``, ``gpu``) to this
installation of spswap, for the messages that say one is missing; and the refusal of a
command that runs vLLM where vLLM or a GPU (or both) is missing.

spswap is installed from its checkout (``scripts/install.sh``: ``pip install -e``), not
from a package index, so ``pip install 'spswap[vllm]'`` would find nothing: the message
names this Python and this checkout instead.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def pip_install_text(extra: str, python: str, checkout: Path | None) -> str:
    """The command for ``extra``: through ``python``, from ``checkout`` (the directory
    with spswap's pyproject.toml) where spswap runs from one, else by name. Pure.

    >>> pip_install_text("vllm", "/opt/spswap/venv/bin/python", Path("/opt/spswap"))
    "/opt/spswap/venv/bin/python -m pip install -e '/opt/spswap[vllm]'"
    >>> pip_install_text("gpu", "/usr/bin/python3", None)
    "/usr/bin/python3 -m pip install 'spswap[gpu]'"
    """
    target = f"{checkout}[{extra}]" if checkout is not None else f"spswap[{extra}]"
    editable = "-e " if checkout is not None else ""
    return f"{shlex.quote(python)} -m pip install {editable}{shlex.quote(target)}"


def pip_install_hint(extra: str) -> str:
    """:func:`pip_install_text` for the running Python and spswap's own checkout."""
    top = Path(__file__).resolve().parents[1]
    checkout = top if (top / "pyproject.toml").is_file() else None
    return pip_install_text(extra, sys.executable, checkout)


def needs_text(what: str, missing: str, pip_hint: str, why: str | None = None) -> str:
    """Why ``what`` cannot run: ``missing`` (a part such as torch) is not installed here,
    with the ImportError's text ``why`` where there is one, and the command that adds it.
    Pure.

    >>> needs_text("the demo", "torch", "pip ...", "No module named 'torch'")
    "the demo needs torch, which is not installed here (No module named 'torch'): ..."
    """
    seen = f" ({why})" if why else ""
    return (f"{what} needs {missing}, which is not installed here{seen}: install it with "
            f"`{pip_hint}`")  # fmt: skip


def needs_torch(what: str, error: ImportError | None = None) -> str:
    """:func:`needs_text` for torch (spswap's ``torch`` extra: torch, safetensors, numpy;
    ``error`` names the module that was missing)."""
    return needs_text(what, "torch", pip_install_hint("torch"), str(error) if error else None)


def vllm_gpu_refusal(what: str, *, has_vllm: bool, has_gpu: bool, pip_hint: str) -> str | None:
    """Why ``what`` (a command that runs vLLM) cannot run here, naming what is missing and
    the fix for each (None: both are here). ``pip_hint``: the command that adds vLLM.
    Pure.

    >>> vllm_gpu_refusal("bench swap", has_vllm=True, has_gpu=False, pip_hint="pip ...")
    'bench swap needs a CUDA GPU and none is visible here: run it on a GPU node'
    """
    if has_vllm and has_gpu:
        return None
    if not has_gpu and not has_vllm:
        return (f"{what} needs vLLM and a CUDA GPU, and this machine has neither: run it on "
                f"a GPU node with vLLM installed (`{pip_hint}`)")  # fmt: skip
    if not has_gpu:
        return f"{what} needs a CUDA GPU and none is visible here: run it on a GPU node"
    return f"{what} needs vLLM, which is not installed here: install it with `{pip_hint}`"
