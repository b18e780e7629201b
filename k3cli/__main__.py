"""`python -m k3cli ...` is `k3 ...`: the form torchrun starts, `torchrun --nproc-per-node N -m k3cli train ...`."""
from k3cli.cli import app

if __name__ == "__main__":
    app(prog_name="k3")
