"""Measuring speed: `k3 bench-train` times one training step against references in the same run (`train`);
`k3 bench-kernel` and `k3 verify-equivalence` run the kernels' registry (`kernels`)."""
