"""`spswap serve --models A B C` as a process: the socket, TCP with the key, SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("torch")

from spswap.engines.reference import save_checkpoint  # noqa: E402
from spswap.engines.reference_model import preset  # noqa: E402
from spswap.multi import http_api  # noqa: E402
from tests.helpers.reference import cold_answers  # noqa: E402


def test_serve_models_socket_tcp_and_stop(tmp_path):
    models = [save_checkpoint(preset("tiny", seed=7 + i), tmp_path / f"m{i}") for i in range(3)]
    sock = tmp_path / "sock" / "api.sock"
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root")}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spswap.cli", "serve", "--models", *map(str, models),
         "--state-dir", str(tmp_path / "state"), "--socket", str(sock), "--device", "cpu",
         "--port", "0", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port, seen = None, []
        for line in proc.stderr:  # type: ignore[union-attr]
            seen.append(line)
            m = re.search(r"also on 127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port is not None, "".join(seen)
        # this run put the models into the pool: its log says so (then "up from the pool")
        for i in range(3):
            read = [n for n, line in enumerate(seen)
                    if f"m{i} read from its files into the pool in " in line]  # fmt: skip
            up = [n for n, line in enumerate(seen) if f"m{i} up from the pool" in line]
            assert len(read) == 1 and len(up) == 1 and read[0] < up[0], "".join(seen)
        status, raw = http_api.request(sock, "GET", "/v1/models")
        assert [(m["id"], m["state"]) for m in json.loads(raw)["data"]] == [
            ("m0", "awake"),
            ("m1", "awake"),
            ("m2", "asleep"),
        ]
        # a walk read "m2 up from the pool" and found it asleep: the serving line says so
        said = f"serving 3 models on {sock} (2 awake at once; awake: m0, m1; asleep until "
        assert any(said + "asked: m2)" in line for line in seen), "".join(seen)
        assert (sock.stat().st_mode & 0o777) == 0o600
        # `spswap ask` has no spool to use here: it says so at once, with the way that works
        asked = subprocess.run(
            [sys.executable, "-m", "spswap.cli", "ask", "1,2,3", "--state-dir",
             str(tmp_path / "state"), "--timeout-s", "600"],
            env={**env, "COLUMNS": "400"}, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert asked.returncode == 1, asked.stderr
        assert "this job serves several models (spswap serve --models)" in asked.stderr
        assert f"curl --unix-socket {sock} http://localhost/v1/completions" in asked.stderr
        key = (tmp_path / "state" / "api_key").read_text().strip()
        body = json.dumps({"model": "m2", "prompt": [5, 6, 7], "max_tokens": 5}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Authorization": f"Bearer {key}",
                                              "Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["choices"][0]["token_ids"] == cold_answers(models[2], [[5, 6, 7]], 5)[0]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")  # no key
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(req, timeout=10)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert json.loads(out)["stopped_by"] == "SIGTERM"
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _vllm_model(d):
    """A Hugging Face-style directory (a config and a small weights file: refused before
    the weights are read)."""
    import torch
    from safetensors.torch import save_file

    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize(("device", "said"), [
    ("cpu", "--engine vllm runs on a GPU, not on 'cpu'"),
    ("cuda", "vLLM is not installed here (no vllm package metadata); it runs on a node with a "
             "CUDA GPU: there, install it ("),
    ("cuda", "without a GPU, try spswap on a model of its reference engine (`spswap models "
             "make --preset tiny DIR`, then `spswap serve DIR`)"),
])  # fmt: skip
def test_serve_models_vllm_is_refused_with_the_fix_before_the_pool(tmp_path, device, said):
    from spswap.engines.vllm_engine import available

    if device == "cuda" and available():
        pytest.skip("vLLM is installed here: it would start")
    models = [_vllm_model(tmp_path / n) for n in ("a", "b")]
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root")}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "serve", "--models", *map(str, models),
         "--engine", "vllm", "--device", device, "--kv-cache-gib", "1",
         "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock")],
        env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "root").glob("pool/*/manifest.json"))


def test_serve_models_refuses_the_batch_options_before_anything_starts(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root"), "COLUMNS": "300"}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "serve", "--models", str(tmp_path / "a"),
         str(tmp_path / "b"), "--exit-when-idle", "--state-dir", str(tmp_path / "state")],
        env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--requests and --exit-when-idle are a single model's batch job's" in proc.stderr
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("many", [True, False])
def test_units_a_slot_cannot_have_are_refused_before_anything_starts(tmp_path, many):
    # a slot is a quarter, half or whole GPU: 3 was taken, then refused at the
    # reservation, after the model's import (with --models: "1 awake at once" first)
    models = [tmp_path / "a", tmp_path / "b"][: 2 if many else 1]
    for m in models:
        m.mkdir()
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root"), "COLUMNS": "300"}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "serve", *(["--models"] if many else []),
         *map(str, models), "--units", "3", "--state-dir", str(tmp_path / "state")],
        env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--units 3: give 1, 2 or 4 quarter-GPU units (a quarter, half or whole GPU)" in (
        proc.stderr
    ), proc.stderr
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("many", [True, False])
def test_pack_with_no_eager_is_refused_before_anything_starts(tmp_path, many):
    # vLLM's CUDA graphs hold the weights' addresses: --pack cannot be honoured there
    models = [_vllm_model(tmp_path / n) for n in ("a", "b")][: 2 if many else 1]
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root"), "COLUMNS": "300"}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "serve", *(["--models"] if many else []),
         *map(str, models), "--engine", "vllm", "--pack", "--no-eager",
         "--state-dir", str(tmp_path / "state")],
        env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        "--pack needs --eager: with --no-eager vLLM's CUDA graphs hold the weights' "
        "addresses" in proc.stderr
    ), proc.stderr
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("many", [True, False])
def test_a_socket_directory_others_can_write_is_refused_before_any_model_starts(tmp_path, many):
    """Refused after every model's cold start, a --socket in a shared directory cost the
    user minutes (two vLLM models: 75 s on the H200) for an error known at the start."""
    models = [save_checkpoint(preset("tiny", seed=3 + i), tmp_path / f"m{i}") for i in range(2)]
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root"), "COLUMNS": "300"}
    env.pop("SLURM_JOB_ID", None)
    what = ["--models", *map(str, models)] if many else [str(models[0])]
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "serve", *what, "--device", "cpu",
         "--state-dir", str(tmp_path / "state"), "--socket", str(shared / "api.sock")],
        env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert f"{shared} is not a private directory of yours" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "started" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "root").glob("pool/*/manifest.json"))


@pytest.mark.parametrize(("args", "said"), [
    (["/path/to/model-a"], "model directory /path/to/model-a does not exist (an sbatch "
     "template's MODEL= CHANGE line still has its example)"),
    (["--models", "/path/to/model-a", "/path/to/model-b"], "model directory /path/to/model-a "
     "does not exist (an sbatch template's MODELS= CHANGE line still has its example); after "
     "--models, every word that is not one of spswap serve's options is a model directory"),
    (["--models", "M0", "NOPE"], "model directory NOPE does not exist; after --models, every "
     "word that is not one of spswap serve's options is a model directory (vLLM's own "
     "options go in --vllm-args)"),
])  # fmt: skip
def test_a_model_path_that_does_not_exist_gets_one_message_wherever_it_stands(tmp_path, args, said):
    """The first of --models was typer's MODEL argument ("Invalid value for 'MODEL': dir
    ... does not exist"), the others "is not a model directory": one message now, naming
    the template's CHANGE line when its example path is still there."""
    m0 = save_checkpoint(preset("tiny", seed=3), tmp_path / "m0")
    args = [str(m0) if a == "M0" else str(tmp_path / "nope") if a == "NOPE" else a for a in args]
    said = said.replace("NOPE", str(tmp_path / "nope"))
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root"), "COLUMNS": "400"}
    env.pop("SLURM_JOB_ID", None)
    argv = [sys.executable, "-m", "spswap.cli", "serve", *args, "--state-dir",
            str(tmp_path / "state")]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert said in " ".join(proc.stderr.replace("│", " ").split()), proc.stderr


