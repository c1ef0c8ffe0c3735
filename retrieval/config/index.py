"""The ``index`` section (the FAISS index over the catalogue) and ``faiss_index_problem``, the check
that FAISS can build the factory string and apply the search parameters, run when a config is loaded."""

from __future__ import annotations

import math
import re

from pydantic import Field, model_validator

from retrieval.config.base import Seed, _Section

# index.factory auto searches exactly while a query scans at most this many floats (items x dim): 100,000 items
# at 256 dims, the largest measured catalogue whose exact single-query p99 stayed within 5 ms, half of the
# 10 ms a query over HTTP is held to (benchmarks/results/bench_index_auto.md).
EXACT_MAX_FLOATS = 100_000 * 256


class IndexConfig(_Section):
    """The FAISS index over every catalogue item (inner product; cosine when towers normalise).

    Approximate indexes are tuned after building: the fastest nprobe / efSearch
    / ... setting whose recall@``tune_k`` against exact search reaches
    ``target_recall`` on held-out queries is kept with the index.
    """

    factory: str = Field(
        "auto",
        description='FAISS index factory string: "Flat", "IVF1024,Flat", "HNSW32", "OPQ16,IVF1024,PQ16", ...; '
        "auto = Flat (exact) up to exact_max_items catalogue items, else IVF<nlist>,Flat with nlist the power of "
        "2 nearest 4 sqrt(items), tuned to target_recall. The factory used is in the manifest (index.factory) "
        "and metrics.json (derived).",
    )
    exact_max_items: int | None = Field(
        None,
        gt=0,
        description="factory auto: the largest catalogue searched exactly (Flat); None = EXACT_MAX_FLOATS / the "
        "embedding dimension (100,000 items at 256 dims, 400,000 at 64): exact search scans items x dim floats a "
        "query, and that size is the largest whose single-query p99 stayed within 5 ms in "
        "benchmarks/results/bench_index_auto.md (python -m benchmarks.bench_index_auto).",
    )
    train_sample_size: int = Field(
        200_000, gt=0, description="Indexes that need training (IVF, PQ, OPQ) train on at most this many items."
    )
    target_recall: float = Field(
        0.95, gt=0, le=1, description="Recall@tune_k vs exact search the tuned search parameters must reach."
    )
    tune_k: int = Field(100, gt=0, description="The k of the recall that tuning measures.")
    tune_queries: int = Field(
        1000, ge=2, description="Queries sampled for tuning: half choose the setting, half measure its recall."
    )
    search_params: str | None = Field(
        None, description='Fixed FAISS search parameters, e.g. "nprobe=32" (recall is still measured); None = tune.'
    )
    seed: Seed = Field(0, description="Seed of the training and tuning samples.")

    def factory_for(self, num_items: int, dim: int) -> str:
        """The FAISS factory string this config builds over ``num_items`` vectors of ``dim`` floats (auto resolved)."""
        if self.factory != "auto":
            return self.factory
        exact_max_items = self.exact_max_items or EXACT_MAX_FLOATS // dim
        if num_items <= exact_max_items:
            return "Flat"
        nlist = 2 ** round(math.log2(4 * math.sqrt(num_items)))
        return f"IVF{nlist},Flat"

    @model_validator(mode="after")
    def _auto_has_no_fixed_parameters(self) -> IndexConfig:
        if self.factory == "auto" and self.search_params:
            raise ValueError(
                f"index.search_params {self.search_params!r} fix one factory's parameters, but index.factory is auto "
                "(Flat or IVF by catalogue size): set index.factory too"
            )
        return self


def faiss_index_problem(factory: str, search_params: str | None, dim: int) -> str | None:
    """Why FAISS cannot build ``factory`` over ``dim``-dimensional vectors or apply ``search_params``
    to it; None when it can.

    An empty index is made from the factory string (FAISS imported here, only
    when the factory is not the default ``Flat``), and the parameters are set
    on it. IVF list counts are capped for this check, since an IVF index
    allocates its lists when made; they are validated against the catalogue
    when the index is trained.
    """
    if factory in ("Flat", "auto") and not search_params:
        return None  # auto builds Flat or IVF<n>,Flat, both valid for any dimension
    import faiss  # here, so that loading a config imports FAISS only when it has to check one

    # IVF lists and PQ codebooks are allocated when the index is made (PQ8x24 takes 4 GB): shrink
    # them for the check. Neither number changes whether the string parses.
    probe = re.sub(r"IVF(\d+)", lambda m: f"IVF{min(int(m.group(1)), 64)}", factory)
    probe = re.sub(r"(PQ\d+)x(\d+)", lambda m: f"{m.group(1)}x{min(int(m.group(2)), 8)}", probe)
    try:
        index = faiss.index_factory(dim, probe, faiss.METRIC_INNER_PRODUCT)
    except Exception as error:  # FAISS raises RuntimeError with a C++ trace; SWIG may raise TypeError
        return f"index.factory {factory!r} is not a FAISS index for model.embedding_dim={dim}: {_faiss_reason(error)}"
    if not search_params:
        return None
    try:
        # faiss's stub lists the (cno: int) and (param_string: str) overloads without @overload.
        faiss.ParameterSpace().set_index_parameters(index, search_params)  # type: ignore[arg-type]
    except Exception as error:
        reason = _faiss_reason(error)
        return f"index.search_params {search_params!r} do not apply to index.factory {factory!r}: {reason}"
    for pair in search_params.split(","):
        name, _, value = (part.strip() for part in pair.partition("="))
        if name in ("nprobe", "efSearch", "k_factor") and not _number(value) >= 1:  # NaN fails too
            return f"index.search_params {search_params!r}: {name} must be a number >= 1, got {value!r}"
    return None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _faiss_reason(error: Exception) -> str:
    """The last line of a FAISS error ("Error: '...' failed: ..."), without the C++ location."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    text = re.sub(r"^Error in .*? at \S+:\d+: ", "", text)
    return text.split(" Error: ", 1)[-1].strip()
