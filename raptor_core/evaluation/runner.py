"""Run retrievers side by side at equal token budgets and score them.

The flow of :func:`evaluate`:

1. build one RAPTOR tree per document (``tree_per="doc"``) or one over all of them
   (``"all"``), or load it from ``cache_dir`` when an identical build is cached there;
2. build every retriever over each tree's corpus (timed: "index build");
3. for every question, budget and retriever: retrieve (timed: latency), cut the texts to
   the budget with the shared tokenizer, and score them (:mod:`~raptor_core.evaluation.metrics`);
4. average per retriever and budget.

A retriever here is anything with ``retrieve(question, *, max_tokens) -> list[str]``
(:class:`ContextRetriever`); a :class:`RetrieverSpec` names a factory that builds one from
an :class:`EvalCorpus`.  Names resolve to the RAPTOR strategies, the core baselines
(``bm25``, ``dense``, ``fusion``), baselines that other packages register under the entry-point group
``raptor.eval_baselines`` (the LlamaIndex and LangChain default retrievers), or a dotted
path ``package.module:Factory``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from raptor_core._version import __version__
from raptor_core.evaluation.data import Question, check_questions, gold_units
from raptor_core.evaluation.metrics import (
    DEFAULT_NGRAM,
    Context,
    answer_recall,
    evidence_recall,
    fit_budget,
    scorable_answers,
    span_precision,
    span_recall,
    tokens,
)
from raptor_core.evaluation.readers import ChoiceReader
from raptor_core.exceptions import (
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    LLMError,
    MissingDependencyError,
    TreeFormatError,
)
from raptor_core.tree import Tree
from raptor_core.types import LLM, Document, Embedder, Summarizer, Tokenizer

__all__ = [
    "BASELINE_ENTRY_POINTS",
    "CORE_BASELINES",
    "DEFAULT_BUDGETS",
    "FLAT_BASELINES",
    "METRICS",
    "ContextRetriever",
    "EvalCorpus",
    "EvalResult",
    "QueryCachingEmbedder",
    "RaptorStrategy",
    "RetrieverSpec",
    "available_retrievers",
    "environment",
    "evaluate",
    "resolve_retrievers",
    "unscorable",
]

logger = logging.getLogger(__name__)

#: The paper's context budgets (RAPTOR, section 4: 400 tokens for small readers, 2,000).
DEFAULT_BUDGETS: tuple[int, ...] = (400, 1000, 2000)
#: Entry-point group where packages register evaluation baselines (factories of corpus).
BASELINE_ENTRY_POINTS = "raptor.eval_baselines"
#: The metrics, in report order: recall of gold text, then a reader's multiple-choice
#: accuracy (only with a ``reader``, on questions that have options).
METRICS: tuple[str, ...] = (
    "evidence_recall",
    "answer_recall",
    "span_recall",
    "span_precision",
    "choice_accuracy",
)
#: Effectively unbounded ``k`` for the RAPTOR strategies: the budget decides.
_RAPTOR_K = 1000
_CACHE_KEY_FILE = "eval-key.json"

#: ``progress(stage, done, total)``, stages ``"trees"`` and ``"questions"``.
ProgressCallback = Callable[[str, int, int], None]


@runtime_checkable
class ContextRetriever(Protocol):
    """What the harness evaluates: question in, context texts out (best first)."""

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Return context texts for ``question``; the harness cuts them at ``max_tokens``."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalCorpus:
    """What a retriever factory gets: the documents, their RAPTOR tree and the shared models.

    Attributes:
        name: the document id (``tree_per="doc"``) or ``"all"``.
        documents: the documents of this corpus.
        tree: the RAPTOR tree over them; ``tree.leaves`` are the shared ~100-token chunks.
        embedder: the embedding model every retriever must use.
        tokenizer: counts tokens for the budgets.
        llm: the configured LLM, or None.
        random_state: the run's seed.
    """

    name: str
    documents: tuple[Document, ...]
    tree: Tree
    embedder: Embedder
    tokenizer: Tokenizer
    llm: LLM | None = None
    random_state: int | None = None

    @property
    def chunks(self) -> list[str]:
        """The texts of the tree's leaves, in tree order."""
        return [leaf.text for leaf in self.tree.leaves]


