"""The planner figures README.md and docs/planner.md quote, recomputed from the commands they show:
check or rewrite them.

    python bench/readme_figures.py --check   # exit 1 naming each differing figure (tests/e2e/test_readme.py)
    python bench/readme_figures.py --write   # rewrite those figures in both documents, in place

Two kinds of quote:

* a ```text block right after a ```bash block of ``python -m nodetrain.plan ...`` commands: each of
  its lines is a line one of those commands prints, up to a ``...`` where the README elides the rest;
* a figure in prose: :data:`PROSE` names its command (which the README must show), the sentence with
  ``{name}`` where a figure stands, and where each figure is in that command's output.

The planner is pure arithmetic: every command runs in this process (Hydra's compose API, the same
config the CLI composes) and all of them together take seconds. Planner changes move the figures;
regenerate them with ``--write`` and read the diff.
"""

from __future__ import annotations

import argparse
import functools
import io
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PLANNER_DOC = ROOT / "docs" / "planner.md"
OPTIMIZER_DOC = ROOT / "docs" / "optimizer.md"
DOCS = {"README.md": README, "docs/planner.md": PLANNER_DOC, "docs/optimizer.md": OPTIMIZER_DOC}
"""Each document whose planner figures are checked, by the name :attr:`Prose.doc` gives it."""
PLAN = "python -m nodetrain.plan"
_NUM = r"-?(?:\d[\d,]*)?\.?\d+"
"""A figure as the planner prints it: ``6,894``, ``0.596``, ``38.7``, ``-4``."""


@dataclass(frozen=True)
class Prose:
    """Figures of one sentence: ``text`` with ``{name}`` placeholders, each found in the output of
    ``command`` (the arguments after ``python -m nodetrain.plan``, as the README shows them) by the
    regex (first group) or function in ``values``."""

    command: str
    text: str
    values: dict[str, str | tuple[str, str] | Callable[[str], str]]
    doc: str = "docs/planner.md"
    """The document (a key of :data:`DOCS`) that quotes the sentence and shows its command."""


def _row(label: str, column: int = 1) -> str:
    """Regex of a step-time table row's figure: ``column`` 1 = its seconds, 2 = its share (%)."""
    cells = r"[^│]*│\s*([\d.,]+)\s*│" if column == 1 else r"[^│]*│\s*[\d.,]+\s*│\s*(\d+)%"
    return re.escape(label) + cells


def _scales(out: str) -> str:
    """Bytes/param of both block-scale rows of the lean store table, summed (the README quotes one)."""
    rows = re.findall(r"│ exp_avg(?:_sq)? block scales \([^)]*\)\s*│\s*[\d.]+\s*│\s*([\d.,]+)", out)
    params = float(_find(r"\(([\d,.]+)B parameters", out).replace(",", "")) * 1e9
    return f"{sum(float(r.replace(',', '')) for r in rows) * 1e9 / params:.2f}"


def _years(days_regex: str) -> Callable[[str], str]:
    def years(out: str) -> str:
        return f"{float(_find(days_regex, out).replace(',', '')) / 365.25:,.0f}"

    return years


_70B = (
    "model=llama2_70b hardware=h100_sxm train.seq_len=4096 train.micro_batch_size=4 pipeline.microbatches=64"
)
_70B_BUDGET = f"{_70B} plan.train_tokens=2e12 plan.days=30"
_70B_1T = f"{_70B} stream.accum_threads=1 stream.accum_help=false"
_70B_LEAN = _70B.replace("h100_sxm", "h100_sxm hardware.host_memory_gb=1024 optim.state=lean")
_1T = "model=llama_1t hardware=h100_sxm train.seq_len=4096 train.micro_batch_size=1 pipeline.microbatches=32"
_1T_20TB = _1T.replace("h100_sxm", "h200 hardware.host_memory_gb=20480") + " plan.train_tokens=1e12"
_3B = (
    "model=llama3_2_3b hardware=h200_1gpu train.seq_len=4096 train.micro_batch_size=2 pipeline.microbatches=4"
)
_3B_HOST = f"{_3B} optim.on_device=false stream.recompute=true"
"""The 3B shape as the first GPU run ran it: every optimizer on the host, every layer recomputed."""
_TPS = r"throughput: ([\d,]+) tokens/s"
_MOE_BATCH = "train.seq_len=4096 train.micro_batch_size=8 pipeline.microbatches=64"


