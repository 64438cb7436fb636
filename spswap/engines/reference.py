"""The reference engine: a small deterministic torch transformer that spswap swaps in
tests and the demo, on CPU or CUDA, exactly as it swaps vLLM on a GPU node.

Cold path: :meth:`ReferenceEngine.load_from_checkpoint` reads ``model.safetensors``.
Pool path: :meth:`ReferenceEngine.load_from_pool` maps the pool entry (kept mapped and in
use for the engine's life, registered with CUDA once) and copies from it. ``sleep`` frees
every weight's storage (device memory really returned); ``wake`` re-allocates it and
copies back from the mapping. On the CPU nothing is copied: the weights are the pool's own
pages, mapped read-only (:mod:`spswap.transfer.bind`), and ``sleep`` / ``wake`` unbind and
bind them again.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spswap.engines.protocol import EngineInfo
from spswap.engines.reference_model import Decoder, ReferenceConfig, build, init_weights
from spswap.errors import EngineError, RequestAborted, RequestRejected
from spswap.instance.state import Instance, Primitive, State
from spswap.pool.manifest import Manifest, padded_size_bytes
from spswap.transfer.bind import bind_views, unbind
from spswap.transfer.copy import TransferReport, copy_into
from spswap.transfer.dtypes import to_safetensors, to_torch
from spswap.transfer.mapping import MappedEntry

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
ENGINE_KIND = "reference"


def save_checkpoint(config: ReferenceConfig, directory: Path) -> Path:
    """Write ``model.safetensors`` (weights from ``config.seed``) and ``config.json``
    into ``directory``; returns the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=2) + "\n")
    weights = directory / WEIGHTS_FILE
    save_file(init_weights(config), str(weights), metadata={"format": "pt"})
    # safetensors writes 0600 whatever the umask: the weights as readable as their config
    # (a model one user makes, the group's jobs serve)
    os.chmod(weights, (directory / CONFIG_FILE).stat().st_mode & 0o777)
    return directory


def load_config(directory: Path) -> ReferenceConfig:
    """The config saved next to a reference checkpoint."""
    path = Path(directory) / CONFIG_FILE
    try:
        return ReferenceConfig.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise EngineError(
            f"{path} not found: a reference model directory holds {WEIGHTS_FILE} and "
            f"{CONFIG_FILE} (make one with `spswap models make DIR --preset small`)"
        ) from None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


CPU_THREADS_ENV = "SPSWAP_CPU_THREADS"


def set_cpu_threads(env: dict[str, str] | None = None) -> int:
    """Torch's CPU threads for this process: ``$SPSWAP_CPU_THREADS``, default 1. The
    reference models are small, and torch's default (one thread per core, spinning while
    it waits) made a 50-token answer 10x slower (5.0 s against 0.48 s, measured on a
    2-core node) as soon as other processes shared the cores, as jobs on a node do."""
    raw = (os.environ if env is None else env).get(CPU_THREADS_ENV, "1")
    try:
        threads = max(1, int(raw))
    except ValueError:
        raise EngineError(f"{CPU_THREADS_ENV}={raw!r} is not a number of threads; set e.g. "
                          f"{CPU_THREADS_ENV}=2") from None  # fmt: skip
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def _brief(ids: list[int], shown: int = 16) -> str:
    """A prompt in an error message, cut to its first ``shown`` ids."""
    return str(ids) if len(ids) <= shown else f"{ids[:shown]}... ({len(ids)} ids)"


