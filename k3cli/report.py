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
