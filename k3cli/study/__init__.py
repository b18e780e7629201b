"""Comparing runs: `k3 study` (seeded runs of several variants, paired statistics, a report: `study`),
`k3 compare` (`compare`), the statistics (`stats`) and the loss plots (`plot`)."""