def _moe(model: str, hardware: str, state: str) -> str:
    """The FAQ's command for a mixture of experts on an 8-GPU node (docs/planner.md's table)."""
    return f"model={model} hardware={hardware} optim.state={state} {_MOE_BATCH}"


_MFU = r"; MFU ([\d.]+)%"
_EXPOSED = r"optimizer exposed per step \(s\): deferred ([\d.]+)"

PROSE: list[Prose] = [
    Prose(
        _3B_HOST,
        "the planner predicts {deferred} s of the {serial} s of AdamW exposed deferred",
        {"deferred": _EXPOSED, "serial": r"serial ([\d.]+)"},
        doc="docs/optimizer.md",
    ),
    Prose(
        _3B,
        "With the defaults (`optim.on_device=auto`, `stream.recompute=auto`) the same shape keeps every "
        "unit's AdamW on the device and every layer's activations: the step is {step} s ({device} s of "
        "it the device's AdamW), {tps} tokens/s, MFU {mfu}%.",
        {
            "step": r"│ step\s*│\s*([\d.]+)",
            "device": _row("device AdamW of the units kept on the device"),
            "tps": _TPS,
            "mfu": _MFU,
        },
        doc="docs/optimizer.md",
    ),
    Prose(
        _3B_HOST,
        "{speculative} s speculative ({clipped} s on a step that clips); the step is {step} s, MFU {mfu}%",
        {
            "speculative": r"speculative ([\d.]+)",
            "clipped": r"\(([\d.]+) on a step that clips",
            "step": r"│ step\s*│\s*([\d.]+)",
            "mfu": _MFU,
        },
        doc="docs/optimizer.md",
    ),
    Prose(
        "hardware=cpu",
        "For the default job (`hardware=cpu`): {deferred} s deferred, {speculative} s speculative "
        "({clipped} s on a step that clips), of {step} s steps.",
        {
            "deferred": _EXPOSED,
            "speculative": r"speculative ([\d.]+)",
            "clipped": r"\(([\d.]+) on a step that clips",
            "step": r"│ step\s*│\s*([\d.]+)",
        },
        doc="docs/optimizer.md",
    ),
    Prose(
        _70B_BUDGET,
        "bytes/param = {store} GB of the DGX H100's {host} GB ({need} GB with the ranks' overhead and D2H "
        "staging buffers), and the busiest GPU peaks at {peak} of its {usable} usable GB",
        {
            "store": r"│ host store\s*│\s*[\d.]+\s*│\s*([\d,.]+)",
            "host": r"host need / host memory\s*│\s*│\s*[\d,.]+ / ([\d,.]+)",
            "need": r"host need / host memory\s*│\s*│\s*([\d,.]+)",
            "peak": r"│\s*0 │[^\n]*│\s*([\d.]+) │\s*[\d.]+ │\n",
            "usable": r"│\s*0 │[^\n]*│\s*[\d.]+ │\s*([\d.]+) │\n",
        },
    ),
    Prose(
        _70B_BUDGET,
        "predicts a compute-bound step (H2D {h2d}%, the host accumulation on 7 threads per rank "
        "{accum}% and the node's host DRAM traffic, {dram} GB per step, {dram_share}% of it, hidden; "
        "of the CPU optimizer's {optim} s, the {exposed} s",
        {
            "h2d": _row("H2D: weight prefetch", 2),
            "accum": _row("host accumulation", 2),
            "dram": r"host DRAM: ([\d,.]+) GB/step",
            "dram_share": _row("host DRAM:", 2),
            "optim": _row("CPU optimizer"),
            "exposed": _EXPOSED,
        },
    ),
    Prose(
        _70B_BUDGET,
        "are added), {tps} tokens/s = {tpd}B tokens/day, MFU {mfu}% (the ceiling at 60% matmul "
        "efficiency with recompute is 45%, less the {bubble}% bubble)",
        {"tps": _TPS, "tpd": r"= ([\d.]+)B tokens/day", "mfu": _MFU, "bubble": _row("pipeline bubble", 2)},
    ),
    Prose(
        _70B_1T,
        "the same step is host accumulation-bound: {tps} tokens/s, MFU {mfu}%.",
        {"tps": _TPS, "mfu": _MFU},
    ),
    Prose(
        _70B_BUDGET,
        "Llama 2's 2T tokens then take {days} days on one node; to finish in 30 days you need "
        "**{nodes} nodes = {gpus} H100s**",
        {
            "days": r"\(plan.train_tokens\) = ([\d,.]+) days",
            "nodes": r"to finish in 30 days: ([\d,]+) nodes",
            "gpus": r"nodes = ([\d,]+) GPUs",
        },
    ),
    Prose(
        _70B,
        "The Chinchilla budget (20 tokens/param, {tokens}B tokens) takes {days} days on one node",
        {"tokens": r"training budget: ([\d,.]+)B tokens", "days": r"Chinchilla\) = ([\d,.]+) days"},
    ),
    Prose(
        _70B_LEAN,
        "needs a {store} GB store ({need} GB with the ranks' overhead and staging), so it fits a **1 TB "
        "node** ({share}% of it) as well as the 2 TB DGX, with the same predicted step ({tps} tokens/s",
        {
            "store": r"│ host store\s*│\s*[\d.]+\s*│\s*([\d,.]+)",
            "need": r"host need / host memory\s*│\s*│\s*([\d,.]+)",
            "share": r"host need / host memory\s*│\s*│[^(]*\((\d+)%\)",
            "tps": _TPS,
        },
    ),
    Prose(
        _70B_LEAN,
        "The planner prints {total} bytes/param (fp32 gradient {grad}, bf16 master = transfer copy {master}, "
        "8-bit `exp_avg_sq` {sq}, 4-bit `exp_avg` {avg}, block scales {scales})",
        {
            "total": r"│ host store\s*│\s*([\d.]+)",
            "grad": r"│ gradient accumulator \(fp32\)\s*│\s*([\d.]+)",
            "master": r"│ master weights = transfer copy \(bfloat16\)\s*│\s*([\d.]+)",
            "sq": r"│ AdamW exp_avg_sq \(8-bit codes\)\s*│\s*([\d.]+)",
            "avg": r"│ AdamW exp_avg \(4-bit codes\)\s*│\s*([\d.]+)",
            "scales": _scales,
        },
    ),
    Prose(
        _70B_LEAN,
        "the planner still times the CPU update with `full`'s memory traffic, {exposed} s exposed",
        {"exposed": _EXPOSED},
    ),
    Prose(
        _1T.replace("h100_sxm", "h100_sxm optim.state=lean"),
        "The largest dense model whose host store fits a 2 TB node is **~{lean}B parameters** "
        "(`full`: ~{full}B)",
        {"lean": r"fits is ~([\d.]+)B parameters", "full": (_1T, r"fits is ~([\d.]+)B parameters")},
    ),
    Prose(
        _1T,
        "(`model=llama_1t`, {params}B parameters) needs an {store} GB host store against the node's "
        "{host} GB — the largest model that fits 2 TB "
        "is ~{largest}B parameters",
        {
            "params": r"llama_1t \(([\d,.]+)B parameters",
            "store": r"the host store needs ([\d,]+) GB",
            "host": r"but h100_sxm has ([\d,]+) GB",
            "largest": r"fits is ~([\d.]+)B parameters",
        },
    ),
    Prose(
        _1T_20TB,
        "only fits it at one sequence per micro-batch, host DRAM-bound at {tps} tokens/s ({dram} GB a "
        "step through host memory: the optimizer, the gradient accumulation and the DMA, at {bw} GB/s): "
        "1T tokens would take {days} days ({years} years).",
        {
            "tps": _TPS,
            "dram": r"host DRAM: ([\d,.]+) GB/step",
            "bw": r"share ([\d,]+) GB/s of DRAM",
            "days": r"\(plan.train_tokens\) = ([\d,.]+) days",
            "years": _years(r"\(plan.train_tokens\) = ([\d,.]+) days"),
        },
    ),
]