@pytest.mark.parametrize(("args", "said"), [
    # a newcomer's walk: "--unit" read as "options after -- are for --engine vllm only"
    # (no -- given), outside a job as "give --state-dir", in --models as a model directory
    (["M0", "--unit", "4"], "no such option: --unit (did you mean --units?)"),
    (["--modles", "M0"], "no such option: --modles (did you mean --models?)"),
    (["--models", "M0", "M0", "--unit", "2"], "no such option: --unit (did you mean --units?)"),
    (["M0", "--engine", "vllm", "--max-num-seqs", "4"], "no such option: --max-num-seqs "
     "(spswap serve --help lists them; vLLM's own options go after --: spswap serve MODEL "
     "--engine vllm -- --max-num-seqs ...)"),
    (["M0", "M0"], "unexpected argument M0: spswap serve takes one MODEL (several models in "
     "one job: spswap serve --models A B C)"),
    (["M0", "--", "--max-num-seqs", "4"], "unexpected arguments after --: --max-num-seqs 4 "
     "(options after -- are vLLM's, for --engine vllm only)"),
    (["--models", "M0", "M0", "--", "--max-num-seqs"], "unexpected arguments after --: "
     "--max-num-seqs (vLLM's own options for --models go in --vllm-args)"),
])  # fmt: skip
def test_a_mistyped_option_is_told_as_one_before_anything_else(tmp_path, args, said):
    """Checked first: no other check's message (outside a job, --state-dir missing) and no
    state directory made for a command line that cannot run."""
    m0 = save_checkpoint(preset("tiny", seed=3), tmp_path / "m0")
    args = [str(m0) if a == "M0" else a for a in args]
    said = said.replace("M0", str(m0))
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root"), "COLUMNS": "400"}
    env.pop("SLURM_JOB_ID", None)
    argv = [sys.executable, "-m", "spswap.cli", "serve", *args]  # no --state-dir, no job
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert said in " ".join(proc.stderr.replace("│", " ").split()), proc.stderr
    assert "state-dir" not in proc.stderr and not (tmp_path / "root").exists()


