"""Using a trained model: find and open a run, checkpoint or export (`runs`), measure it on held-out text
(`evaluate`), generate from it with the decode cache (`generate`), run benchmark tasks through
lm-evaluation-harness (`harness`), and write it for Hugging Face transformers (`hf`, `modeling_k3`)."""
