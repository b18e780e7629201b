"""Rich rendering of command results (tables only; the numbers come from plain functions)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from k3cli.layout import human


def print_layout(console: Console, data: dict, title: str) -> None:
    ar = data["attnres"]
    mode = ar["mode"] + (f", S={ar['block_size']}" if ar["mode"] == "block" else "")
    table = Table(title=f"{title}: {data['arch']} model, {data['num_hidden_layers']} blocks, AttnRes {mode}")
    for col, just in (("block", "right"), ("attention", "left"), ("FFN", "left"),
                      ("sublayers", "left"), ("AttnRes group", "left"), ("params", "right")):
        table.add_column(col, justify=just)
    for r in data["blocks"]:
        kind = r["attn"].upper()
        style = "bold yellow" if kind == "MLA" else "cyan"
        table.add_row(str(r["index"]), f"[{style}]{kind}[/]", "MoE" if r["ffn"] == "moe" else "SwiGLU",
                      f"{r['attn_sublayer']}, {r['ffn_sublayer']}",
                      f"{r['attn_group']}, {r['ffn_group']}", human(r["params"]))
    console.print(table)
    console.print(f"pattern: {data['pattern']}")
    p = data["params"]
    console.print(f"parameters: total {human(p['total'])} ({p['total']:,}), "
                  f"active per token {human(p['active'])} ({p['active']:,})")
    console.print(f"  embedding {human(p['embedding'])}, lm_head {human(p['lm_head'])}, "
                  f"blocks {human(p['blocks'])}, attnres {human(p['attnres'])}")


def print_eval(console: Console, res: dict) -> None:
    table = Table(title=f"eval: {res['checkpoint']} (step {res['step']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("validation loss (nats/token)", f"{res['val_loss']:.4f}")
    table.add_row("unigram entropy of the val set (baseline)", f"{res['unigram_entropy']:.4f}")
    table.add_row("perplexity", f"{res['perplexity']:.2f}")
    table.add_row("bits per byte", f"{res['bits_per_byte']:.4f}")
    table.add_row("bytes per token", f"{res['bytes_per_token']:.3f}")
    table.add_row("tokens", f"{res['tokens']:,}")
    table.add_row(f"tokens/s ({res['device']})", f"{res['tokens_per_s']:,.0f}")
    console.print(table)
