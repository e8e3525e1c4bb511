"""Package structure: the public names, a light `import raptor_core`, one-way dependencies."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import raptor_core

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_ALL = {
    "DEFAULT_SUMMARY_PROMPT",
    "LLM",
    "STRATEGIES",
    "AsyncEmbedder",
    "AsyncLLM",
    "AsyncSummarizer",
    "BatchSummarizer",
    "BackendError",
    "BudgetExceededError",
    "BuildProgress",
    "CacheError",
    "Chunk",
    "Chunker",
    "Clusterer",
    "CollapsedTreeRetriever",
    "Document",
    "EmbeddingError",
    "EmbeddingResponseError",
    "Embedder",
    "ExtractiveSummarizer",
    "FaissHNSWIndex",
    "FaissIndex",
    "FileNodeStore",
    "GMMClusterer",
    "Hit",
    "HybridResult",
    "HybridRetriever",
    "InMemoryNodeStore",
    "InvalidInputError",
    "InvalidParameterError",
    "JudgeDecision",
    "LLMBudget",
    "Pricing",
    "LLMAuthenticationError",
    "LLMBatchError",
    "LLMError",
    "LLMRequestError",
    "LLMResponseError",
    "LLMGuidedRetriever",
    "LLMSummarizer",
    "LLMTimeoutError",
    "MMRRetriever",
    "Match",
    "MissingDependencyError",
    "Node",
    "NodeFilter",
    "NodeStore",
    "NumpyIndex",
    "RaptorError",
    "RegexTokenizer",
    "Segment",
    "SentenceChunker",
    "SentenceTransformerEmbedder",
    "SpanEmbedder",
    "SummarizationError",
    "Summarizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "Tree",
    "TreeBuilder",
    "TreeFormatError",
    "TreeLockError",
    "TreeRetriever",
    "TreeSaveError",
    "TreeTraversalRetriever",
    "TreeUpdate",
    "UpdateReport",
    "ValueBasedRetriever",
    "PassageRetriever",
    "DEFAULT_STRATEGY",
    "VectorIndex",
    "__version__",
    "make_retriever",
}


def test_public_names_are_pinned() -> None:
    # Adding a name is a decision: update EXPECTED_ALL with it.  Removing one breaks users.
    assert set(raptor_core.__all__) >= EXPECTED_ALL
    extra = set(raptor_core.__all__) - EXPECTED_ALL
    assert not extra - {"OpenAIChatLLM", "OpenAIEmbedder", "OpenAISummarizer", "BuildCache"}
    for name in raptor_core.__all__:
        assert hasattr(raptor_core, name), name


def test_import_is_light() -> None:
    heavy = [
        "umap",
        "sklearn",
        "torch",
        "openai",
        "faiss",
        "numba",
        "sentence_transformers",
        "tiktoken",
        "llama_index",
        "langchain_core",
        "scipy",
        "matplotlib",
    ]
    code = f"import sys, raptor_core; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_core_never_imports_the_frameworks() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "KEPT" in proc.stdout


def test_no_pickle_and_no_asyncio_run_in_library_code() -> None:
    for package in ("raptor_core", "raptor_llamaindex", "raptor_langchain"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            assert "import pickle" not in text and "pickle.load" not in text, path
            assert "asyncio.run(" not in text, path
            assert "joblib.load" not in text, path


def test_every_package_is_typed() -> None:
    for package in ("raptor_core", "raptor_llamaindex", "raptor_langchain"):
        assert (ROOT / package / "py.typed").is_file()


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("raptor_llamaindex", "llama_index.core", "llamaindex"),
        ("raptor_langchain", "langchain_core", "langchain"),
    ],
)
def test_adapter_without_its_framework_names_the_extra(
    module: str, blocked: str, extra: str
) -> None:
    code = (
        "import sys\n"
        f"sys.modules[{blocked!r}] = None\n"
        "from raptor_core import MissingDependencyError\n"
        "try:\n"
        f"    import {module}\n"
        "except MissingDependencyError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert f"raptor-retriever[{extra}]" in out.stdout


def test_missing_optional_backend_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from raptor_core._imports import require

    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(raptor_core.MissingDependencyError, match="faiss-cpu"):
        require("faiss", package="faiss-cpu")
    with pytest.raises(ImportError):  # still an ImportError for callers that expect one
        require("faiss", package="faiss-cpu")


def test_code_passes_ruff() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    targets = [
        "raptor_core",
        "raptor_llamaindex",
        "raptor_langchain",
        "tests",
        "benchmarks",
        "examples",
    ]
    proc = subprocess.run(
        [ruff, "check", *targets], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
