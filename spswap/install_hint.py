"""The command that adds an optional part (a pip extra: ``vllm``, ``gpu``; torch through
the install script) to this installation of spswap, for the messages that say one is
missing; and the refusal of a command that runs vLLM where vLLM or a GPU (or both) is
missing.

spswap is installed from its checkout (``scripts/install.sh``: ``pip install -e``), not
from a package index, so ``pip install 'spswap[vllm]'`` would find nothing: the message
names this Python and this checkout instead.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

TORCH_PARTS = ("torch", "safetensors", "numpy")  # spswap's ``torch`` extra (pyproject.toml)


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


def not_yours_text(writable: bool) -> str:
    """What to add to an install command where this installation (its Python's prefix)
    is not the user's to change (``writable``: it is): a user of a site's install runs
    no pip there. Pure.

    >>> not_yours_text(False)
    '; this installation is not yours to change: ask its admin'
    """
    return "" if writable else "; this installation is not yours to change: ask its admin"


def prefix_writable() -> bool:
    """Whether this Python's installation may be changed by this process's user."""
    import os

    return os.access(sys.prefix, os.W_OK)


def torch_install_text(prefix: str, base_prefix: str, script: Path | None,
                       pip_text: str) -> str:  # fmt: skip
    """The command that adds torch to this installation: the install ``script`` of
    spswap's checkout again (None: there is none) where spswap runs in a venv (``prefix``
    differs from ``base_prefix``): it installs the torch build spswap is tested with
    (``SPSWAP_TORCH`` picks another), where a plain ``pip install`` of the extra takes
    whatever build the index has, CUDA's libraries included; else ``pip_text``. Pure.

    >>> torch_install_text("/opt/spswap/venv", "/usr", Path("/opt/spswap/scripts/install.sh"),
    ...                    "pip ...")
    'SPSWAP_VENV=/opt/spswap/venv bash /opt/spswap/scripts/install.sh'
    >>> torch_install_text("/usr", "/usr", Path("/opt/spswap/scripts/install.sh"), "pip ...")
    'pip ...'
    """
    if script is None or prefix == base_prefix:
        return pip_text
    return f"SPSWAP_VENV={shlex.quote(prefix)} bash {shlex.quote(str(script))}"


def torch_install_hint() -> str:
    """:func:`torch_install_text` for the running Python and spswap's own checkout."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "install.sh"
    return torch_install_text(sys.prefix, sys.base_prefix, script if script.is_file() else None,
                              pip_install_hint("torch"))  # fmt: skip


def needs_text(what: str, parts: str, install: str, why: str | None = None) -> str:
    """Why ``what`` cannot run: ``parts`` (what an install adds) are not all here, with
    the ImportError's text ``why`` (which module was missing) where there is one, and the
    ``install`` command that adds them. Pure.

    >>> needs_text("the demo", "torch", "pip ...", "No module named 'torch'")
    "the demo needs torch, missing here (No module named 'torch'): install it with `pip ...`"
    """
    seen = f" ({why})" if why else ""
    them = "them" if " and " in parts else "it"
    return f"{what} needs {parts}, missing here{seen}: install {them} with `{install}`"


def missing_torch_part() -> str | None:
    """The first of :data:`TORCH_PARTS` that cannot be imported here, or None."""
    return next((m for m in TORCH_PARTS if importlib.util.find_spec(m) is None), None)


def needs_torch(what: str, error: ImportError | None = None) -> str:
    """:func:`needs_text` for spswap's ``torch`` extra (:data:`TORCH_PARTS`), with
    :func:`torch_install_text`; ``error`` (else :func:`missing_torch_part`) names the
    module that was missing."""
    if error is not None:
        why: str | None = str(error)
    else:
        missing = missing_torch_part()
        why = f"No module named {missing!r}" if missing else None
    parts = f"{', '.join(TORCH_PARTS[:-1])} and {TORCH_PARTS[-1]}"
    return needs_text(what, parts, torch_install_hint(), why)


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
