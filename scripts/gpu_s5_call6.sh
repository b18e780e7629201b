#!/usr/bin/env bash
# Session 5, device call 6 (the last 130 s of the session's device time): the committed defaults (after the
# dg-dtype fix) against opt-in forward-stored states and the backward reading the forward's stored Γ.
#   run(command="bash scripts/gpu_s5_call6.sh", timeout_s=100)
set -uo pipefail
source scripts/gpu_env.sh
timeout 88 python3 scripts/kda_sweep.py base sgamma store_states 2>&1 | tee "$OUT/sweep.txt" | tail -5
