"""spswap's own errors reach the user as one clear line, printed as written."""

import subprocess
import sys


def test_error_text_is_not_taken_for_markup(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "bench", "swap", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "spswap[vllm]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_setting_names_the_valid_ones(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spswap.cli", "status"],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "SPSWAP_ROTO": "/x", "SPSWAP_ROOT": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert "unknown setting SPSWAP_ROTO" in proc.stderr and "SPSWAP_ROOT" in proc.stderr
