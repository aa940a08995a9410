"""The zoo's report: the row schema, the printed table, docs/zoo.md and docs/zoo.png."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform

import torch

from zoo_models import EDITS

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Result:
    """One row of the zoo table (``None``: not measured, shown as ``—``)."""

    name: str
    what: str
    unchanged: str = "?"  # "yes", or the error
    edits: tuple[str, ...] = ()
    max_diff: float | None = None
    out_scale: float | None = None  # max |output| of the per-sample reference
    grad_scale: float | None = None  # max |parameter gradient| of the per-sample reference
    grad_diff: float | None = None
    padless_ms: float | None = None
    padded_ms: float | None = None
    speedup: float | None = None
    occupancy: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    fallbacks: list[str] = dataclasses.field(default_factory=list)  # ops padless ran sample by sample


# ----------------------------------------------------------------------------- report

def _fmt(v: float | None, spec: str, of: float | None = None) -> str:
    """``v`` formatted, ``—`` when absent; ``of``: the scale it is read against (`diff / scale`)."""
    if v is None:
        return "—"
    return format(v, spec) + ("" if of is None else f" / {of:.1e}")


HEADER = (
    "| model | input | runs unchanged | edits applied | max diff (eval, fp32) / max abs output "
    "| grad diff / max abs grad | padless step (ms) | padded step (ms) | speed-up | occupancy | ops run per sample |"
)


def table(results: list[Result]) -> str:
    """The markdown table, one row per model (docs/zoo.md pastes it as printed)."""
    lines = [HEADER, "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        unchanged = "; ".join([r.unchanged] + r.notes).replace("|", "\\|")
        speed = "—" if r.speedup is None else f"{r.speedup:.2f}x"
        cells = [
            r.name, r.what, unchanged, ", ".join(r.edits) or "—",
            _fmt(r.max_diff, ".1e", r.out_scale), _fmt(r.grad_diff, ".1e", r.grad_scale),
            _fmt(r.padless_ms, ",.1f"), _fmt(r.padded_ms, ",.1f"), speed, _fmt(r.occupancy, ".2f"),
            ", ".join(r.fallbacks) or "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    import importlib.metadata as md

    def v(p: str) -> str:
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return "absent"

    pk = ", ".join(f"{p} {v(p)}" for p in ("timm", "segmentation-models-pytorch", "boltz", "transformers", "torchrec", "fbgemm-gpu-cpu"))
    return (f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
            f"Python {platform.python_version()}, torch {torch.__version__} (CUDA build, run on the CPU), "
            f"torchvision {v('torchvision')}; {pk}")


def plot(results: list[Result], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 6))
    occ = [i / 100 for i in range(10, 101)]
    ax.plot(occ, [1 / o for o in occ], "--", color="grey", label="1 / occupancy (ideal)")
    ax.axhline(1.0, color="black", lw=0.8)
    markers = "osD^vP*Xhp<>"
    for k, r in enumerate(results):
        if r.speedup is None or r.occupancy is None:
            continue
        ax.scatter(r.occupancy, r.speedup, s=45, marker=markers[k % len(markers)], color=f"C{k % 10}",
                   label=f"{k + 1}. {r.name}" + (" *" if r.edits else ""))
        ax.annotate(str(k + 1), (r.occupancy, r.speedup), fontsize=7, xytext=(5, 2 + 7 * (k % 3)), textcoords="offset points")
    missing = [r.name for r in results if r.speedup is None]
    if missing:
        ax.text(0.01, 0.01, "not timed: " + ", ".join(missing), transform=ax.transAxes, fontsize=6, va="bottom", wrap=True)
    ax.set_xlabel("occupancy (real elements / padded envelope)")
    ax.set_ylabel("train step speed-up vs padded")
    ax.set_xlim(0, 1.05)
    ax.set_yscale("log")
    ax.set_title(f"padless model zoo, {datetime.date.today().isoformat()} (* = with a named edit)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


DOC_HEAD = """# Model zoo

`make zoo` builds its own environment (`zoo/.venv`, never the test one) with real model
packages, runs every model below on padless input and prints this table; it also writes
this page and [the picture](zoo.png). Random initialisation only: nothing is downloaded at
run time (`pretrained=False`, `encoder_weights=None`, transformers models from a config).

```
make zoo                                       # build zoo/.venv if needed, run, write docs/zoo.md and docs/zoo.png
zoo/.venv/bin/python benchmarks/zoo.py --only bert,resnet18 --no-docs   # some rows, print only
```

## What a row says

