"""The ``raptor`` command never shows a traceback for a user's mistake or an environment fault.

Each case runs the installed ``raptor`` command (or ``python -m raptor_core.cli``) in a real
process where it can: exit status 2 for usage errors, 1 for failures, one line on stderr that
says what to do, and text from documents printed with its control characters escaped.  The
trees are built with the fakes, which a query re-creates by itself, so no model is loaded.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import warnings
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

import raptor_core.cli._common as cli_common
import raptor_core.cli.inspect as cli_inspect
import raptor_core.cli.models as cli_models
from raptor_core.build.builder import TreeBuilder
from raptor_core.cli import EXIT_FAILURE, EXIT_USAGE, main
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.tree import Tree

DIM = 16
IS_ROOT = getattr(os, "geteuid", lambda: -1)() == 0
ESC = "\x1b"
# One escape sequence per document stays under the builder's binary-file heuristic.
HOSTILE_TEXT = f"Cats purr {ESC}]0;owned{ESC}\\ in the sun. " + "Cats purr and sleep. " * 40


def raptor_command() -> list[str]:
    script = Path(sys.executable).parent / "raptor"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "raptor_core.cli"]


def run(
    *args: str | bytes, cwd: Path | None = None, env: dict[str, str] | None = None, **kw: Any
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*raptor_command(), *args],
        capture_output=True,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=120,
        check=False,
        **kw,
    )


def one_line_error(proc: subprocess.CompletedProcess[bytes], status: int) -> str:
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == status, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("raptor"), err
    return lines[0]


def fake_builder() -> TreeBuilder:
    return TreeBuilder(
        FakeEmbedder(DIM), EchoSummarizer(), tokenizer=WhitespaceTokenizer(), random_state=0
    )


@pytest.fixture(scope="module")
def tree_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cli") / "tree"
    tree = fake_builder().build(
        [
            {"doc_id": "cats", "text": HOSTILE_TEXT},
            {"doc_id": f"rockets{ESC}[2J\u009b31m", "text": "Rockets burn fuel to orbit. " * 40},
            {"doc_id": "bread", "text": "Bakers knead dough and bake bread. " * 400},
        ]
    )
    tree.save(directory)
    return directory


@pytest.fixture
def fake_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process builds use the fakes instead of the packaged model."""
    monkeypatch.setattr(
        cli_models, "build_models", lambda args: (FakeEmbedder(DIM), EchoSummarizer())
    )