RetrieverFactory = Callable[[EvalCorpus], ContextRetriever]


@dataclass(frozen=True, slots=True)
class RetrieverSpec:
    """A named retriever factory.

    Attributes:
        name: the column label in reports.
        factory: builds the retriever for one corpus.
        family: ``"raptor"``, ``"baseline"`` (core), ``"framework"`` (entry point) or
            ``"custom"`` (dotted path).
    """

    name: str
    factory: RetrieverFactory
    family: str = "custom"


class _HitsRetriever:
    """Adapts a RAPTOR strategy (``retrieve(query, k=, max_tokens=) -> list[Hit]``)."""

    def __init__(self, strategy: str, corpus: EvalCorpus, params: Mapping[str, Any]) -> None:
        self.strategy = strategy
        self.corpus = corpus
        self.params = dict(params)
        self._by_budget: dict[int, Any] = {}

    def _params_for(self, max_tokens: int) -> dict[str, Any]:
        params = {"k": _RAPTOR_K, **self.params}
        tree = self.corpus.tree
        if self.strategy == "traversal" and "top_k" not in params and tree.num_layers:
            # Traversal returns at most top_k nodes per layer; at its default (5) it cannot
            # fill a 2,000-token budget on a shallow tree.  Scale it so it can, as the paper
            # does when it compares traversal and collapsed at equal context sizes.
            per_node = max(1.0, float(tree.token_counts.mean()))
            params["top_k"] = max(5, math.ceil(max_tokens / (per_node * tree.num_layers)))
        return params

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        retriever = self._by_budget.get(max_tokens)
        if retriever is None:
            from raptor_core.retrieval.registry import make_retriever

            retriever = make_retriever(
                self.strategy,
                self.corpus.tree,
                self.corpus.embedder,
                llm=self.corpus.llm,
                **self._params_for(max_tokens),
            )
            self._by_budget[max_tokens] = retriever
        hits = retriever.retrieve(question, max_tokens=max_tokens)
        return [hit.node.text for hit in hits]


class RaptorStrategy:
    """Factory of a RAPTOR retrieval strategy over each corpus's tree.

    Args:
        strategy: a name of :data:`raptor_core.retrieval.registry.STRATEGIES`.
        **params: the strategy's parameters (``k`` defaults to unbounded: the budget
            decides; traversal's ``top_k`` scales with the budget unless given).
    """

    def __init__(self, strategy: str, **params: Any) -> None:
        self.strategy = strategy
        self.params = params

    def __repr__(self) -> str:
        return f"RaptorStrategy({self.strategy!r}, **{self.params!r})"

    def __call__(self, corpus: EvalCorpus) -> ContextRetriever:
        """Build the strategy's retriever over ``corpus.tree``."""
        return _HitsRetriever(self.strategy, corpus, self.params)


class QueryCachingEmbedder:
    """Wraps an embedder so that each question is embedded once for all retrievers.

    Every retriever in a run embeds the question with the same model; the harness embeds it
    once (timed separately as ``embed_ms``) before the retrievers run, so their latencies
    compare the search itself and the run does not pay for one model call per retriever and
    budget.  Documents are passed through untouched.
    """

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._queries: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"QueryCachingEmbedder({self.embedder!r})"

    def __getattr__(self, name: str) -> Any:
        # Attributes such as ``model_name_or_path`` and ``dim`` describe the wrapped model.
        if name == "embedder":
            raise AttributeError(name)
        return getattr(self.embedder, name)

    def embed_documents(self, texts: Sequence[str]) -> Any:
        """Embed documents with the wrapped embedder (not cached)."""
        return self.embedder.embed_documents(texts)

    def embed_query(self, text: str) -> Any:
        """The cached query vector, embedding it on first use."""
        vector = self._queries.get(text)
        if vector is None:
            vector = self.embedder.embed_query(text)
            self._queries[text] = vector
        return vector


def _core_baselines() -> dict[str, RetrieverFactory]:
    from raptor_core.evaluation.baselines import BM25Baseline, DenseBaseline, FusionBaseline

    return {"bm25": BM25Baseline, "dense": DenseBaseline, "fusion": FusionBaseline}


