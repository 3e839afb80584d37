"""Rendering: a :class:`CrossCheckResult` as rich tables (one row per stage output, one column per pair;
the EP summary apart) and a verdict line."""

from __future__ import annotations

from interop.crosscheck.judge import NO_ROWS, PSEUDO, SELF, Comparison, CrossCheckResult
from interop.crosscheck.stages import BACKWARD_STAGE_NAMES, EP_BACKWARD_STAGE, EP_STAGE, pairs

EP_STAGES = (EP_STAGE, EP_BACKWARD_STAGE)

PAIR_LABEL = {
    ("pallas_triton", "jnp-reference"): "pallas vs jnp",
    ("pallas_mosaic_gpu", "jnp-reference"): "mosaic vs jnp",
    ("triton", "torch-reference"): "triton vs torch",
    ("torch-reference", "jnp-reference"): "torch vs jnp",
    ("triton", "pallas_triton"): "triton vs pallas",
    ("triton", "pallas_mosaic_gpu"): "triton vs mosaic",
}


def _pair_label(a: str, b: str) -> str:
    if b == SELF:
        return "fused = quant(own f32)"
    if b == NO_ROWS:
        return "= 0 where an expert has no rows"
    return PAIR_LABEL.get((a, b), f"{a} vs {b}")


def _ep_label(c: Comparison) -> str:
    return c.a if c.a == c.b else _pair_label(c.a, c.b)


def _cell(c: Comparison) -> str:
    return f"[green]{c.summary()}[/green]" if c.ok else f"[bold red]{c.summary()} ✗[/bold red]"


def render(result: CrossCheckResult, console=None) -> None:
    """The result as a rich table (one row per stage output, one column per pair) and a verdict line."""
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a pipe: wide enough for one line per row
            console = Console(width=160)
    cfg = result.meta["config"]
    stage_comps = [c for c in result.comparisons if c.stage not in EP_STAGES]
    if stage_comps or "ep" not in result.meta:
        _render_stages(result, stage_comps, console, cfg)
    if "ep" in result.meta:
        _render_ep(result, console, cfg)
    for note in result.meta.get("backward", {}).get("notes", []):
        console.print(f"[yellow]{note}[/yellow]")
    for name, why in result.skipped.items():
        console.print(f"[yellow]skipped {name}[/yellow] (NotImplementedError at {why})")
    for name, why in result.not_served.items():
        console.print(f"[yellow]{name}: not served: {why}[/yellow] (a default implementation; not a violation)")
    for where, why in result.errors.items():
        console.print(f"[bold red]error at {where}[/bold red]: {why}")
    if result.ok:
        console.print(f"[bold green]all {len(result.comparisons)} comparisons within the contract[/bold green] "
                      f"({result.meta['runtime_s']:.1f} s)")
    else:
        bad = [c for c in result.comparisons if not c.ok]
        console.print(f"[bold red]VIOLATION at stage(s) {', '.join(result.failed_stages)}[/bold red]: "
                      + "; ".join(f"{c.stage}/{c.output} {_ep_label(c) if c.stage in EP_STAGES else _pair_label(c.a, c.b)}: "
                                  f"{c.summary()} (rule: {c.rule})" for c in bad[:6]))


def _render_ep(result: CrossCheckResult, console, cfg) -> None:
    from rich.table import Table

    ep = result.meta["ep"]
    what = "layer outputs" + (" and gradients" if ep.get("backward") else "")
    table = Table(title=f"expert parallelism: the {ep['ep_size']} ranks' {what} summed in float32 (ep_sum) "
                        f"vs the single device; T={result.meta['num_tokens']} quant={cfg['quant']} inputs={ep['dtype']} "
                        f"seed={result.meta['seed']}")
    for col in ("check", "implementation(s)", "result", "rule"):
        table.add_column(col)
    for c in (c for c in result.comparisons if c.stage in EP_STAGES):
        table.add_row(c.output, _ep_label(c), _cell(c), c.rule)
    console.print(table)
    for note in ep["notes"]:
        console.print(f"[yellow]{note}[/yellow]")


def _render_stages(result: CrossCheckResult, comparisons: list[Comparison], console, cfg) -> None:
    from rich.table import Table

    present = {(c.a, c.b) for c in comparisons if c.b not in PSEUDO}
    columns = [p for p in pairs(result.meta["implementations"]) if p in present]
    backward = "backward" in result.meta
    table = Table(title=f"cross-check{' (forward, then backward)' if backward else ''}: T={result.meta['num_tokens']} "
                        f"M={result.meta['M']} quant={cfg['quant']} EP rank {cfg['ep_rank']}/{cfg['ep_size']} "
                        f"seed={result.meta['seed']}")
    table.add_column("stage")
    table.add_column("output")
    for p in columns:
        table.add_column(_pair_label(*p))
    rows: dict[tuple[str, str], dict] = {}
    own: dict[str, dict[str, list[Comparison]]] = {}  # pseudo-pair -> implementation -> comparisons
    for c in comparisons:
        if c.b in PSEUDO:
            own.setdefault(c.b, {}).setdefault(c.a, []).append(c)
        else:
            rows.setdefault((c.stage, c.output), {})[(c.a, c.b)] = c
    in_backward = False
    for (stage, output), cells in rows.items():
        if stage in BACKWARD_STAGE_NAMES and not in_backward:
            table.add_section()
            in_backward = True
        table.add_row(stage, output, *("" if cells.get(p) is None else _cell(cells[p]) for p in columns))
    console.print(table)
    words = {SELF: "act: fused FP8 codes and scales = the reference quantization of the same implementation's "
                   "float32 activation: ",
             NO_ROWS: "weight (and bias) gradients (wgrad, dbias, layer) of the experts with no rows exactly 0: "}
    for pseudo, by_impl in own.items():
        cells = [f"{n} [green]yes[/green]" if all(c.ok for c in cs) else
                 f"{n} [bold red]NO ({'; '.join(f'{c.stage}/{c.output}: {c.summary()}' for c in cs if not c.ok)})[/bold red]"
                 for n, cs in by_impl.items()]
        console.print(words[pseudo] + ", ".join(cells))