_GPUS = {"h100_sxm": "8×H100", "h200": "8×H200"}
_LEAN_ONLY = {"full": "no: host memory", "lean": "yes"}
_MOE_ROWS = [  # (model, hardware, optim.state, the table's "fits?" and bottleneck words)
    *[("qwen3_30b_a3b", hw, st, "yes", "compute") for hw in _GPUS for st in _LEAN_ONLY],
    *[("qwen3_235b_a22b", hw, st, _LEAN_ONLY[st], "host DRAM") for hw in _GPUS for st in _LEAN_ONLY],
    *[
        ("gpt_oss_120b", hw, st, _LEAN_ONLY[st], {"h100_sxm": "host DRAM", "h200": "host accumulation"}[hw])
        for hw in _GPUS
        for st in _LEAN_ONLY
    ],
    *[
        (m, hw, st, "no: host memory + device memory", "host DRAM")
        for m in ("deepseek_v3_671b", "kimi_k2_1t")
        for hw in _GPUS
        for st in _LEAN_ONLY
    ],
]
_TIER = (
    "optim.state=lean store.tier=nvme store.tier_dir=/nvme stream.offload_activations=true stream.slots=1 "
    "train.seq_len=4096 train.micro_batch_size=4 pipeline.microbatches=64"
)
_DENSE_1T_TIER = f"model=llama_1t hardware=h200 {_TIER}"
_DENSE_1T_8TB = f"model=llama_1t hardware=h200 hardware.host_memory_gb=8192 {_TIER}"
_KIMI_8TB = f"model=kimi_k2_1t hardware=h200 hardware.host_memory_gb=8192 {_TIER}"
_RAM = r"│ host store in RAM\s*│\s*[\d.]+\s*│\s*([\d,.]+)"