def test_options_a_run_does_not_use_are_named_and_a_vllm_batch_is_refused(tmp_path):
    """A walk found a one-model reference job taking --kv-cache-gib, --no-pack, --vllm-args
    and --port without a word (only --models named them), and --requests with --engine
    vllm left unanswered: now the first are named as ignored and the run goes on; the
    second is refused before anything starts (the server has no spool)."""
    m0 = save_checkpoint(preset("tiny", seed=3), tmp_path / "m0")
    requests = tmp_path / "req.jsonl"
    requests.write_text('{"id": "r1", "prompt_ids": [1, 2], "max_new_tokens": 2}\n')
    env = {**os.environ, "SPSWAP_ROOT": str(tmp_path / "root"), "COLUMNS": "300"}
    env.pop("SLURM_JOB_ID", None)
    base = [sys.executable, "-m", "spswap.cli", "serve", str(m0), "--device", "cpu",
            "--requests", str(requests), "--exit-when-idle"]  # fmt: skip
    proc = subprocess.run(
        [*base, "--state-dir", str(tmp_path / "s1"), "--kv-cache-gib", "4", "--no-pack",
         "--vllm-args", "--max-num-seqs 8", "--port", "0", "--awake", "1"],
        env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert ("spswap serve: --kv-cache-gib, --no-pack, --vllm-args ignored: for --engine vllm "
            "only\n") in proc.stderr  # fmt: skip
    assert "spswap serve: --port ignored: for --engine vllm or --models only\n" in proc.stderr
    assert "spswap serve: --awake ignored: for --models only\n" in proc.stderr
    assert "answered 1" in proc.stderr, proc.stderr
    proc = subprocess.run([*base, "--state-dir", str(tmp_path / "s2"), "--engine", "vllm"],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        "--requests and --exit-when-idle are the reference engine's batch job's; a vLLM "
        "server is asked through its OpenAI API, on the socket STATE_DIR/endpoint.json "
        "names (docs/slurm.md)"
    ) in " ".join(proc.stderr.replace("│", " ").split())
    assert not (tmp_path / "s2").exists() and "ignored" not in proc.stderr