#: Names of the baselines that ship with raptor_core.
CORE_BASELINES: tuple[str, ...] = ("bm25", "dense", "fusion")
#: The flat retrievers a RAPTOR strategy has to beat: the core baselines over the tree's own
#: chunks and the two frameworks' default retrievers with their own default chunking.  The
#: report's "best flat baseline" is the strongest of those that ran.
FLAT_BASELINES: tuple[str, ...] = (
    *CORE_BASELINES,
    "llamaindex-vector-default-chunking",
    "langchain-inmemory-default-chunking",
)
_NEEDS_LLM = ("llm", "hybrid")
#: Named variants of RAPTOR strategies: name -> (strategy, parameters).
RAPTOR_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Value-based search that returns the best nodes' evidence chunks, not the nodes.
    "value-evidence": ("value", {"include": "evidence"}),
    # The default strategy as it runs on a vector store that can only be searched: on the
    # leaves one search finds, without BM25.
    "passage-found": ("passage", {"scope": "found"}),
}


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    eps = importlib.metadata.entry_points(group=BASELINE_ENTRY_POINTS)
    return {ep.name: ep for ep in sorted(eps, key=lambda e: e.name)}


def available_retrievers(*, llm: bool = False) -> list[str]:
    """Default retriever names: RAPTOR strategies, core baselines, registered baselines.

    ``llm`` and ``hybrid`` are included only when ``llm`` is true (they need one).
    """
    from raptor_core.retrieval.registry import STRATEGIES

    names = [s for s in STRATEGIES if llm or s not in _NEEDS_LLM]
    return [*names, *RAPTOR_VARIANTS, *CORE_BASELINES, *_entry_points()]


def _load_dotted(path: str) -> RetrieverFactory:
    module_name, _, attr = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        msg = f"cannot load retriever factory {path!r}: {type(exc).__name__}: {exc}"
        raise InvalidParameterError(msg) from exc
    if not callable(target):
        msg = f"retriever factory {path!r} is not callable"
        raise InvalidParameterError(msg)
    return target


def resolve_retrievers(
    names: Iterable[str | RetrieverSpec] | None, *, llm: LLM | None = None
) -> tuple[list[RetrieverSpec], dict[str, str]]:
    """Turn names into specs; return them and the skipped ones with the reason.

    Accepted names: the RAPTOR strategies, ``bm25``, ``dense``, ``fusion``, the entry points of
    :data:`BASELINE_ENTRY_POINTS`, ``package.module:Factory`` or ``label=package.module:Factory``.
    A baseline whose framework is not installed, or an LLM strategy without an LLM, is
    skipped (with the reason), not an error.

    Raises:
        InvalidParameterError: an unknown name, a duplicate, or an unloadable dotted path.
    """
    from raptor_core.retrieval.registry import STRATEGIES

    requested = list(available_retrievers(llm=llm is not None) if names is None else names)
    core = _core_baselines()
    eps = _entry_points()
    specs: list[RetrieverSpec] = []
    skipped: dict[str, str] = {}
    for item in requested:
        if isinstance(item, RetrieverSpec):
            specs.append(item)
            continue
        name = item.strip()
        if name in STRATEGIES:
            if name in _NEEDS_LLM and llm is None:
                skipped[name] = "needs an LLM (pass llm=..., or --llm on the command line)"
                continue
            specs.append(RetrieverSpec(name, RaptorStrategy(name), "raptor"))
        elif name in RAPTOR_VARIANTS:
            strategy, params = RAPTOR_VARIANTS[name]
            specs.append(RetrieverSpec(name, RaptorStrategy(strategy, **params), "raptor"))
        elif name in core:
            specs.append(RetrieverSpec(name, core[name], "baseline"))
        elif name in eps:
            try:
                factory = eps[name].load()
            except ImportError as exc:  # MissingDependencyError is an ImportError too
                skipped[name] = f"not installed ({exc})"
                logger.info("skipping %s: %s", name, exc)
                continue
            specs.append(RetrieverSpec(name, factory, "framework"))
        elif ":" in name:
            label, _, path = name.rpartition("=")
            specs.append(RetrieverSpec(label or path, _load_dotted(path), "custom"))
        else:
            known = [*STRATEGIES, *RAPTOR_VARIANTS, *CORE_BASELINES, *eps]
            hint = ""
            if name.startswith(("llamaindex", "langchain")):
                hint = (
                    " (framework baselines are registered by the raptor-retriever "
                    "distribution: `pip install 'raptor-retriever[eval]'`)"
                )
            msg = f"unknown retriever {name!r}; known: {', '.join(known)}, or module:Factory{hint}"
            raise InvalidParameterError(msg)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            msg = f"retriever {spec.name!r} is listed twice"
            raise InvalidParameterError(msg)
        seen.add(spec.name)
    return specs, skipped