def _days_per_billion(regex: str) -> Callable[[str], str]:
    def days(out: str) -> str:
        return f"{1e9 / float(_find(regex, out).replace(',', '')) / 86400:,.1f}"

    return days


PROSE += [
    Prose(
        _moe(m, hw, st),
        f"| `{m}` | {_GPUS[hw]} | {st} | {{need}} | {{mb}} | {fits} | {{tps}} | {bottleneck} |",
        {
            "need": r"host need / host memory\s*│\s*│\s*([\d,.]+)",
            "mb": r"largest micro-batch that fits: train.micro_batch_size=(\d+)",
            "tps": _TPS,
        },
    )
    for m, hw, st, fits, bottleneck in _MOE_ROWS
]
PROSE += [
    Prose(
        _DENSE_1T_TIER,
        "the host store still needs {ram} GB of RAM ({bpp} bytes/param: the fp32 gradient accumulator, the "
        "bf16 transfer copy and the tier's buffers; {tier} GB of optimizer state go to NVMe)",
        {
            "ram": _RAM,
            "bpp": r"│ host store in RAM\s*│\s*([\d.]+)",
            "tier": r"of it on NVMe[^│]*│\s*[\d.]+\s*│\s*([\d,.]+)",
        },
    ),
    Prose(
        _DENSE_1T_8TB,
        "the dense 1T model fits and is compute-bound: {tps} tokens/s ({days} days per billion tokens, MFU "
        "{mfu}%) at 4 × 4096 tokens × 64 micro-batches; the smallest compute-bound batch is {tokens} tokens "
        "per step ({m} micro-batches, {small} tokens/s",
        {
            "tps": _TPS,
            "days": _days_per_billion(_TPS),
            "mfu": _MFU,
            "tokens": r"compute-bound from ([\d,]+) tokens/step",
            "m": r"pipeline.microbatches=(\d+)\): [\d,]+ tokens/s",
            "small": r"pipeline.microbatches=\d+\): ([\d,]+) tokens/s",
        },
    ),
    Prose(
        _KIMI_8TB,
        "The Kimi-K2-shaped 1T fits the same node but is host DRAM-bound at {tps} tokens/s ({days} days per "
        "billion tokens, MFU {mfu}%), and compute-bound at no micro-batch that fits (≤ {mb})",
        {"tps": _TPS, "days": _days_per_billion(_TPS), "mfu": _MFU, "mb": r"micro-batch sizes ≤ (\d+)"},
    ),
]


def _find(regex: str, out: str) -> str:
    m = re.search(regex, out)
    if m is None:
        raise LookupError(f"no match of {regex!r} in the planner's output")
    return m.group(1)


