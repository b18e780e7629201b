"""Using a trained model: find and open a run, checkpoint or export (`runs`), measure it on held-out text
(`evaluate`), and generate from it with the decode cache (`generate`)."""