# -- trees ---------------------------------------------------------------------------------------
def _describe(component: object) -> Any:
    from raptor_core.build.builder import describe

    return None if component is None else describe(component)


def _slug(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:80]
    if slug != name or not slug:
        slug = f"{slug or 'doc'}-{hashlib.sha1(name.encode('utf-8')).hexdigest()[:8]}"
    return slug


def _component_key(component: object) -> Any:
    """Class and constructor parameters of a component (not its state, such as call counters)."""
    if component is None:
        return None
    cls = type(component)
    get_params = getattr(component, "get_params", None)
    if callable(get_params):
        params = get_params()
    else:
        try:
            names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
        except (TypeError, ValueError):
            names = []
        params = {n: getattr(component, n) for n in names if hasattr(component, n)}
    scalars = {
        k: v
        for k, v in sorted(params.items())
        if v is None or isinstance(v, str | int | float | bool)
    }
    return [f"{cls.__module__}.{cls.__qualname__}", scalars]


#: Bumped when the same documents, components and parameters build another tree (a change
#: to the method itself), so that trees cached before are built again rather than reused.
#: 2: GMMClusterer's UMAP start computed with a dense eigensolver.
_BUILD_REVISION = 2


def _build_key(documents: Sequence[Document], builder: Any) -> str:
    payload = {
        "raptor_core": __version__,
        "build_revision": _BUILD_REVISION,
        "builder": builder.get_params(),
        "embedder": _component_key(builder.embedder),
        "summarizer": _component_key(builder.summarizer),
        "tokenizer": _component_key(builder.tokenizer),
        "chunker": _component_key(builder.chunker),
        "clusterer": _component_key(builder.clusterer),
        "documents": [
            [d.doc_id, hashlib.sha256(d.text.encode("utf-8")).hexdigest()] for d in documents
        ],
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def _tree_for(
    documents: Sequence[Document], builder: Any, cache: Path | None, name: str
) -> tuple[Tree, float, bool]:
    """The tree over ``documents`` and its build seconds; from the cache when it matches."""
    key = _build_key(documents, builder)
    directory = None if cache is None else cache / _slug(name)
    if directory is not None and (directory / _CACHE_KEY_FILE).is_file():
        try:
            # Data only: the key is compared, the seconds reported; nothing in the file picks
            # code or a path (the retrievers and the embedder come from the caller).
            meta = json.loads((directory / _CACHE_KEY_FILE).read_text(encoding="utf-8"))
            seconds = meta.get("build_seconds", 0.0) if isinstance(meta, dict) else None
            if (
                isinstance(meta, dict)
                and meta.get("key") == key
                and isinstance(seconds, int | float)
                and not isinstance(seconds, bool)
                and math.isfinite(seconds)
            ):
                tree = Tree.load(directory)
                return tree, float(seconds), True
        except (OSError, ValueError, RecursionError, TreeFormatError) as exc:
            logger.warning("ignoring the cached tree in %s: %s", directory, exc)
    started = time.perf_counter()
    tree = builder.build(list(documents))
    seconds = time.perf_counter() - started
    if directory is not None:
        tree.save(directory)
        meta = {"key": key, "build_seconds": seconds, "doc_ids": [d.doc_id for d in documents]}
        (directory / _CACHE_KEY_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return tree, seconds, False


# -- results -------------------------------------------------------------------------------------
def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.floor(q * len(ordered)))] if ordered else 0.0


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """The outcome of :func:`evaluate`.

    Attributes:
        config: how the run was set up (budgets, tree_per, models, seed, counts).
        rows: one dict per (question, retriever, budget): the metrics (None where the
            question has no gold of that kind), ``context_tokens``, ``latency_ms`` and
            ``embed_ms`` (the shared query embedding, when cached).
        summary: one dict per (retriever, budget): the means of the metrics over the
            questions that have them (``n_<metric>`` says how many), mean context tokens,
            and latency mean/p50/p95 in milliseconds.
        builds: per retriever, seconds spent building its indexes over all corpora
            (``"raptor tree"``: building the trees, shared by the RAPTOR strategies).
        skipped: retrievers that were requested but could not run, with the reason.
        environment: Python, platform, CPU and package versions.
    """

    config: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    builds: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def retrievers(self) -> list[str]:
        """Retriever names, in run order."""
        return list(dict.fromkeys(row["retriever"] for row in self.summary))

    @property
    def budgets(self) -> list[int]:
        """Token budgets, ascending."""
        return sorted({int(row["budget"]) for row in self.summary})

    @property
    def metrics(self) -> list[str]:
        """The metrics of :data:`METRICS` that at least one question could be scored on."""
        return [m for m in METRICS if any(row.get(m) is not None for row in self.summary)]

    def score(self, retriever: str, budget: int, metric: str) -> float | None:
        """The mean of ``metric`` for one retriever at one budget."""
        for row in self.summary:
            if row["retriever"] == retriever and row["budget"] == budget:
                value = row.get(metric)
                return None if value is None else float(value)
        msg = f"no result for retriever {retriever!r} at budget {budget}"
        raise KeyError(msg)

    def restrict(self, doc_ids: Iterable[str]) -> EvalResult:
        """The same run scored on the questions about ``doc_ids`` only (summary recomputed).

        Used to report a development half and a held-out half of the documents separately
        (:func:`~raptor_core.evaluation.data.holdout_split`).
        """
        keep = set(doc_ids)
        rows = [r for r in self.rows if r["doc_id"] in keep]
        budgets = sorted({int(r["budget"]) for r in rows})
        names = [n for n in self.retrievers if any(r["retriever"] == n for r in rows)]
        config = {
            **self.config,
            "documents": len({r["doc_id"] for r in rows}),
            "questions": len({r["question_id"] for r in rows}),
        }
        return EvalResult(
            config=config,
            rows=rows,
            summary=_summarize(rows, names, budgets),
            builds=self.builds,
            skipped=self.skipped,
            environment=self.environment,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (what ``results.json`` holds)."""
        return {
            "config": self.config,
            "environment": self.environment,
            "builds": self.builds,
            "skipped": self.skipped,
            "summary": self.summary,
            "rows": self.rows,
        }


def _summarize(
    rows: Sequence[Mapping[str, Any]], names: Sequence[str], budgets: Sequence[int]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in names:
        for budget in budgets:
            group = [r for r in rows if r["retriever"] == name and r["budget"] == budget]
            if not group:
                continue
            latencies = [float(r["latency_ms"]) for r in group]
            entry: dict[str, Any] = {"retriever": name, "budget": budget, "questions": len(group)}
            for metric in METRICS:
                values = [r[metric] for r in group if r[metric] is not None]
                entry[metric] = _mean(values)
                entry[f"n_{metric}"] = len(values)
            entry["reader_failures"] = sum(1 for r in group if r.get("reader_error"))
            entry["context_tokens"] = _mean(float(r["context_tokens"]) for r in group)
            entry["latency_ms_mean"] = statistics.fmean(latencies)
            entry["latency_ms_p50"] = _quantile(latencies, 0.5)
            entry["latency_ms_p95"] = _quantile(latencies, 0.95)
            embeds = [float(r["embed_ms"]) for r in group if r["embed_ms"] is not None]
            entry["embed_ms_p50"] = _quantile(embeds, 0.5) if embeds else None
            out.append(entry)
    return out


def environment() -> dict[str, Any]:
    """Where the run happened: Python, OS, CPU model and count, key package versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions: dict[str, str] = {"raptor-retriever": __version__}
    for dist in ("sentence-transformers", "torch", "llama-index-core", "langchain-core", "bm25s"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": len(affinity(0)) if affinity is not None else os.cpu_count(),
        "versions": versions,
    }


# -- the run -------------------------------------------------------------------------------------
def _read(
    reader: ChoiceReader | None, question: Question, context: Sequence[str]
) -> tuple[float | None, str | None]:
    """``(choice_accuracy, reader_error)`` of one context: 1 or 0, or None without a reader."""
    if reader is None or question.gold_option is None:
        return None, None
    try:
        picked = reader.choose(question.question, question.options, context)
    except LLMAuthenticationError:
        raise  # a bad key or model name: every question would fail the same way
    except LLMError as exc:
        # One question's failure (a timeout, an answer that names no option) scores 0 and
        # is counted, rather than ending a run of thousands of calls.
        return 0.0, str(exc)[:300]
    if (
        isinstance(picked, bool)
        or not isinstance(picked, int)
        or not 0 <= picked < len(question.options)
    ):
        msg = (
            f"the reader {reader!r} returned {picked!r} for question {question.question_id!r}, "
            f"not an option index in 0..{len(question.options) - 1}"
        )
        raise InvalidParameterError(msg)
    return float(picked == question.gold_option), None


def _read_all(
    reader: ChoiceReader | None,
    question: Question,
    contexts: Sequence[Sequence[str]],
    workers: int,
) -> list[tuple[float | None, str | None]]:
    """:func:`_read` for each context, ``workers`` at a time, in the order given."""
    if not contexts:
        return []
    if workers == 1 or len(contexts) == 1:
        return [_read(reader, question, context) for context in contexts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(workers, len(contexts))) as pool:
        futures = [pool.submit(_read, reader, question, context) for context in contexts]
        # The first error in submission order is raised; the pool waits for the others.
        return [future.result() for future in futures]


def _check_budgets(budgets: Sequence[int]) -> list[int]:
    if isinstance(budgets, int) or not budgets:
        msg = f"budgets must be a non-empty list of positive integers, got {budgets!r}"
        raise InvalidParameterError(msg)
    out = []
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            msg = f"budgets must be positive integers, got {b!r}"
            raise InvalidParameterError(msg)
        out.append(int(b))
    return sorted(set(out))


def unscorable(
    questions: Sequence[Question], *, reader: bool = False, ngram: int = DEFAULT_NGRAM
) -> list[Question]:
    """The questions that no metric of :func:`evaluate` can score.

    The metrics' own rules: a one-word or numeric answer and an evidence passage shorter
    than ``ngram`` words are never scored, and a multiple-choice question (``options`` and
    ``gold_option``) only with a ``reader``.
    """
    return [
        q
        for q in questions
        if not (
            scorable_answers(q.answers)
            or any(len(tokens(passage)) >= ngram for passage in q.evidence)
            or q.evidence_sections
            or q.evidence_turn_spans
            or (reader and q.gold_option is not None)
        )
    ]


def evaluate(
    documents: Sequence[Document],
    questions: Sequence[Question],
    *,
    retrievers: Iterable[str | RetrieverSpec] | None = None,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    tree_per: str = "doc",
    embedder: Embedder | None = None,
    summarizer: Summarizer | None = None,
    tokenizer: Tokenizer | None = None,
    llm: LLM | None = None,
    reader: ChoiceReader | None = None,
    reader_workers: int = 8,
    builder_params: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    random_state: int | None = 0,
    ngram: int = DEFAULT_NGRAM,
    cache_query_embeddings: bool = True,
    progress: ProgressCallback | None = None,
) -> EvalResult:
    """Build trees, run every retriever at every budget on every question, and score them.

    Args:
        documents: the documents (:func:`~raptor_core.evaluation.data.load_documents`).
        questions: the questions (:func:`~raptor_core.evaluation.data.load_questions`); only
            documents with questions are indexed.
        retrievers: names or specs (see :func:`resolve_retrievers`); None = all available.
        budgets: context budgets in tokens of ``tokenizer``; the paper's 400/1,000/2,000.
        tree_per: ``"doc"`` builds one tree (and one index per baseline) per document and
            searches only the question's document; ``"all"`` builds one over all documents.
        embedder: the embedding model shared by every retriever (default: the packaged
            all-MiniLM-L6-v2).
        summarizer: the tree's summariser (default: the offline extractive one).
        tokenizer: counts budget tokens and builds chunks (default: ``cl100k_base``).
        llm: enables the ``llm`` and ``hybrid`` strategies.
        reader: answers the multiple-choice questions (those with ``options``) from each
            retriever's context, scored as ``choice_accuracy`` (for example
            :class:`~raptor_core.evaluation.readers.LLMChoiceReader`); one call per question,
            retriever and budget.  None: multiple-choice questions get no score.  A reader
            error other than a rejected request (timeout, an answer naming no option)
            scores that question 0 and is counted in the summary's ``reader_failures``.
        reader_workers: how many of a question's contexts the reader answers at once (in
            threads: its calls mostly wait on the model's service); 1 answers them in turn.
        builder_params: extra :class:`~raptor_core.build.builder.TreeBuilder` parameters
            (``chunk_max_tokens``, ``max_layers``, ...).
        cache_dir: trees are saved under ``cache_dir/<doc_id>`` and reused by later runs
            with the same documents, models and parameters.
        random_state: seed of the tree builds.
        ngram: run length of the text-matching metrics (see
            :mod:`~raptor_core.evaluation.metrics`).
        cache_query_embeddings: embed each question once, before the retrievers run, and
            serve that vector to all of them (:class:`QueryCachingEmbedder`): latencies then
            measure search without the (identical) query embedding, reported apart as
            ``embed_ms``.  False: every retriever embeds the question itself, inside its
            timed call.
        progress: ``progress(stage, done, total)`` callback.

    Raises:
        InvalidInputError: no questions, a question about a document not given, or no
            question with gold a metric can score (see :func:`unscorable`).
        InvalidParameterError: a bad budget, ``tree_per`` or retriever name, or a reader
            that returns no option index.
        LLMAuthenticationError: the reader's model rejected a request (bad key, unknown
            model): every later call would fail too.
    """
    from raptor_core.build.builder import TreeBuilder
    from raptor_core.tokenizers import default_tokenizer

    budgets = _check_budgets(budgets)
    if (
        isinstance(reader_workers, bool)
        or not isinstance(reader_workers, int)
        or reader_workers < 1
    ):
        msg = f"reader_workers must be a positive integer, got {reader_workers!r}"
        raise InvalidParameterError(msg)
    if tree_per not in ("doc", "all"):
        msg = f"tree_per must be 'doc' or 'all', got {tree_per!r}"
        raise InvalidParameterError(msg)
    questions = list(questions)
    if not questions:
        msg = "no questions to evaluate"
        raise InvalidInputError(msg)
    check_questions(questions, documents)
    if len(unscorable(questions, reader=reader is not None, ngram=ngram)) == len(questions):
        # Building every tree (the expensive part) would end in null metrics only.
        hint = ""
        if reader is None and any(q.gold_option is not None for q in questions):
            hint = "; multiple-choice questions are scored only with a reader= (LLMChoiceReader)"
        msg = (
            f"none of the {len(questions)} questions has gold a metric can score, so every "
            "score would be null: give questions evidence (passages copied from the "
            f"document, of {ngram} or more words), answers (of 2 or more words, not numbers), "
            f"evidence_sections or evidence_turn_spans, or options with gold_option{hint} "
            "(see docs/evaluation.md, Input format)"
        )
        raise InvalidInputError(msg)
    specs, skipped = resolve_retrievers(retrievers, llm=llm)
    if not specs:
        msg = f"no retriever can run: {skipped}"
        raise InvalidParameterError(msg)
    if embedder is None:
        from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

        embedder = SentenceTransformerEmbedder()
    tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
    builder = TreeBuilder(
        embedder,
        summarizer,
        tokenizer=tokenizer,
        random_state=random_state,
        **dict(builder_params or {}),
    )
    asked = {q.doc_id for q in questions}
    docs = [d for d in documents if d.doc_id in asked]
    groups = [(d.doc_id, [d]) for d in docs] if tree_per == "doc" else [("all", docs)]
    cache = None if cache_dir is None else Path(cache_dir)
    texts = {d.doc_id: d.text for d in docs}
    query_embedder: Embedder = (
        QueryCachingEmbedder(embedder) if cache_query_embeddings else embedder
    )

    builds: dict[str, float] = {"raptor tree": 0.0, **{s.name: 0.0 for s in specs}}
    tree_stats = {"trees": 0, "cached": 0, "nodes": 0, "leaves": 0}
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    n_done, n_total = 0, len(questions)
    reads: list[tuple[int, list[str]]] = []  # (row, context) of one question, for the reader
    for g, (name, group_docs) in enumerate(groups):
        tree, seconds, cached = _tree_for(group_docs, builder, cache, name)
        builds["raptor tree"] += seconds
        tree_stats["trees"] += 1
        tree_stats["cached"] += int(cached)
        tree_stats["nodes"] += len(tree)
        tree_stats["leaves"] += len(tree.leaves)
        if progress is not None:
            progress("trees", g + 1, len(groups))
        corpus = EvalCorpus(
            name=name,
            documents=tuple(group_docs),
            tree=tree,
            embedder=query_embedder,
            tokenizer=tokenizer,
            llm=llm,
            random_state=random_state,
        )
        built: list[tuple[str, ContextRetriever]] = []
        for spec in specs:
            if spec.name in failed:
                continue
            started = time.perf_counter()
            try:
                retriever = spec.factory(corpus)
            except MissingDependencyError as exc:
                failed[spec.name] = f"not installed ({exc})"
                logger.warning("skipping %s: %s", spec.name, exc)
                continue
            builds[spec.name] += time.perf_counter() - started
            built.append((spec.name, retriever))
        ids = {d.doc_id for d in group_docs}
        for question in (q for q in questions if q.doc_id in ids):
            units = gold_units(question, texts[question.doc_id])
            embed_ms = None
            if cache_query_embeddings:
                started = time.perf_counter()
                query_embedder.embed_query(question.question)
                embed_ms = (time.perf_counter() - started) * 1000.0
            # Interleave retrievers per question, so caches and machine load hit all alike.
            for budget in budgets:
                for spec_name, retriever in built:
                    started = time.perf_counter()
                    raw = retriever.retrieve(question.question, max_tokens=budget)
                    latency = (time.perf_counter() - started) * 1000.0
                    kept, used, cut = fit_budget(list(raw), budget, tokenizer)
                    ctx = Context.from_texts(kept, ngram=ngram)
                    if reader is not None and question.gold_option is not None:
                        reads.append((len(rows), kept))
                    rows.append(
                        {
                            "doc_id": question.doc_id,
                            "question_id": question.question_id,
                            "retriever": spec_name,
                            "budget": budget,
                            "evidence_recall": evidence_recall(question.evidence, ctx),
                            "answer_recall": answer_recall(question.answers, ctx),
                            "span_recall": span_recall(units, ctx) if units else None,
                            "span_precision": span_precision(units, ctx) if units else None,
                            "choice_accuracy": None,  # filled in by the reader below
                            "reader_error": None,
                            "context_tokens": used,
                            "texts": len(kept),
                            "cut": cut,
                            "latency_ms": latency,
                            "embed_ms": embed_ms,
                        }
                    )
            # The reader answers every context of the question at once (model calls wait on
            # the network, and retrieval has been timed already).
            for (at, _), (choice, reader_error) in zip(
                reads,
                _read_all(reader, question, [kept for _, kept in reads], reader_workers),
                strict=True,
            ):
                rows[at]["choice_accuracy"], rows[at]["reader_error"] = choice, reader_error
            reads.clear()
            n_done += 1
            if progress is not None:
                progress("questions", n_done, n_total)
    skipped.update(failed)
    names = [s.name for s in specs if s.name not in failed]
    for name in failed:
        builds.pop(name, None)
        rows = [r for r in rows if r["retriever"] != name]
    config = {
        "budgets": budgets,
        "tree_per": tree_per,
        "retrievers": names,
        "documents": len(docs),
        "questions": len(questions),
        "embedder": _describe(embedder),
        "summarizer": _describe(summarizer) or "ExtractiveSummarizer (default)",
        "tokenizer": _describe(tokenizer),
        "llm": _describe(llm),
        "reader": _describe(reader),
        "builder": builder.get_params(),
        "random_state": random_state,
        "ngram": ngram,
        "cache_query_embeddings": cache_query_embeddings,
        **tree_stats,
    }
    return EvalResult(
        config=config,
        rows=rows,
        summary=_summarize(rows, names, budgets),
        builds=builds,
        skipped=skipped,
        environment=environment(),
    )