@functools.cache
def plan_output(command: str) -> str:
    """What ``python -m nodetrain.plan <command>`` prints (no line wrapping), run in this process."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from rich.console import Console

    from nodetrain.config.registry import register_configs, to_typed
    from nodetrain.config.schema import CONFIG_DIR, ConfigError
    from nodetrain.plan.planner import make_plan
    from nodetrain.plan.report import render

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = to_typed(compose("plan", overrides=shlex.split(command)))
    buf = io.StringIO()
    try:
        render(make_plan(cfg), Console(file=buf, width=10_000, highlight=False))
    except ConfigError as e:
        buf.write(f"ConfigError: {e}\n")
    return buf.getvalue()


def readme_commands(text: str) -> list[str]:
    """The arguments of every ``python -m nodetrain.plan`` command in ``text`` (continuation lines
    joined, ``#`` comments dropped), normalised to single spaces."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in joined.splitlines():
        if line.strip().startswith(PLAN):
            args = line.strip()[len(PLAN) :].split("#", 1)[0]
            found.append(" ".join(args.split()))
    return found


def _shape(quote: str) -> re.Pattern:
    """A regex matching ``quote`` with any figures in place of its figures."""
    parts = re.split(f"({_NUM})", quote)
    return re.compile("".join(_NUM if i % 2 else re.escape(p) for i, p in enumerate(parts)))


@dataclass
class Finding:
    """One quote: where it is in the README (character span), what it says and what it should say."""

    span: tuple[int, int]
    now: str
    want: str
    where: str


def _block_findings(text: str, outputs: dict[str, str]) -> list[Finding]:
    """Each line of a ```text block that follows a ```bash block of planner commands."""
    findings = []
    block = r"((?:(?!```).)*)"  # a fenced block's body: no fence inside
    pattern = re.compile(rf"```bash\n{block}```\n\s*```text\n{block}```", re.S)
    for m in pattern.finditer(text):
        commands = readme_commands(m.group(1))
        if not commands:
            continue
        lines = [ln for c in commands for ln in outputs[c].splitlines()]
        offset = m.start(2)
        for quote in m.group(2).splitlines(keepends=True):
            body = quote.rstrip("\n")
            head = body.split("...", 1)[0] if "..." in body else body
            shape = _shape(head)
            match = next(
                (mm for ln in lines if (mm := (shape.match if "..." in body else shape.fullmatch)(ln))), None
            )
            want = match.group(0) if match else f"<no line of `{commands[0][:40]}...` has this shape>"
            findings.append(Finding((offset, offset + len(head)), head, want, f"text block: {head[:60]}"))
            offset += len(quote)
    return findings


def _words(literal: str) -> str:
    """Regex of prose text: any run of whitespace (a README line break) stands for a space."""
    return r"\s+".join(re.escape(w) for w in literal.split(" "))


def _prose_findings(text: str, outputs: dict[str, str], prose: list[Prose]) -> list[Finding]:
    findings = []
    for p in prose:
        parts = re.split(r"\{(\w+)\}", p.text)
        regex = "".join(f"(?P<{s}>{_NUM})" if i % 2 else _words(s) for i, s in enumerate(parts))
        m = re.search(regex, text)
        if m is None:
            findings.append(Finding((0, 0), "", "<sentence not found>", f"prose: {p.text[:70]}"))
            continue
        out = outputs[p.command]
        for name, how in p.values.items():
            if isinstance(how, tuple):  # (another command, its regex)
                want = _find(how[1], outputs[how[0]])
            else:
                want = how(out) if callable(how) else _find(how, out)
            findings.append(Finding(m.span(name), m.group(name), want, f"prose {{{name}}}: {p.text[:50]}"))
    return findings


def findings(text: str, doc: str = "README.md") -> tuple[list[Finding], list[str]]:
    """(every quote of document ``doc`` (a key of :data:`DOCS`) whose text is ``text``, with its
    recomputed value; problems that --write cannot fix)."""
    commands = set(readme_commands(text))
    prose = [p for p in PROSE if p.doc == doc]
    problems = [f"PROSE command not shown in {doc}: {p.command}" for p in prose if p.command not in commands]
    outputs = {c: plan_output(c) for c in sorted(commands | {p.command for p in prose})}
    found = _block_findings(text, outputs) + _prose_findings(text, outputs, prose)
    problems += [f"{f.where}: {f.want}" for f in found if f.want.startswith("<")]
    return found, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if a quoted figure differs")
    mode.add_argument("--write", action="store_true", help="rewrite the quoted figures in place")
    args = ap.parse_args(argv)
    return max(_check_or_write(doc, path, args.write) for doc, path in DOCS.items())


def _check_or_write(doc: str, path: Path, write: bool) -> int:
    """Check (or rewrite) the figures of one document; 1 if any is stale (after --write: unfixable)."""
    text = path.read_text()
    found, problems = findings(text, doc)
    stale = [f for f in found if not f.want.startswith("<") and f.now != f.want]
    for f in stale:
        print(f"{doc}: {f.where}: it says {f.now!r}, the planner prints {f.want!r}")
    for line in problems:
        print(f"{doc}: problem: {line}")
    if write and stale:
        for f in sorted(stale, key=lambda f: f.span, reverse=True):
            text = text[: f.span[0]] + f.want + text[f.span[1] :]
        path.write_text(text)
        print(f"rewrote {len(stale)} figure(s) in {path}")
        return 1 if problems else 0
    agree = len(found) - len(stale) - len(problems)
    print(f"{doc}: {agree} of {len(found)} quoted figures agree with the planner")
    return 1 if stale or problems else 0


if __name__ == "__main__":
    sys.exit(main())