# -- closed pipes ----------------------------------------------------------------------------------
def test_a_closed_pipe_is_quiet(tree_dir: Path) -> None:
    proc = subprocess.Popen(
        [*raptor_command(), "query", str(tree_dir), "cats", "-k", "30", "--max-tokens", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write (`| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_FAILURE
    assert err == ""


@pytest.mark.skipif(sys.platform == "win32", reason="needs bash")
@pytest.mark.parametrize("command", ["query {tree} cats -k 30", "inspect {tree}", "--help"])
def test_pipes_closed_by_the_reader_show_no_traceback(tree_dir: Path, command: str) -> None:
    raptor = " ".join(raptor_command()) + " " + command.format(tree=tree_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # `true` exits before raptor has started: every write meets a closed pipe.
    closed = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {raptor} | true"],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert closed.stderr == b""
    assert closed.returncode == (0 if command == "--help" else EXIT_FAILURE)
    head = subprocess.run(
        ["bash", "-c", f"{raptor} | head -1"],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert head.returncode == 0 and len(head.stdout.splitlines()) == 1 and head.stderr == b""


# -- invalid numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["build", "docs", "--out", "o", "--seed", "-1"], "--seed"),
        (["build", "docs", "--out", "o", "--seed", str(2**32)], "--seed"),
        (["build", "docs", "--out", "o", "--chunk-tokens", "0"], "--chunk-tokens"),
        (["build", "docs", "--out", "o", "--threads", "0"], "--threads"),
        (["build", "docs", "--out", "o", "--max-concurrency", "-3"], "--max-concurrency"),
        (["build", "docs", "--out", "o", "--timeout", "nan"], "--timeout"),
        (["build", "docs", "--out", "o", "--max-layers", "-1"], "--max-layers"),
        (["query", "t", "q", "--top-k", "0"], "--top-k"),
        (["query", "t", "q", "--max-tokens", "ten"], "--max-tokens"),
        (["query", "t", "q", "--threshold", "inf"], "--threshold"),
        (["query", "t", "q", "--llm-timeout", "0"], "--llm-timeout"),
        (["query", "t", "q", "--start-layer", "-2"], "--start-layer"),
        (["eval", "--seed", "-1"], "--seed"),
        (["eval", "--limit-docs", "0"], "--limit-docs"),
        (["query", "t"], "question"),
        (["build", "docs", "--out", "o", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_invalid_flags_are_one_line_usage_errors(
    tmp_path: Path, args: list[str], flag: str
) -> None:
    line = one_line_error(run(*args, cwd=tmp_path), EXIT_USAGE)
    assert "error:" in line and flag in line
    assert list(tmp_path.iterdir()) == []  # nothing was started


# -- missing and unreadable files --------------------------------------------------------------
def test_missing_inputs_are_usage_errors(tmp_path: Path, tree_dir: Path) -> None:
    line = one_line_error(run("build", str(tmp_path / "nope.txt"), "--out", "o", cwd=tmp_path), 2)
    assert "nope.txt does not exist" in line
    line = one_line_error(run("query", str(tmp_path / "nope"), "q"), EXIT_USAGE)
    assert "no RAPTOR tree" in line
    docs = tmp_path / "doc.txt"
    docs.write_text("Some text to summarise. " * 5)
    args = ["build", str(docs), "--out", "o", "--llm", "openai", "--dry-run"]
    line = one_line_error(run(*args, "--prompt-file", "missing.txt", cwd=tmp_path), 2)
    assert "missing.txt" in line and "no such file" in line
    line = one_line_error(run(*args, "--prompt-file", str(tmp_path), cwd=tmp_path), 2)
    assert "is a directory" in line


def test_an_unreadable_file(tmp_path: Path) -> None:
    if IS_ROOT:
        pytest.skip("root reads files whatever their mode; the mapping is tested in-process")
    secret = tmp_path / "secret.txt"
    secret.write_text("text")
    secret.chmod(0)
    line = one_line_error(run("build", str(secret), "--out", "o", cwd=tmp_path), EXIT_FAILURE)
    assert "secret.txt" in line and "permission denied" in line


def test_os_errors_map_to_one_line_with_the_path(
    monkeypatch: pytest.MonkeyPatch, capsys: Any, tree_dir: Path
) -> None:
    cases = [
        (errno.EACCES, EXIT_FAILURE, "permission denied"),
        (errno.EIO, EXIT_FAILURE, "input/output error"),
        (errno.ENOENT, EXIT_USAGE, "no such file"),
    ]
    for code, status, words in cases:

        def fail(directory: str, code: int = code) -> Any:
            raise OSError(code, os.strerror(code), str(tree_dir / "tree.json"))

        monkeypatch.setattr(cli_common, "load_tree", fail)
        assert main(["inspect", str(tree_dir)]) == status
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "tree.json" in err


# -- full disks and read-only outputs ----------------------------------------------------------
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_stdout_on_a_full_device(tree_dir: Path) -> None:
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(
            [*raptor_command(), "query", str(tree_dir), "cats", "-k", "30"],
            stdout=full,
            stderr=subprocess.PIPE,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            timeout=120,
            check=False,
        )
    assert "no space left" in one_line_error(proc, EXIT_FAILURE)


def test_a_full_disk_while_saving_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, fake_models: None
) -> None:
    docs = tmp_path / "doc.txt"
    docs.write_text("Cats purr and sleep in the sun. " * 60)
    out = tmp_path / "out"

    def full(self: Tree, path: Any) -> Path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(path) / "tree.json"))

    monkeypatch.setattr(Tree, "save", full)
    assert main(["build", str(docs), "--out", str(out), "--quiet"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left on the device" in err and "tree.json" in err

    def sqlite_full(self: Any, documents: Any) -> Tree:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(TreeBuilder, "build", sqlite_full)
    assert main(["build", str(docs), "--out", str(out), "--quiet", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disk is full" in err


def _mount_tmpfs(target: Path, *options: str) -> bool:
    """Mount a tiny tmpfs at ``target`` (root on Linux only); False when not possible."""
    if sys.platform != "linux" or not IS_ROOT:
        return False
    target.mkdir(parents=True, exist_ok=True)
    opts = ",".join(("size=64k", *options))
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)],
        capture_output=True,
        check=False,
    )
    return proc.returncode == 0


def _umount(target: Path) -> None:
    subprocess.run(["umount", str(target)], capture_output=True, check=False)


def test_a_really_full_disk(tmp_path: Path) -> None:
    mount = tmp_path / "tiny"
    if not _mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here; the ENOSPC mapping is tested in-process")
    try:
        with suppress(OSError), (mount / "filler").open("wb") as filler:
            while True:  # fill the file system to the last byte
                filler.write(b"\0" * 4096)
                filler.flush()
        docs = tmp_path / "doc.txt"
        docs.write_text("Cats purr and sleep in the sun. " * 60)
        proc = run("build", str(docs), "--out", str(mount / "tree"))
        assert "no space left" in one_line_error(proc, EXIT_FAILURE)
    finally:
        _umount(mount)


def test_a_read_only_output(tmp_path: Path) -> None:
    docs = tmp_path / "doc.txt"
    docs.write_text("Cats purr and sleep in the sun. " * 60)
    target = tmp_path / "ro"
    mounted = False
    if not IS_ROOT:
        target.mkdir()
        target.chmod(0o500)  # root ignores modes, so this only works for other users
        words = "permission denied"
    elif _mount_tmpfs(target, "ro"):
        mounted = True
        words = "read-only file system"
    else:
        pytest.skip("running as root without mount: no way to make a directory read-only")
    try:
        proc = run("build", str(docs), "--out", str(target / "tree"))
        assert words in one_line_error(proc, EXIT_FAILURE)
    finally:
        if mounted:
            _umount(target)
        else:
            target.chmod(0o700)


def test_an_output_under_a_file(tmp_path: Path) -> None:
    docs = tmp_path / "doc.txt"
    docs.write_text("Cats purr and sleep in the sun. " * 60)
    line = one_line_error(run("build", str(docs), "--out", str(docs / "tree")), EXIT_USAGE)
    assert "not a directory" in line
    line = one_line_error(run("build", str(docs), "--out", str(docs)), EXIT_USAGE)
    assert "is a file" in line


# -- --overwrite ---------------------------------------------------------------------------------
def test_build_onto_a_tree_needs_overwrite(
    tmp_path: Path, tree_dir: Path, capsys: Any, fake_models: None
) -> None:
    out = tmp_path / "tree"
    Tree.load(tree_dir).save(out)
    stamp = (out / "tree.json").stat().st_mtime_ns
    # Refused before any work: the missing input is not even looked at.
    line = one_line_error(run("build", str(tmp_path / "missing.txt"), "--out", str(out)), 2)
    assert "already holds a tree" in line and "--overwrite" in line
    assert (out / "tree.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tree_dir.iterdir())
    docs = tmp_path / "doc.txt"
    docs.write_text("Volcanoes erupt lava and ash. " * 60)
    assert main(["build", str(docs), "--out", str(out), "--quiet", "--overwrite"]) == 0
    assert Tree.load(out).doc_ids == (str(docs),)
    assert capsys.readouterr().err == ""


# -- text that is not Unicode ------------------------------------------------------------------
def test_undecodable_bytes_in_a_question(tree_dir: Path) -> None:
    line = one_line_error(run(b"query", os.fsencode(tree_dir), b"caf\xff au lait"), EXIT_USAGE)
    assert "the question" in line and "not Unicode text" in line


def test_a_lone_surrogate_in_a_jsonl_file(tmp_path: Path) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        '{"doc_id": "a", "text": "fine text"}\n{"doc_id": "b", "text": "bad \\ud800"}\n'
    )
    line = one_line_error(run("build", str(docs), "--out", "o", "--dry-run", cwd=tmp_path), 2)
    assert "docs.jsonl:2" in line and "not Unicode text" in line


def test_undecodable_file_names_become_escaped_ids(
    tmp_path: Path, capsys: Any, fake_models: None
) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    name = os.fsdecode(b"caf\xe9.txt")  # Latin-1 bytes in a file name: a lone surrogate in str
    (folder / name).write_text("Cats purr and sleep in the sun. " * 60)
    out = tmp_path / "tree"
    assert main(["build", str(folder), "--out", str(out), "--quiet"]) == 0
    assert Tree.load(out).doc_ids == (str(folder / "caf\\xe9.txt"),)
    assert capsys.readouterr().err == ""


def test_output_in_a_narrow_encoding(tree_dir: Path) -> None:
    proc = run("query", str(tree_dir), "cats", env={"PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0 and proc.stderr == b""


# -- control characters from documents -----------------------------------------------------------
def test_query_output_escapes_control_characters(tree_dir: Path) -> None:
    proc = run("query", str(tree_dir), "owned cats rockets", "-k", "500", "--max-tokens", "99999")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.decode()
    assert ESC not in out and "\u009b" not in out
    assert "\\x1b]0;owned\\x1b\\" in out and "rockets\\x1b[2J\\x9b31m" in out


def test_json_output_escapes_control_characters(tree_dir: Path) -> None:
    proc = run(
        "query", str(tree_dir), "owned cats rockets", "-k", "500", "--max-tokens", "99999", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.decode()
    assert ESC not in out and "\u009b" not in out
    hits = json.loads(out)  # still valid JSON, and the texts are unchanged
    assert "\\u001b]0;owned" in out and any(f"{ESC}]0;owned{ESC}" in h["text"] for h in hits)
    assert any(h["doc_id"] == f"rockets{ESC}[2J\u009b31m" for h in hits)


def test_inspect_escapes_control_characters(tmp_path: Path, tree_dir: Path) -> None:
    tree = Tree.load(tree_dir)
    params = {**tree.params, "note": f"{ESC}[2J wiped", "stop": "\u009b31m"}
    Tree(nodes=tree.nodes, embeddings=tree.embeddings, params=params).save(tmp_path / "t")
    for args in ([], ["--json"]):
        proc = run("inspect", str(tmp_path / "t"), *args)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout.decode()
        assert ESC not in out and "\u009b" not in out and "wiped" in out


def test_errors_escape_control_characters(tmp_path: Path) -> None:
    name = f"{ESC}]0;owned{ESC}\\"
    line = one_line_error(run("query", str(tmp_path / name), "q"), EXIT_USAGE)
    assert ESC not in line and "\\x1b]0;owned" in line


# -- interrupts and warnings -------------------------------------------------------------------
def test_interrupt_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: Any, tree_dir: Path
) -> None:
    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_inspect, "run_inspect", interrupted)
    assert main(["inspect", str(tree_dir)]) == 130
    assert capsys.readouterr().err == "raptor inspect: interrupted\n"


def test_warnings_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: Any, tree_dir: Path
) -> None:
    def warns(args: Any) -> int:
        warnings.warn(f"odd {ESC}[2J\ntree", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(cli_inspect, "run_inspect", warns)
    assert main(["inspect", str(tree_dir)]) == 0
    assert capsys.readouterr().err == "raptor inspect: warning: odd \\x1b[2J tree\n"


def test_help_and_success_still_work(tree_dir: Path) -> None:
    assert run("--help").returncode == 0
    proc = run("query", str(tree_dir), "bread dough", "-k", "1")
    assert proc.returncode == 0 and b"Bakers" in proc.stdout


# -- embedders named on the command line ---------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("onnx:{tmp}/nowhere", "no such directory: write an export there with `raptor export-onnx"),
        ("{tmp}/no-model", "no such file or directory: give the folder of a sentence-transformers"),
    ],
)
def test_an_embedder_path_that_is_not_there_is_a_usage_error(
    tree_dir: Path, tmp_path: Path, spec: str, message: str
) -> None:
    proc = run("query", str(tree_dir), "cats", "--embedder", spec.format(tmp=tmp_path))
    assert message in one_line_error(proc, 2)


def test_a_folder_that_is_no_onnx_export_says_how_to_write_one(
    tree_dir: Path, tmp_path: Path
) -> None:
    # A usage error, as a folder that is not there: the command line named the wrong folder.
    (tmp_path / "tokenizer.json").write_text("{}", encoding="utf-8")
    proc = run("query", str(tree_dir), "cats", "--embedder", f"onnx:{tmp_path}")
    line = one_line_error(proc, 2)
    assert "is not an ONNX export (missing model.onnx, raptor-onnx.json)" in line
    assert f"raptor export-onnx --out {tmp_path}" in line