class ReferenceEngine:
    """One reference model in this process. Not thread-safe."""

    def __init__(
        self, config: ReferenceConfig, device: str | torch.device | None = None,
        *, name: str = "reference",
    ) -> None:  # fmt: skip
        self.config = config
        self.device = torch.device(device if device is not None else default_device())
        self.name = name
        if self.device.type == "cpu":
            set_cpu_threads()
        self.instance = Instance(name=name, state=State.UP)
        self._model: Decoder | None = None
        self._mapping: MappedEntry | None = None
        self._pool_stack = contextlib.ExitStack()
        self._source = ""

    # -- loading ------------------------------------------------------------------------
    def load_from_checkpoint(self, path: Path) -> float:
        """Cold path: read a safetensors checkpoint (a file, or a directory holding
        ``model.safetensors``) onto the device; returns seconds."""
        from safetensors import safe_open

        path = Path(path)
        file = path / WEIGHTS_FILE if path.is_dir() else path
        if not file.is_file():
            raise EngineError(f"checkpoint {file} not found")
        start = time.perf_counter()
        self._release()
        model = build(self.config, self.device)
        params = dict(model.named_parameters())
        # Read every tensor into the engine's own memory, as a real engine does (a CPU
        # load_file would hand back lazy mmap-backed tensors and time nothing).
        with safe_open(str(file), framework="pt", device="cpu") as f:
            expected = {n: (tuple(p.shape), p.dtype) for n, p in params.items()}
            got = {}
            for n in f.keys():
                sl = f.get_slice(n)
                got[n] = (tuple(sl.get_shape()), to_torch(sl.get_dtype()))
            if got != expected:
                diff = sorted(set(expected.items()) ^ set(got.items()))[:5]
                raise EngineError(
                    f"{file} does not match the reference config {self.config}: first "
                    f"differences {diff}; load it with the config saved next to it "
                    "(load_config)"
                )
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(f.get_tensor(n))
        self._model = model
        self._sync()
        self._source = str(file)
        self.instance = Instance(name=self.name, state=State.UP)
        return time.perf_counter() - start

    def load_from_pool(self, pool: Any, ref: str) -> TransferReport:
        """Map pool entry ``ref`` (kept mapped and marked in use until :meth:`close`),
        allocate the weights on the device and copy them in."""
        self._release()
        stack = contextlib.ExitStack()
        try:
            manifest: Manifest = stack.enter_context(pool.use(ref))
            on_cpu = self.device.type == "cpu"
            # on the CPU the mapping's views become the weights: nothing to allocate
            model = build(self.config, "meta" if on_cpu else self.device)
            t0 = time.perf_counter()  # the weights' own time: mapped (CPU) or copied
            mapping = MappedEntry(manifest, pool.data_path(manifest), populate=on_cpu)
            stack.callback(mapping.close)
            report = (bind_views(mapping, model, since_s=t0) if on_cpu
                      else copy_into(mapping, dict(model.named_parameters())))  # fmt: skip
        except BaseException:
            stack.close()
            raise
        self._pool_stack, self._mapping, self._model = stack, mapping, model
        self._source = f"pool:{manifest.digest}"
        self.instance = Instance(name=self.name, state=State.UP)
        return report

    # -- Sleep <-> Up -----------------------------------------------------------------
    def sleep(self) -> float:
        """Up -> Sleep: free every weight's storage (the pool keeps the bytes); on the CPU
        drop the weights' binding to the pool's pages."""
        model = self._loaded()
        if self._mapping is None:
            raise EngineError(
                f"{self.name}: cannot sleep: its weights came from {self._source}, not the "
                "pool, so nothing could bring them back; load it with load_from_pool"
            )
        with self.instance.step(Primitive.SLEEP):
            self._sync()
            if self.device.type == "cpu":
                unbind(model)  # the pages are the pool's: nothing of the engine's to free
            else:
                for p in model.parameters():
                    p.untyped_storage().resize_(0)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the memory back to the driver
        return self.instance.last_duration_s

    def wake(self) -> TransferReport:
        """Sleep -> Up: re-allocate the weights and copy them back from the pool mapping (on
        the CPU: bind them to its pages again)."""
        model = self._loaded()
        assert self._mapping is not None  # sleep() refuses without one
        with self.instance.step(Primitive.WAKE):
            if self.device.type == "cpu":
                return bind_views(self._mapping, model)
            for p in model.parameters():
                p.untyped_storage().resize_(p.numel() * p.element_size())
            report = copy_into(self._mapping, dict(model.named_parameters()))
        return report

    @property
    def state(self) -> State:
        return self.instance.state

    # -- serving ------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int,
                 abort: Callable[[], bool] | None = None) -> list[list[int]]:  # fmt: skip
        """Greedy continuations (new tokens only), one prompt at a time; ``abort`` is asked
        before each token (a stopping server's drain limit) and raises RequestAborted.

        Deterministic for identical weights on one device: the ops (matmul, softmax,
        argmax, embedding lookup) take the same kernels for the same shapes, and no
        global determinism flag is flipped that would leak into the host process.
        """
        model = self._loaded()
        if self.state is not State.UP:
            raise EngineError(
                f"{self.name} is {self.state.value}: its weights are not on the device; "
                "wake it first"
            )
        c = self.config
        for prompt in prompt_ids:
            if not prompt:
                raise RequestRejected("an empty prompt has nothing to continue; give a token")
            if len(prompt) + max_new_tokens > c.max_seq_len:
                raise RequestRejected(
                    f"prompt of {len(prompt)} tokens + {max_new_tokens} new is more than the "
                    f"model's {c.max_seq_len} positions; ask for fewer (`spswap ask "
                    "--max-new-tokens`, max_tokens in an OpenAI request) or serve a model "
                    "made with more (`spswap models make --preset 1g`: 512)"
                )
            if min(prompt) < 0 or max(prompt) >= c.vocab_size:
                raise RequestRejected(
                    f"token ids must lie in [0, {c.vocab_size}) for this "
                    f"model; got {_brief(prompt)}"
                )
        # Prompts of one length run as one batch: no padding, so no mask subtleties.
        by_len: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompt_ids):
            by_len.setdefault(len(prompt), []).append(i)
        out: list[list[int]] = [[] for _ in prompt_ids]
        for idx in by_len.values():
            ids = torch.tensor([prompt_ids[i] for i in idx], dtype=torch.long, device=self.device)
            for _ in range(max_new_tokens):
                if abort is not None and abort():
                    raise RequestAborted("stopped unfinished: the server is stopping")
                nxt = model(ids).argmax(dim=-1)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
            for row, i in enumerate(idx):
                out[i] = ids[row, len(prompt_ids[i]) :].tolist()
        return out

    # -- export, health, teardown -----------------------------------------------------------
    def export_weights(self, pool: Any, name: str) -> Manifest:
        """Write the current weights as pool entry ``name``; returns its manifest."""
        model = self._loaded()
        if self.state is not State.UP:
            raise EngineError(f"{self.name} is {self.state.value}: wake it before exporting")
        params = dict(model.named_parameters())
        identity = {"engine": ENGINE_KIND, "config": self.config.to_json()}
        # Each tensor starts on an aligned offset: reserve the padded size.
        total = padded_size_bytes(p.numel() * p.element_size() for p in params.values())
        with pool.writer(name, identity=identity, expected_size_bytes=total) as w:
            for pname in sorted(params):
                p = params[pname]
                raw = p.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
                w.add(pname, to_safetensors(p.dtype), tuple(p.shape), raw)
        manifest: Manifest = w.manifest
        return manifest

    def health(self) -> EngineInfo:
        """State, device and footprint now."""
        params = list(self._model.parameters()) if self._model is not None else []
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        mapped = self.device.type == "cpu" and self._mapping is not None
        if mapped:  # views of the pool's pages (each one's storage is the whole mapping)
            resident_bytes = weight_bytes if self.state is State.UP else 0
        else:
            resident_bytes = sum(p.untyped_storage().nbytes() for p in params)
        return EngineInfo(
            name=self.name, kind=ENGINE_KIND, device=str(self.device), state=self.state,
            weight_bytes=weight_bytes, resident_bytes=resident_bytes, source=self._source,
            details={"loaded": self._model is not None, "mapped": mapped,
                     "registered": bool(self._mapping and self._mapping.registered)},
        )  # fmt: skip

    def close(self) -> None:
        """Drop the weights, unmap the pool entry and stop using it."""
        self._release()

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self) -> None:
        self._model = None
        self._mapping = None
        self._pool_stack.close()
        self._pool_stack = contextlib.ExitStack()
        self._source = ""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _loaded(self) -> Decoder:
        if self._model is None:
            raise EngineError(
                f"{self.name} holds no weights: call load_from_checkpoint or load_from_pool"
            )
        return self._model

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
