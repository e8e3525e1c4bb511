"""Every code block in README.md and docs/ runs, or says why it does not; the site builds.

* ```` ```python ```` blocks run, each on its own, in a process of their own, forked from an
  interpreter that has the heavy modules imported (tests/warm_python.py; timeout below).
* ```` ```bash ```` blocks run when every command in them is a ``raptor ...`` command (cheap
  ones: a ``--dry-run``, a tiny corpus); any other shell block must be marked.
* A block that cannot run in CI (it needs an API key, a service, your own data, or it is a
  fragment or a signature) carries ``<!-- not run: REASON -->`` on the line before its fence.

Blocks of one file run in order in one scratch directory that links the repository's
``docs``, ``tests`` and ``examples`` folders and ``README.md``, so a bash block may build a
tree that a later one queries, and ``tests/data/corpus`` is there to index.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from warm_python import RAPTOR, warm_python

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
TIMEOUT = 120  # seconds per block; a block that needs longer should be marked not run
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->\s*$")
HOW_TO_MARK = (
    "fix the block, or if it cannot run in CI put `<!-- not run: REASON -->` on the line "
    "before its opening fence (REASON: what it needs, e.g. an API key, your own files)"
)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang} block)"


def extract_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the ``not run`` reason if marked."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match["indent"], match["fence"], match["lang"].lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
        ]
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(previous)
        blocks.append(
            Block(path, i + 1, lang, "\n".join(body) + "\n", marker["reason"] if marker else None)
        )
        i = end + 1
    return blocks


ALL_BLOCKS = [b for path in DOC_FILES for b in extract_blocks(path)]


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [
        line.strip()
        for line in joined.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def workdir(tmp_path_factory: pytest.TempPathFactory, path: Path) -> Path:
    directory = tmp_path_factory.mktemp(path.stem)
    for name in ("docs", "tests", "examples", "README.md"):
        (directory / name).symlink_to(ROOT / name)
    return directory


def run_block(
    block: Block, cwd: Path, environ: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = dict(os.environ if environ is None else environ)
    env = {
        **base,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")])),
    }
    if block.lang in PYTHON:
        return warm_python().run(["-c"], code=block.code, cwd=cwd, env=env, timeout=TIMEOUT)
    commands = shell_commands(block.code)
    if all(_plain_raptor(c) for c in commands):
        return _run_raptor_commands([shlex.split(c, comments=True) for c in commands], cwd, env)
    raptor = Path(sys.executable).parent / "raptor"
    # The `raptor` next to this interpreter comes first on PATH.
    env["PATH"] = f"{raptor.parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False,
    )  # fmt: skip


SHELL_SYNTAX = re.compile(r"[|&;<>()$`\\]")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def _plain_raptor(command: str) -> bool:
    """A ``raptor`` command that bash would pass on as it is written: no pipes, redirections,
    variables or substitutions anywhere, and no glob outside quotes."""
    return (
        command.startswith("raptor ")
        and not SHELL_SYNTAX.search(command)
        and not re.search(r"[*?\[~]", QUOTED.sub("", command))
    )


def _run_raptor_commands(
    commands: list[list[str]], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run plain ``raptor`` commands in order as ``bash -e`` would: stop at the first failure."""
    stdout, stderr, status = "", "", 0
    for argv in commands:
        proc = warm_python().run(argv, console=RAPTOR, cwd=cwd, env=env, timeout=TIMEOUT)
        stdout, stderr, status = stdout + proc.stdout, stderr + proc.stderr, proc.returncode
        if status != 0:
            break
    return subprocess.CompletedProcess(["bash", "-c", "..."], status, stdout, stderr)


def test_the_extractor_finds_markers_and_indented_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Text\n\n<!-- not run: needs a key -->\n\n```python\nimport os\n```\n\n"
        "1. step\n\n   ```bash\n   raptor --help\n   ```\n\n````text\n```\n````\n"
    )
    blocks = extract_blocks(page)
    assert [(b.line, b.lang, b.code, b.skip_reason) for b in blocks] == [
        (5, "python", "import os\n", "needs a key"),
        (11, "bash", "raptor --help\n", None),
        (15, "text", "```\n", None),
    ]
    assert shell_commands("raptor build a \\\n   --out b  # x\n# note\n\nls\n") == [
        "raptor build a  --out b  # x",
        "ls",
    ]


CHECKED = [b for b in ALL_BLOCKS if b.lang in PYTHON | SHELL]
_WORKDIRS: dict[Path, Path] = {}
_RAN: set[Block] = set()


@pytest.mark.slow
@pytest.mark.parametrize("block", CHECKED, ids=[b.where.split(" ")[0] for b in CHECKED])
def test_code_block_runs_or_says_why_not(
    block: Block, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if block.skip_reason is not None:
        pytest.skip(f"not run: {block.skip_reason}")
    if block.lang in SHELL:
        others = [c for c in shell_commands(block.code) if not c.startswith("raptor ")]
        assert not others, (
            f"{block.where} runs {others[0]!r}: only `raptor ...` commands run here; {HOW_TO_MARK}"
        )
    # The blocks of one file share a directory, in document order (see the module docstring).
    cwd = _WORKDIRS.get(block.path) or _WORKDIRS.setdefault(
        block.path, workdir(tmp_path_factory, block.path)
    )
    # Run alone (-k), a block still finds what the blocks above it made.
    earlier = [
        b for b in CHECKED if b.path == block.path and b.line < block.line and b.skip_reason is None
    ]
    for before in earlier:
        if before not in _RAN:
            _RAN.add(before)
            run_block(before, cwd)
    _RAN.add(block)
    try:
        proc = run_block(block, cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where} ran longer than {TIMEOUT}s: {HOW_TO_MARK}")
    assert proc.returncode == 0, (
        f"{block.where} failed (exit {proc.returncode}): {HOW_TO_MARK}\n"
        f"--- block ---\n{block.code}--- output (tail) ---\n"
        f"{(proc.stdout + proc.stderr)[-3000:]}"
    )


LOCAL_URL = "http://localhost:11434/v1"


def test_local_model_blocks_against_a_fake_server(tmp_path: Path) -> None:
    """docs/local-models.md's Python blocks for a local server, run against a fake one."""
    from openai_server import FakeOpenAIServer

    pytest.importorskip("openai")
    blocks = [
        b
        for b in ALL_BLOCKS
        if b.path.name == "local-models.md" and b.lang in PYTHON and LOCAL_URL in b.code
    ]
    assert len(blocks) == 2
    env = {k: v for k, v in os.environ.items() if k not in {"OPENAI_API_KEY", "OPENAI_BASE_URL"}}
    with FakeOpenAIServer() as server:
        for block in blocks:
            local = Block(
                block.path, block.line, block.lang, block.code.replace(LOCAL_URL, server.url), None
            )
            proc = run_block(local, tmp_path, env)  # no key: the local-server default
            assert proc.returncode == 0, f"{block.where}: {proc.stdout}{proc.stderr[-3000:]}"
            assert proc.stdout.startswith("["), proc.stdout
        assert server.requests("chat") and server.requests("embeddings")


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[dev]' brings mkdocs-material")
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_docs_page_is_in_the_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", config, re.MULTILINE))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages <= listed, f"docs pages missing from mkdocs.yml nav: {sorted(pages - listed)}"
