"""spswap's own errors reach the user as one clear line, printed as written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_error_text_is_not_taken_for_markup(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "bench", "swap", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    # rich would take "[vllm]" for markup and drop it; the command is this install's own
    # (from its checkout: there is no package index to install spswap[vllm] from)
    repo = Path(__file__).resolve().parents[1]
    assert "error:" in proc.stderr, proc.stderr
    assert f"-m pip install -e '{repo}[vllm]'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_setting_names_the_valid_ones(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "status"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "SPSWAP_ROTO": "/x", "SPSWAP_ROOT": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert "unknown setting SPSWAP_ROTO" in proc.stderr and "SPSWAP_ROOT" in proc.stderr


def test_serve_options_after_the_dashes_are_for_vllm(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    base = [
        sys.executable,
        "-m",
        "spswap.cli",
        "serve",
        str(tmp_path),
        "--state-dir",
        str(tmp_path / "s"),
        "--root",
        str(tmp_path / "root"),
    ]
    proc = subprocess.run(
        [*base, "--", "--max-num-seqs", "4"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "for --engine vllm only" in proc.stderr, proc.stderr
    proc = subprocess.run(
        [*base, "--engine", "vllm", "--", "--port", "9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "set by spswap serve" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_empty_state_dir_is_refused_not_taken_as_the_current_directory(tmp_path):
    """`--state-dir "$STATE"` with STATE unset: the job's state would land in its working
    directory; refused, with what to do, and nothing written there."""
    for cmd in (["serve", str(tmp_path)], ["ask", "1,2"]):
        proc = subprocess.run(
            [sys.executable, "-m", "spswap.cli", *cmd, "--state-dir", ""],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin", "SPSWAP_ROOT": str(tmp_path / "root"),
                 "COLUMNS": "200"},
        )  # fmt: skip
        assert proc.returncode == 2, (cmd, proc.stderr)
        assert "'--state-dir': is empty (an unset shell variable?)" in proc.stderr, proc.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == [], cmd


def test_a_failure_under_json_prints_one_json_object_on_stdout(tmp_path):
    """A script that asked for --json reads the refusal as JSON; the text stays on stderr."""
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "SPSWAP_ROTO": "/x", "SPSWAP_ROOT": str(tmp_path)},
    )
    assert proc.returncode == 2
    err = json.loads(proc.stdout)["error"]
    assert err["kind"] == "ConfigError" and err["exit_code"] == 2
    assert "unknown setting SPSWAP_ROTO" in err["message"]
    assert "unknown setting SPSWAP_ROTO" in proc.stderr


def test_error_json_is_the_class_message_and_exit_code():
    from spswap.cli.common import error_json
    from spswap.cli.serve_app import asked_json

    assert asked_json(["images", "rm", "5", "--json"]) and not asked_json(["status"])
    assert not asked_json(["serve", "M", "--engine", "vllm", "--", "--json"])  # vLLM's
    from spswap.errors import PermissionDenied

    assert error_json(PermissionDenied("ask root")) == {
        "error": {"kind": "PermissionDenied", "message": "ask root", "exit_code": 3}
    }


def test_a_path_this_user_cannot_use_is_one_clear_error_not_a_traceback(tmp_path):
    """The walk: `spswap status --json --root DIR` as a user on root's directory gave a
    PermissionError traceback and no JSON."""
    from spswap.cli.serve_app import path_error

    denied = path_error(PermissionError(13, "Permission denied", "/root/spx/pool/index.json"))
    assert type(denied).__name__ == "PermissionDenied" and denied.exit_code == 3
    assert str(denied) == ("cannot use /root/spx/pool/index.json: permission denied; run as "
                           "root, or give a --root (SPSWAP_ROOT) this user may read")  # fmt: skip
    missing = path_error(FileNotFoundError(2, "No such file or directory", "/proc/1/slots"))
    assert type(missing).__name__ == "PathUnusable" and str(missing).startswith(
        "cannot use /proc/1/slots: no such file or directory; check the path"
    )
    assert path_error(OSError(28, "No space left on device")) is None  # not about a path
    assert path_error(ConnectionRefusedError(111, "refused")) is None


def test_status_under_root_s_proc_says_what_to_check(tmp_path):
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "status", "--json", "--root", "/proc/1"],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    err = json.loads(proc.stdout)["error"]
    assert err["message"].startswith("cannot use /proc/1/"), err


def _bench_json(*args: str, env: dict[str, str] | None = None, pre: str = "") -> tuple[int, dict]:
    """``spswap bench ARGS --json`` in a child Python (``pre``: code run first); its exit
    status and its JSON error."""
    import json

    argv = ["spswap", "bench", *args, "--json"]
    code = f"{pre}\nimport sys\nfrom spswap.cli.main import main\nsys.argv = {argv!r}\nmain()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)["error"]


def test_bench_transfer_on_a_device_this_machine_lacks_says_so_in_json(tmp_path):
    import pytest

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    rc, error = _bench_json("transfer", "--device", "cuda:0", "--sizes", "1M",
                            "--scratch-dir", str(tmp_path))  # fmt: skip
    assert rc == 2
    assert error["kind"] == "ConfigError" and error["message"].startswith("--device cuda:0: ")
    assert "use --device cpu" in error["message"]
    assert not list(tmp_path.iterdir())  # refused before any scratch was made


def test_bench_transfer_refuses_a_zero_size_a_wrong_device_and_a_missing_root(tmp_path):
    """A newcomer's typos got a traceback (ZeroDivisionError, torch's RuntimeError), even
    with --json; a missing --root named a generated path and SPSWAP_ROOT."""
    import pytest

    pytest.importorskip("torch")
    cases = [
        (["--sizes", "0"], "--sizes: every size must be above zero"),
        (["--sizes", "1M,0"], "--sizes: every size must be above zero"),
        (["--device", "gpu"], "--device gpu: not a device; give cpu, cuda or cuda:N"),
        (
            ["--scratch-dir", str(tmp_path / "nope")],
            f"--scratch-dir {tmp_path / 'nope'}: no such directory",
        ),
    ]
    for extra, said in cases:
        args = {"--sizes": "1M", "--device": "cpu", "--scratch-dir": str(tmp_path)}
        args.update(dict(zip(extra[::2], extra[1::2], strict=True)))
        rc, error = _bench_json("transfer", *[w for kv in args.items() for w in kv])
        assert rc == 2, (extra, error)
        assert error["kind"] == "ConfigError" and error["message"].startswith(said), error
    assert not list(tmp_path.iterdir())  # refused before any scratch was made


def test_device_problem_takes_cpu_cuda_and_an_index_only():
    from spswap.cli.bench_inputs import device_problem

    assert [device_problem(d) for d in ("cpu", "cuda", "cuda:0", "cuda:12")] == [None] * 4
    assert device_problem("gpu") == (
        "--device gpu: not a device; give cpu, cuda or cuda:N (a GPU's index, e.g. cuda:0)"
    )
    assert device_problem("cuda:x") is not None and device_problem("CPU") is not None


def test_a_vllm_command_names_what_is_missing_vllm_a_gpu_or_both():
    from spswap.install_hint import vllm_gpu_refusal

    def said(vllm: bool, gpu: bool) -> str | None:
        return vllm_gpu_refusal("bench swap", has_vllm=vllm, has_gpu=gpu, pip_hint="PIP")

    assert said(True, True) is None
    assert said(False, False) == (
        "bench swap needs vLLM and a CUDA GPU, and this machine has neither: run it on a GPU "
        "node with vLLM installed (`PIP`)"
    )
    assert said(True, False) == (
        "bench swap needs a CUDA GPU and none is visible here: run it on a GPU node"
    )
    assert said(False, True) == (
        "bench swap needs vLLM, which is not installed here: install it with `PIP`"
    )


def test_bench_swap_on_this_cpu_machine_says_what_it_lacks(tmp_path):
    import pytest

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    (tmp_path / "m").mkdir()
    rc, error = _bench_json("swap", str(tmp_path / "m"))
    assert rc == 2
    message = error["message"]
    assert message.startswith("bench swap needs ") and "GPU" in message, message


def test_bench_turns_refuses_an_unknown_engine_before_slurm_or_any_file(tmp_path):
    """Its own twin of the engine check said "--engine must be reference or vllm"; now the
    one every command uses, before it looks for Slurm or writes a model."""
    env = {**os.environ, "PATH": str(tmp_path)}  # no Slurm: the engine is refused first
    rc, error = _bench_json("turns", "--engine", "vlm", "--work-dir", str(tmp_path / "work"),
                            env=env)  # fmt: skip
    assert rc == 2
    assert error["kind"] == "ConfigError"
    assert error["message"] == "unknown engine 'vlm'; valid engines: reference, vllm"
    assert not (tmp_path / "work").exists()


def test_bench_traffic_without_torch_names_the_install_not_a_traceback(tmp_path):
    """A walk on a --no-torch install: ModuleNotFoundError from the reference models."""
    rc, error = _bench_json(
        "traffic", "--root", str(tmp_path), pre="import sys; sys.modules['torch'] = None"
    )
    assert rc == 2 and error["kind"] == "ConfigError", error
    assert error["message"].startswith(
        "bench traffic needs torch, safetensors and numpy, missing here (No module named "
        "'torch'): install them with `"
    ), error


def test_bench_traffic_and_swap_with_vllm_say_what_this_machine_lacks(tmp_path):
    import pytest

    pytest.importorskip("torch")
    from spswap.engines.vllm_engine import available

    if available():
        pytest.skip("vLLM is installed here")
    import torch

    lacks = ("vLLM, which is not installed here" if torch.cuda.is_available()
             else "vLLM and a CUDA GPU, and this machine has neither")  # fmt: skip
    rc, error = _bench_json("traffic", "--engine", "vllm", "--root", str(tmp_path))
    assert rc == 2 and error["kind"] == "ConfigError", error
    assert error["message"].startswith(f"bench traffic --engine vllm needs {lacks}"), error
    assert error["message"].endswith("; or use --engine reference, which runs on CPU"), error
    rc, error = _bench_json("swap", str(tmp_path))
    assert rc == 2 and error["message"].startswith(f"bench swap needs {lacks}"), error


def test_bench_turns_with_vllm_and_no_models_says_so_before_asking_slurm(tmp_path):
    """It asked `scontrol ping` first: a user fixed Slurm, then learned MODELS was missing."""
    env = {**os.environ, "PATH": str(tmp_path)}  # no Slurm
    rc, error = _bench_json("turns", "--engine", "vllm", "--work-dir", str(tmp_path / "w"),
                            env=env)  # fmt: skip
    assert rc == 2 and error["message"].startswith("--engine vllm needs MODELS: "), error


def test_every_command_that_needs_torch_says_so_in_the_same_words(tmp_path):
    """On an install without torch (`install.sh --no-torch`): the commands that move
    tensors end with the same sentence, naming the missing module and the install, and
    with --json's error object."""
    import json

    blocked = "import sys; sys.modules['torch'] = None"
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 8}))
    commands = {
        "making a reference model": ["models", "make", str(tmp_path / "new")],
        "the reference engine": ["serve", str(model), "--state-dir", str(tmp_path / "s")],
        "the demo": ["demo", "--root", str(tmp_path / "d")],
        "bench transfer": ["bench", "transfer", "--scratch-dir", str(tmp_path / "b")],
    }
    for what, argv in commands.items():
        code = f"{blocked}\nimport sys\nfrom spswap.cli.main import main\nsys.argv = " \
               f"{['spswap', *argv, '--json']!r}\nmain()"  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        said = " ".join(proc.stderr.split())
        assert proc.returncode == 2 and "Traceback" not in said, (argv, said)
        # --json: the error object on stdout (the demo printed only a line, on stderr)
        assert json.loads(proc.stdout)["error"]["kind"] == "ConfigError", (argv, proc.stdout)
        assert f"{what} needs torch, safetensors and numpy, missing here (" in said, \
            (argv, said)  # fmt: skip
        # this checkout's install script into this venv (or pip's torch extra outside one)
        install = (f"install them with `SPSWAP_VENV={sys.prefix} bash " if sys.prefix !=
                   sys.base_prefix else "install them with `")  # fmt: skip
        assert install in said and ("install.sh`" in said or "[torch]" in said), (argv, said)
    assert not (tmp_path / "new").exists() and not (tmp_path / "d").exists()


def test_vllm_missing_tells_a_user_of_a_site_install_to_ask_its_admin(monkeypatch) -> None:
    """A walk as a normal user was told to run pip in root's venv."""
    import importlib.util

    from spswap.errors import EngineError
    from spswap.serve import vllm_api

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    for writable, said in ((False, True), (True, False)):
        monkeypatch.setattr(vllm_api, "prefix_writable", lambda w=writable: w)
        with pytest.raises(EngineError) as e:
            vllm_api.installed_vllm_version()
        assert ("`; this installation is not yours to change: ask its admin); without a GPU"
                in str(e.value)) is said, str(e.value)  # fmt: skip
