"""One bench run from loaded model and chosen contenders to the files in the output directory.

The command line builds the contenders; taking them as an argument here is what lets a test
add a deliberately broken one and check that the report catches it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..prompts import Prompt
from .contenders import Contender, params_provenance
from .machine import machine_info
from .plots import plot_acceptance, plot_category_speedup, plot_speedup
from .report import results_document
from .runner import measure
from .sampling import Sampling

RESULTS_FILE = "results.json"
SPEEDUP_PLOT = "speedup.png"
CATEGORY_PLOT = "speedup_by_category.png"
ACCEPTANCE_PLOT = "acceptance.png"
OUTPUT_FILES = (RESULTS_FILE, SPEEDUP_PLOT, CATEGORY_PLOT, ACCEPTANCE_PLOT)


def run_benchmark(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    contenders: Sequence[Contender],
    *,
    max_new_tokens: int,
    repeats: int,
    output_dir: str | Path,
    sampling: Sampling | None = None,
    command: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure, greedily or with `sampling`, then write `results.json`, `speedup.png`,
    `speedup_by_category.png` and `acceptance.png`; returns the results. An interrupted run
    writes the prompts it finished (`runner.measure`).

    The output directory is created first so that an unwritable path fails before, not after,
    minutes of measuring."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    measurements = measure(
        model,
        tokenizer,
        prompts,
        contenders,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        sampling=sampling,
        progress=progress,
        keep_when_interrupted=True,
    )
    results = results_document(
        measurements,
        machine=machine_info(model),
        skip_sets=params_provenance(model),
        command=command or {},
    )
    (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    plot_speedup(results, output_dir / SPEEDUP_PLOT)
    plot_category_speedup(results, output_dir / CATEGORY_PLOT)
    plot_acceptance(results, output_dir / ACCEPTANCE_PLOT)
    return results
