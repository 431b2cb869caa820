"""`.ci/run`'s shell helpers (the whole run installs 6 GB and takes minutes: CI runs it, not the tests).
The script runs main() only when executed, so sourcing it gives its functions."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI_RUN = ROOT / ".ci" / "run"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _bash(script: str, cwd: Path = ROOT, **env) -> str:
    out = subprocess.run(["bash", "-c", f"source {CI_RUN}\n{script}"], cwd=cwd, capture_output=True, text=True,
                         env=dict(os.environ, **env), timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_script_parses():
    out = subprocess.run(["bash", "-n", str(CI_RUN)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_sourcing_runs_nothing(tmp_path):
    # main() would clone, make a venv and install 6 GB: sourcing must only define functions.
    assert _bash("declare -F main readme_quick_start >/dev/null && echo defined", cwd=ROOT) == "defined\n"


def test_it_reads_the_readmes_quick_start_and_sglang_install_lines_as_written():
    readme = (ROOT / "README.md").read_text()
    quick = _bash("readme_quick_start").splitlines()
    assert len(quick) == 2 and all(line in readme for line in quick), quick
    assert quick[1] == "python3 -m pytest -q"
    install = _bash("readme_sglang_install").splitlines()
    assert install == ["pip install ."], install
    assert "sglang.launch_server" not in " ".join(install)  # the server line needs a GPU and a model


def test_a_readme_section_is_read_up_to_its_own_block_only(tmp_path):
    (tmp_path / "README.md").write_text("# x\n\n## Quick start\n\ntext\n\n```bash\na\n\nb\n```\n\n```\nc\n```\n"
                                        "## Use with SGLang\n\nno block here\n\n## Other\n\n```\nd\n```\n")
    assert _bash("readme_quick_start", cwd=tmp_path) == "a\nb\n"
    assert _bash("readme_sglang_install", cwd=tmp_path) == ""  # never the next section's block


def test_the_checkout_check_ignores_bytecode_caches_only(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("__pycache__/\n*.log\n")
    before = _bash("checkout_state", cwd=tmp_path)
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"")
    assert _bash("checkout_state", cwd=tmp_path) == before
    (tmp_path / "left.log").write_text("x")
    (tmp_path / ".hypothesis").mkdir()
    (tmp_path / ".hypothesis" / "db").write_text("x")
    after = _bash("checkout_state", cwd=tmp_path)
    assert "!! left.log" in after and "?? .hypothesis/" in after, after


def test_the_temp_dir_check_names_anything_new_but_pytests_own_folder(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "there-before").mkdir()
    script = ('before=$(tmp_entries)\n'
              'mkdir "$TMPDIR/pytest-of-$(id -un)" "$TMPDIR/sglang-hicache-jit-hypothesis-0"\n'
              'touch "$TMPDIR/stray-file"\n'
              'no_new_tmp_entries "$before" && echo clean || echo "failed $?"\n')
    env = dict(os.environ, TMPDIR=str(tmp), CI_SHARED_TMP=str(tmp))  # not the real /tmp, which others use
    out = subprocess.run(["bash", "-c", f"source {CI_RUN}\n{script}"], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.stdout.strip() == "failed 1", out.stdout + out.stderr
    named = out.stderr.splitlines()[1:]
    assert sorted(named) == [f"{tmp}/sglang-hicache-jit-hypothesis-0", f"{tmp}/stray-file"], out.stderr
    clean = subprocess.run(["bash", "-c", f"source {CI_RUN}\nbefore=$(tmp_entries)\nno_new_tmp_entries \"$before\" "
                            "&& echo clean"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert clean.stdout.strip() == "clean", clean.stderr


def test_pytests_no_tests_exit_passes_loudly_and_failures_fail():
    assert _bash('pytest_status 5 "x" 2>&1; echo "rc $?"') == ".ci/run: x collected no tests\nrc 0\n"
    assert _bash('pytest_status 1 "x" || echo "rc $?"') == "rc 1\n"