- **runs unchanged**: `yes` when the model's forward runs as the package ships it on padless
  input (images `padless.from_list` of `(3, H_i, W_i)`, tokens of `(L_i, 128)`, pair states
  `(N_i, N_i, C)` with their masks as NestedTensors of ones, a padless `KeyedJaggedTensor`);
  otherwise the error it raised: class, first line, and where (the model package's line,
  then padless' line, that raised).
- **edits applied**: the named edits (monkeypatches of the package, listed below with why)
  the zoo applied so that the rest of the row could still be measured; `—` for none.
- **max diff**: eval mode, float32; the padless output unbound per sample against the
  model run on that sample alone (a batch of one); the largest absolute difference, then
  the largest absolute output of the per-sample runs for scale. Every all-zero parameter
  is first filled with small random values (boltz zero-initialises the last projection of
  each residual branch, timm the last BatchNorm scale of each block), so that every
  branch is compared.
- **grad diff** (one model per family): parameter gradients of the summed per-sample losses
  (each output's mean square) on the padless batch against the sum of the per-sample runs'
  gradients, in eval mode (BatchNorm then uses its running statistics, so samples stay
  independent); the largest absolute difference, then the largest absolute gradient.
- **train step**: forward + backward in training mode, padless against the padded batch of
  the same samples (zeros up to the envelope, with the attention / padding masks the
  package takes), interleaved repeats, medians; **speed-up** is the median of per-round
  padded / padless ratios. Times are the CPU time of the process with one torch thread
  (`--threads 1 --clock cpu`, the default: steady while other processes share the
  machine; `--clock wall --threads 2` measures wall-clock time instead). **occupancy** is
  real elements / padded envelope elements (image pixels, token rows, pair cells, ids);
  1 / occupancy is the ideal speed-up.
  Dropout is off (boltz `dropout=0.0`, BERT's dropout probabilities 0; boltz still builds
  its dropout masks), so both sides do the same work.
- **ops run per sample**: the ops padless had no handler for and ran sample by sample (its
  one-time fallback warning, recorded per row): correct, but a Python loop.

The FlatteningCollator rows feed `model(**FlatteningCollator()(features))`: one packed
`(1, T)` row of `input_ids` with `position_ids` and `cu_seq_lens_*`, with the model's
attention set to `"padless"` (registered by `import padless.hf`: per-document attention
on the packed rows from `cu_seq_lens`, no T x T mask); the padded baseline keeps sdpa with
its `attention_mask`. The model sees plain tensors. The TorchRec rows give
the padless `KeyedJaggedTensor` to `EmbeddingBagCollection` / `EmbeddingCollection` as it is
(no `to_torchrec()`); their padded baseline looks the same tables up with `F.embedding` on
`(B, L_max)` ids and a mask, per key.
"""

DOC_INSTALL = """## The environment

- **torch**: the CUDA build of `torch==2.13.0` from the package registry (`torch===2.13.0`,
  which the local CPU wheel `2.13.0+cpu` does not match), run on the CPU. The CPU wheel
  was tried first: the registry's `torchvision==0.28.0` wheel is a CUDA build whose C ops do
  not load next to the CPU torch, and torchvision 0.28 then fails at import
  (`RuntimeError: operator torchvision::nms does not exist`, raised by its
  `_meta_registrations.py`), so timm and segmentation-models-pytorch (which import
  torchvision) cannot load at all. The CUDA wheel costs about 5 GiB of disk in `zoo/.venv`
  (the nvidia-* libraries); the test environment keeps the CPU wheel.
- **torchvision 0.28.0**, **boltz 2.2.1** (its model layers only; boltz's own pins would
  replace torch), **torchrec 1.8.0** and **fbgemm-gpu-cpu 1.8.0** are installed with
  `--no-deps`; fbgemm-gpu-cpu 1.9.0 does not load against torch 2.13 (an undefined
  `torch::autograd::_wrap_outputs` symbol), 1.8.0 does. The rest (timm, smp, transformers 5.x,
  einops, scipy, tensordict, torchmetrics, ...) comes from `zoo/requirements.txt`, all under
  `zoo/constraints.txt` (torch pinned), and padless itself with `pip install -e . --no-deps`.
- Building `zoo/.venv` from nothing and running the zoo took 2 min 17 s on this project's
  machine (most of it the torch wheel and its nvidia-* libraries); later `make zoo` runs
  reuse the environment (a stamp file, rebuilt when `zoo/requirements.txt` or
  `zoo/constraints.txt` change) and take well under a minute.
- Nothing is fetched at run time: timm and smp models with `pretrained=False` /
  `encoder_weights=None`, transformers models from a config, boltz and TorchRec modules
  built directly.
"""


def write_docs(results: list[Result], printed: str, elapsed: float, args: argparse.Namespace, families: str = "") -> None:
    used = sorted({e for r in results for e in r.edits})
    failing = [r for r in results if r.unchanged != "yes"]
    parts = [DOC_HEAD, "## The table\n",
             f"Run {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} with "
             f"`make zoo` ({args.rounds} interleaved rounds per row, "
             f"{'CPU time of the process' if args.clock == 'cpu' else 'wall-clock time'}, {elapsed:.0f} s in all) "
             f"on {machine()}.\n",
             printed, "", "![speed-up against occupancy](zoo.png)\n", "## Edits and failures\n"]
    if used:
        parts.append("Named edits the zoo applied in this run:\n")
        parts += [f"- `{n}`: {EDITS[n].why}." for n in used]
        parts.append("")
    if failing:
        parts.append("Rows that did not run unchanged, with the error the unchanged model raised:\n")
        for r in failing:
            tail = f" Then: {'; '.join(r.notes)}." if r.notes else ""
            parts.append(f"- **{r.name}**: `{r.unchanged}`.{tail}")
        parts.append("")
    else:
        parts.append("Every row ran unchanged.\n")
    if families:
        parts += ["## More families, values only\n",
                  "`benchmarks/zoo_families.py` builds more architectures of the same packages (random init, eval, "
                  "float32) and runs each once on a padless batch, every sample against the model on that sample "
                  "alone; no timing. A row that fails says whether the model rejects a sample alone too (then the "
                  "sizes, not padless, are the limit).\n", families, ""]
    parts.append(DOC_INSTALL)
    (ROOT / "docs" / "zoo.md").write_text("\n".join(parts))
