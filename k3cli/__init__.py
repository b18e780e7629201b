"""k3: train, evaluate and measure K3 hybrid language models.

The public Python API is `load`; the modules below it are free to move."""
__version__ = "0.1.0"


def load(path, device: str = "auto"):
    """A trained k3 model from a run directory (its newest checkpoint that verifies), a checkpoint folder
    (runs/X/checkpoints/step_N) or a `k3 export` folder. Returns an object with `.model` (the CausalLM, eval
    mode), `.tokenizer`, `.config` (the run's RunConfig), `.step`, `.encode(text)` and `.generate(prompt)`.
    `device`: auto | cpu | cuda."""
    from k3cli.evaluation.runs import load as _load

    return _load(path, device)


__all__ = ["load"]
